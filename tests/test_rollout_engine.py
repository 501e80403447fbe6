"""Rollout engine: log-prob parity with the training path, reproducibility, stops, filters."""
from __future__ import annotations

import pytest
import torch

from sealrl.experience.records import SamplingContract, StopReason
from sealrl.experience.wire import GenerationRequest
from sealrl.models.hf import model_config_hash, tokenizer_hash
from sealrl.models.logprobs import pad_batch, response_log_probs
from sealrl.models.tiny import build_tiny_model
from sealrl.rollout import RolloutEngine
from sealrl.sync.manifest import build_manifest

ANSWERS = {"07+45=": "25", "12+30=": "24"}  # the arithmetic task's reversed-answer format



def make_engine(model, tokenizer, step=0, **kwargs):
    manifest = build_manifest(model.state_dict(), "run", step, 0, tokenizer_hash(tokenizer),
                              model_config_hash(model.config))
    engine = RolloutEngine(model, tokenizer, **kwargs)
    engine.load_weights(model.state_dict(), manifest)
    return engine, manifest.version


def encode(tokenizer, text):
    return tuple(tokenizer(text, add_special_tokens=False).input_ids)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model(seed=0)


@pytest.fixture(scope="module")
def trained():
    """The tiny model after memorising ANSWERS (+ eos): it stops on its own, like a warm start."""
    model, tokenizer = build_tiny_model(seed=0)
    seqs = [list(encode(tokenizer, p + a)) + [tokenizer.eos_token_id] for p, a in ANSWERS.items()]
    ids = torch.tensor(seqs)
    labels = ids.clone()
    labels[:, :6] = -100  # loss on the answer and eos only
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(60):
        opt.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
    return model.eval(), tokenizer


def mixed_requests(tokenizer):
    """Two groups sharing their prompt across candidates, prompts of different lengths."""
    return [GenerationRequest("run/0/a", encode(tokenizer, "07+45="), seed=11, candidates=(0, 1, 2)),
            GenerationRequest("run/0/b", encode(tokenizer, "3+4="), seed=12, candidates=(0, 1)),
            GenerationRequest("run/0/c", encode(tokenizer, "100+200+300="), seed=13, candidates=(4,))]


def rollout_vs_teacher_forced(model, samples, temperature) -> float:
    prompts = [list(s.prompt_ids) for s in samples]
    responses = [list(s.response_ids) for s in samples]
    with torch.no_grad():
        lp, _, mask = response_log_probs(model, prompts, responses, temperature)
    rollout = torch.zeros_like(lp)
    for b, s in enumerate(samples):
        assert len(s.rollout_log_probs) == len(s.response_ids)
        rollout[b, :len(s.rollout_log_probs)] = torch.tensor(s.rollout_log_probs)
    return (rollout - lp).abs().max().item()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("batch", ["single", "mixed"])
def test_log_prob_parity_with_teacher_forcing(tiny, temperature, batch):
    model, tokenizer = tiny
    engine, version = make_engine(model, tokenizer)
    requests = (mixed_requests(tokenizer) if batch == "mixed" else
                [GenerationRequest("run/0/a", encode(tokenizer, "07+45="), seed=1, candidates=(0,))])
    contract = SamplingContract(temperature=temperature, max_new_tokens=12)
    samples = engine.generate(requests, contract, version)
    assert rollout_vs_teacher_forced(model, samples, temperature) <= 1e-5
    assert engine.backend_name == "LeanBackend"


def test_token_contract_with_the_training_layout(tiny):
    model, tokenizer = tiny
    engine, version = make_engine(model, tokenizer)
    samples = engine.generate(mixed_requests(tokenizer), SamplingContract(max_new_tokens=6), version)
    assert [s.sample_id for s in samples] == ["run/0/a/0", "run/0/a/1", "run/0/a/2", "run/0/b/0",
                                              "run/0/b/1", "run/0/c/4"]
    batch = pad_batch([list(s.prompt_ids) for s in samples], [list(s.response_ids) for s in samples])
    for b, s in enumerate(samples):
        executed = batch.input_ids[b][batch.attention_mask[b].bool()].tolist()
        assert executed == list(s.prompt_ids) + list(s.response_ids)
        first = batch.response_mask[b].nonzero()[0].item()
        assert first == 0 and batch.response_ids[b, first].item() == s.response_ids[0]
        assert s.policy_version == version and s.filtered_log_probs is None


def test_same_seed_same_response_alone_or_in_any_batch(tiny):
    model, tokenizer = tiny
    engine, version = make_engine(model, tokenizer)
    contract = SamplingContract(temperature=1.0, max_new_tokens=16)
    full = engine.generate(mixed_requests(tokenizer), contract, version)
    again = engine.generate(mixed_requests(tokenizer), contract, version)
    assert [s.response_ids for s in full] == [s.response_ids for s in again]
    # A retry regenerates candidate 1 of group a alone: same seed, same tokens.
    retry = engine.generate([GenerationRequest("run/0/a", encode(tokenizer, "07+45="), seed=11,
                                               candidates=(1,))], contract, version)
    assert retry[0].response_ids == full[1].response_ids and retry[0].seed == full[1].seed
    assert max(abs(a - b) for a, b in zip(retry[0].rollout_log_probs, full[1].rollout_log_probs)) < 1e-5
    # Group c inside another batch (other prompts, other padding) gives the same response.
    other = [GenerationRequest("x/0/y", encode(tokenizer, "9="), seed=99, candidates=tuple(range(5)))]
    mixed = engine.generate(other + mixed_requests(tokenizer)[2:], contract, version)
    assert mixed[-1].response_ids == full[-1].response_ids
    # Candidates of one group get different seeds, hence (almost surely) different responses.
    assert len({s.seed for s in full}) == len(full)
    assert len({s.response_ids for s in full[:3]}) == 3


def test_stop_reasons(trained):
    model, tokenizer = trained
    engine, version = make_engine(model, tokenizer)
    request = [GenerationRequest("run/0/a", encode(tokenizer, "07+45="), seed=5, candidates=(0, 1))]
    eos, five = tokenizer.eos_token_id, encode(tokenizer, "5")[0]

    def run(**contract):
        return engine.generate(request, SamplingContract(temperature=0.5, **contract), version)

    for s in run(max_new_tokens=8):
        assert s.response_ids == encode(tokenizer, "25") + (eos,) and s.stop_reason is StopReason.EOS
        assert s.stop_reason.terminated
    for s in run(max_new_tokens=2):
        assert s.response_ids == encode(tokenizer, "25") and s.stop_reason is StopReason.LENGTH
        assert s.stop_reason.truncated
    for s in run(max_new_tokens=1):  # prefill only, no decode step
        assert s.response_ids == encode(tokenizer, "2") and s.stop_reason is StopReason.LENGTH
    for s in run(max_new_tokens=8, stop_token_ids=(five,)):
        assert s.response_ids == (encode(tokenizer, "2")[0], five) and s.stop_reason is StopReason.STOP
    for s in run(max_new_tokens=8, stop=("25",)):  # the token completing the string is kept
        assert s.response_ids == encode(tokenizer, "25") and s.stop_reason is StopReason.STOP
    for s in run(max_new_tokens=8, stop=("9",)):  # never produced: eos ends it
        assert s.stop_reason is StopReason.EOS


def record_decode_batches(engine) -> list[int]:
    backend, sizes = engine.versions.active.held, []
    decode = backend.decode
    backend.decode = lambda cache, ids, *a: (sizes.append(ids.shape[0]), decode(cache, ids, *a))[1]
    return sizes


def distinct_running_states(samples, k: int) -> int:
    """Rows still running after sampling token k, counted once per distinct token sequence."""
    return len({(s.prompt_ids, s.response_ids[:k + 1]) for s in samples
                if len(s.response_ids) > k + 1})


def test_finished_rows_leave_the_batch(tiny):
    """Decode call k runs exactly the distinct states still going after token k; nothing after
    all stopped. Stop tokens cover a quarter of the vocabulary: rows stop at varied lengths."""
    model, tokenizer = tiny
    engine, version = make_engine(model, tokenizer)
    sizes = record_decode_batches(engine)
    contract = SamplingContract(max_new_tokens=12, stop_token_ids=tuple(range(4, 26)))
    samples = engine.generate(mixed_requests(tokenizer), contract, version)
    lengths = [len(s.response_ids) for s in samples]
    assert len(set(lengths)) > 2
    assert sizes == [distinct_running_states(samples, k) for k in range(max(lengths) - 1)]
    for s in samples:   # a stop token, the tokenizer's own <eos>, or the budget
        last = s.response_ids[-1]
        assert s.stop_reason is (StopReason.STOP if last in range(4, 26) else
                                 StopReason.EOS if last == tokenizer.eos_token_id else StopReason.LENGTH)
        assert s.stop_reason is not StopReason.LENGTH or len(s.response_ids) == 12


def test_candidates_share_states_while_their_tokens_coincide(trained):
    """A confident policy: 16 candidates of one prompt mostly agree, so a decode step runs far
    fewer than 16 rows; each candidate alone gives exactly what it gave in the group."""
    model, tokenizer = trained
    engine, version = make_engine(model, tokenizer)
    sizes = record_decode_batches(engine)
    contract = SamplingContract(temperature=1.0, max_new_tokens=8)
    prompt = encode(tokenizer, "12+30=")
    group = engine.generate([GenerationRequest("run/0/q", prompt, 21, tuple(range(16)))],
                            contract, version)
    assert sizes == [distinct_running_states(group, k) for k in range(len(sizes))]
    assert max(sizes) < 16
    for c in (0, 7, 15):
        alone = engine.generate([GenerationRequest("run/0/q", prompt, 21, (c,))], contract, version)
        assert alone[0].response_ids == group[c].response_ids
        assert alone[0].rollout_log_probs == pytest.approx(group[c].rollout_log_probs, abs=1e-6)


@pytest.mark.parametrize("top_k, top_p", [(3, 1.0), (0, 0.3), (5, 0.5)])
def test_filters_never_sample_outside_and_report_filtered_log_probs(tiny, top_k, top_p):
    model, tokenizer = tiny
    engine, version = make_engine(model, tokenizer)
    contract = SamplingContract(temperature=0.7, top_k=top_k, top_p=top_p, max_new_tokens=8)
    samples = engine.generate(mixed_requests(tokenizer), contract, version)
    for s in samples:
        assert s.filtered_log_probs is not None and len(s.filtered_log_probs) == len(s.response_ids)
        ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
        with torch.no_grad():
            z = model(ids).logits[0, len(s.prompt_ids) - 1:-1] / 0.7  # (R, V)
        for j, token in enumerate(s.response_ids):
            order = z[j].argsort(descending=True).tolist()
            rank = order.index(token)
            probs = z[j].softmax(-1)[order]
            kept = len(order) if top_k == 0 else top_k
            if top_p < 1:
                within_k = probs[:kept] / probs[:kept].sum()
                kept = min(kept, int((within_k.cumsum(0) - within_k < top_p).sum()))
            assert rank < kept
            filtered = z[j].clone()
            filtered[order[kept:]] = float("-inf")
            expected = torch.log_softmax(filtered, -1)[token].item()
            assert abs(s.filtered_log_probs[j] - expected) <= 1e-5
            assert s.rollout_log_probs[j] <= s.filtered_log_probs[j] + 1e-6
    assert rollout_vs_teacher_forced(model, samples, 0.7) <= 1e-5  # unfiltered space


def test_lean_and_hf_backends_agree(tiny):
    model, tokenizer = tiny
    lean, version = make_engine(model, tokenizer)
    hf, _ = make_engine(model, tokenizer, prefer_lean=False)
    assert hf.backend_name == "HFBackend"
    contract = SamplingContract(temperature=0.8, max_new_tokens=10)
    a = lean.generate(mixed_requests(tokenizer), contract, version)
    b = hf.generate(mixed_requests(tokenizer), contract, version)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    for x, y in zip(a, b):
        assert max(abs(p - q) for p, q in zip(x.rollout_log_probs, y.rollout_log_probs)) <= 1e-5
    assert rollout_vs_teacher_forced(model, b, 0.8) <= 1e-5


def test_requests_are_validated(tiny):
    model, tokenizer = tiny
    engine, version = make_engine(model, tokenizer)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        GenerationRequest("g", (), 0, (0,))
    with pytest.raises(ValueError, match="unique"):
        GenerationRequest("g", (1,), 0, (0, 0))
    twice = [GenerationRequest("g", (5,), 0, (0,)), GenerationRequest("g", (6,), 1, (0,))]
    with pytest.raises(ValueError, match="requested twice"):
        engine.generate(twice, SamplingContract(), version)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([GenerationRequest("g", (10_000,), 0, (0,))], SamplingContract(), version)
    assert engine.generate([], SamplingContract(), version) == []


def test_hf_backend_refuses_a_cache_the_forward_ignores(tiny):
    """transformers 5.25 renamed the forward's `past_key_values` to `cache`, and each version
    drops the other name in **kwargs: decoding would then run without its context (log-probs
    0.8 nats off on an H200 image with 5.17). The backend passes the name its transformers
    takes, and a prefill that leaves the cache empty is an error, not a wrong sample."""
    from sealrl.rollout.backends import HFBackend, weightless_template
    model, _ = tiny
    backend = HFBackend(dict(model.state_dict()), weightless_template(model), torch.device("cpu"))
    ids = torch.tensor([[11, 12, 14]])
    valid = torch.ones_like(ids, dtype=torch.bool)
    positions = torch.arange(3)[None]
    logits, cache = backend.prefill(ids, positions, valid, 8)
    assert cache.get_seq_length() == 3
    backend._cache_key = "kv_cache"   # a name no version takes: dropped as the old one is
    with pytest.raises(RuntimeError, match="did not fill the KV cache"):
        backend.prefill(ids, positions, valid, 8)
