import subprocess
import sys

import pytest
import torch

from sealrl.experience import (
    ExperienceError,
    PolicyVersion,
    RewardRecord,
    RewardStatus,
    Role,
    SamplingContract,
    StopReason,
    pad_token_rows,
    split_sample_id,
)
from tests.helpers_experience import REF, V0, add_rewards, make_batch


def test_light_imports():
    code = ("import sys, sealrl.algos, sealrl.experience; "
            "bad = [m for m in ('ray', 'transformers', 'vllm', 'pyarrow', 'tokenizers') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_policy_version_id_is_stable_and_sensitive():
    a = PolicyVersion("run", 3, 0, "w", "t", "c")
    assert a.id == PolicyVersion("run", 3, 0, "w", "t", "c").id
    assert a.id.startswith("run@3.0#")
    # every component changes the id
    for other in (PolicyVersion("run", 4, 0, "w", "t", "c"), PolicyVersion("run", 3, 1, "w", "t", "c"),
                  PolicyVersion("run", 3, 0, "x", "t", "c"), PolicyVersion("run", 3, 0, "w", "u", "c"),
                  PolicyVersion("run", 3, 0, "w", "t", "d"), PolicyVersion("rum", 3, 0, "w", "t", "c")):
        assert other.id != a.id
    assert PolicyVersion.from_json(a.to_json()) == a


def test_sample_id_round_trip():
    assert split_sample_id("run/3/p7/5") == ("run/3/p7", 5)
    with pytest.raises(ValueError, match="malformed"):
        split_sample_id("nocandidate")


def test_stop_reason_semantics():
    assert StopReason.EOS.terminated and StopReason.STOP.terminated
    assert StopReason.LENGTH.truncated and not StopReason.LENGTH.terminated
    assert not StopReason.ERROR.terminated and not StopReason.ERROR.truncated
    assert not StopReason.TOOL.terminated


def test_reward_record_never_collapses_error_into_score():
    ok = RewardRecord.success(0.5, "arith", components={"exact": 0.5})
    assert ok.score() == 0.5
    bad = RewardRecord.failure(RewardStatus.ERROR, "arith", "ZeroDivisionError")
    assert bad.total is None
    with pytest.raises(ValueError, match="not a score"):
        bad.score()
    with pytest.raises(ValueError, match="must not carry a total"):
        RewardRecord(RewardStatus.TIMEOUT, 0.0, {}, "arith")
    with pytest.raises(ValueError, match="finite"):
        RewardRecord(RewardStatus.OK, float("nan"), {}, "arith")
    assert RewardRecord.from_json(bad.to_json()) == bad
    assert RewardRecord.from_json(ok.to_json()) == ok


def test_sampling_contract_validation():
    with pytest.raises(ValueError, match="temperature"):
        SamplingContract(temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingContract(top_p=1.5)
    c = SamplingContract(stop=["\n"], stop_token_ids=[2], top_k=5)
    assert c.filtered and SamplingContract.from_json(c.to_json()) == c


def test_write_once_and_producer_checks():
    b = make_batch()
    with pytest.raises(ExperienceError, match="already written"):
        b.put("rollout_log_probs", torch.zeros(4, 4), Role.ROLLOUT, V0.id)
    # the reference role may not write the old slot, the actor may not write ref
    with pytest.raises(ExperienceError, match="produced by actor/rollout, not reference"):
        b.put("old_log_probs", torch.zeros(4, 4), Role.REFERENCE, REF.id)
    with pytest.raises(ExperienceError, match="produced by reference, not actor"):
        b.put("ref_log_probs", torch.zeros(4, 4), Role.ACTOR, V0.id)
    with pytest.raises(ExperienceError, match="unknown experience field 'ref_logprobs'"):
        b.put("ref_logprobs", torch.zeros(4, 4), Role.REFERENCE, REF.id)


def test_shape_dtype_and_padding_checks():
    b = make_batch()
    with pytest.raises(ExperienceError, match="shape"):
        b.put("ref_log_probs", torch.zeros(4, 3), Role.REFERENCE, REF.id)
    with pytest.raises(ExperienceError, match="dtype"):
        b.put("ref_log_probs", torch.zeros(4, 4, dtype=torch.float64), Role.REFERENCE, REF.id)
    garbage = torch.ones(4, 4)  # sample 1 has one token, so columns 1.. are padding
    with pytest.raises(ExperienceError, match="padding must be 0"):
        b.put("ref_log_probs", garbage, Role.REFERENCE, REF.id)


def test_versioned_read_names_field_and_versions():
    b = make_batch()
    b.put("ref_log_probs", pad_token_rows([[-1.0] * 3, [-1.0], [], [-1.0] * 4], 4, torch.float32),
          Role.REFERENCE, REF.id)
    assert b.get("ref_log_probs", version=REF.id).shape == (4, 4)
    with pytest.raises(ExperienceError, match=f"'ref_log_probs': expected version {V0.id}, found {REF.id}"):
        b.get("ref_log_probs", version=V0.id)
    with pytest.raises(ExperienceError, match="'old_log_probs' of version .* is absent"):
        b.get("old_log_probs", version=V0.id)
    with pytest.raises(ExperienceError, match="expected producer actor, found rollout"):
        b.get("rollout_log_probs", producer=Role.ACTOR)


def test_seal_freezes_facts_but_not_derived():
    b = make_batch()
    with pytest.raises(ExperienceError, match="missing facts"):
        b.seal(required=("response_mask", "rollout_log_probs", "reward_records"))
    add_rewards(b)
    digest = b.seal(required=("response_mask", "rollout_log_probs", "reward_records"))
    assert b.sealed and len(digest) == 64
    with pytest.raises(ExperienceError, match="is a fact and the batch is sealed"):
        b.put("old_log_probs", torch.zeros(4, 4), Role.ROLLOUT, V0.id)
    b.put("scores", torch.tensor([0.0, 1.0, 1.0, 0.0]), Role.DRIVER, "policy")  # derived: allowed
    b.verify_seal()
    # an in-place change to a fact after sealing is detected
    b.get("rollout_log_probs")[0, 0] += 1.0
    with pytest.raises(ExperienceError, match="changed after sealing"):
        b.verify_seal()


def test_select_keeps_provenance_and_width():
    b = make_batch()
    add_rewards(b)
    b.seal()
    sub = b.select_ids([b.sample_ids[3], b.sample_ids[1]])
    assert sub.sample_ids == [b.sample_ids[3], b.sample_ids[1]]
    assert sub.num_response_tokens == 4 and sub.sealed
    assert sub.provenance("rollout_log_probs") == (Role.ROLLOUT, V0.id)
    torch.testing.assert_close(sub.get("rollout_log_probs")[0], b.get("rollout_log_probs")[3])
    assert sub.get("reward_records")[1] == b.get("reward_records")[1]
    with pytest.raises(ExperienceError, match="unknown sample ids"):
        b.select_ids(["nope"])


def test_duplicate_sample_ids_rejected():
    b = make_batch()
    from sealrl.experience import ExperienceBatch
    with pytest.raises(ExperienceError, match="duplicate sample id"):
        ExperienceBatch("run", 0, [b.samples[0], b.samples[0]], b.contract, [V0])
