"""PromptSampler: epochs, batch contents, and exact resume from a JSON state."""
import itertools
import json

import pytest

from sealrl.data.sampler import PromptSampler, epoch_permutation


def take(sampler, n):
    return list(itertools.islice(iter(sampler), n))


def test_epochs_cover_every_prompt_once_and_reshuffle():
    s = PromptSampler(10, 4, seed=3)
    batches = take(s, 6)  # two epochs of 4 + 4 + 2
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4, 2]
    e0, e1 = sum(batches[:3], []), sum(batches[3:], [])
    assert sorted(e0) == sorted(e1) == list(range(10))
    assert e0 != e1
    assert e0 == epoch_permutation(10, 3, 0) and e1 == epoch_permutation(10, 3, 1)


def test_golden_permutation():
    # Pinned: a change here means every resumed run would see a different prompt order.
    assert epoch_permutation(8, seed=0, epoch=0) == [0, 5, 7, 3, 4, 1, 6, 2]


def test_drop_last_and_no_shuffle():
    s = PromptSampler(10, 4, seed=0, drop_last=True)
    assert [len(b) for b in take(s, 5)] == [4] * 5
    assert (s.epoch, s.cursor) == (2, 4)
    assert take(PromptSampler(5, 2, shuffle=False), 4) == [[0, 1], [2, 3], [4], [0, 1]]
    with pytest.raises(ValueError, match="batch_size=8 > num_prompts=5"):
        PromptSampler(5, 8, drop_last=True)


@pytest.mark.parametrize("cut", [0, 1, 2, 3, 7])
def test_resume_mid_epoch_is_exact(cut):
    full = take(PromptSampler(11, 3, seed=42), 12)
    first = PromptSampler(11, 3, seed=42)
    head = take(first, cut)
    state = json.loads(json.dumps(first.state_dict()))  # through JSON, as in a checkpoint
    resumed = PromptSampler(11, 3, seed=42)
    resumed.load_state_dict(state)
    assert head + take(resumed, 12 - cut) == full


def test_state_mismatch_is_refused():
    state = PromptSampler(11, 3, seed=42).state_dict()
    with pytest.raises(ValueError, match="num_prompts=11 but this sampler was built with num_prompts=12"):
        PromptSampler(12, 3, seed=42).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=42"):
        PromptSampler(11, 3, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="invalid position"):
        PromptSampler(11, 3, seed=42).load_state_dict({**state, "cursor": 12})
