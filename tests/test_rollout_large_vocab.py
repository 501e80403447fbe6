"""The rollout at real shapes: the nucleus filter without a full-vocabulary sort equals the
full-sort definition (written out here); GQA + tied embeddings + a large vocabulary with
top-k/top-p keep rollout == teacher-forced log-probs (<= 1e-5 fp32); bf16 weights exported to
the rollout carry checksums over the bf16 tensors, and the bf16 parity gap is bounded."""
from __future__ import annotations

import pytest
import torch

from sealrl.experience.records import SamplingContract
from sealrl.experience.wire import GenerationRequest
from sealrl.models.hf import model_config_hash, tokenizer_hash
from sealrl.models.logprobs import response_log_probs
from sealrl.models.synthetic import build_mid
from sealrl.rollout import RolloutEngine
from sealrl.rollout.sampling import filter_logits, nucleus_drop
from sealrl.sync.manifest import WeightSyncError, build_manifest, in_dtype, verify_weights


def full_sort_drop(z, top_p):
    """The definition: sort the whole row, drop tokens whose strictly-more-likely mass >= top_p."""
    sorted_z, order = z.sort(dim=-1, descending=True)
    probs = sorted_z.softmax(-1)
    drop_sorted = (probs.cumsum(-1) - probs) >= top_p
    return drop_sorted.scatter(-1, order, drop_sorted)


@pytest.mark.parametrize("scale", [0.1, 1.0, 8.0])   # flat (nucleus of thousands) .. peaked (a few)
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.99])
def test_partial_nucleus_equals_the_full_sort(scale, top_p):
    z = torch.randn(6, 5000, generator=torch.Generator().manual_seed(0)) * scale
    assert torch.equal(nucleus_drop(z, top_p), full_sort_drop(z, top_p))
    assert torch.equal(nucleus_drop(z, top_p, first=2), full_sort_drop(z, top_p))  # widened many times


def test_top_k_then_top_p_keeps_the_hand_derived_set():
    z = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0]])
    # top-2 keeps {0, 2}; renormalised p(0) = e^3/(e^3+e^2) = 0.731 < 0.8, so both stay; 0.7 keeps only 0
    assert torch.isinf(filter_logits(z, 2, 0.8)).tolist() == [[False, True, False, True, True]]
    assert torch.isinf(filter_logits(z, 2, 0.7)).tolist() == [[False, True, True, True, True]]


def _engine(model, tokenizer, state=None):
    state = state if state is not None else model.state_dict()
    manifest = build_manifest(state, "run", 0, 0, tokenizer_hash(tokenizer), model_config_hash(model.config))
    engine = RolloutEngine(model, tokenizer)
    engine.load_weights(state, manifest)
    return engine, manifest


REQUESTS = [GenerationRequest("g/0", (12, 13, 14, 15, 16, 17), 1, (0, 1, 2)),
            GenerationRequest("g/1", (5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2, (0, 1)),
            GenerationRequest("g/2", (20,), 3, (7,))]


def _parity(engine, manifest, model, contract):
    samples = engine.generate(REQUESTS, contract, manifest.version)
    with torch.no_grad():
        lp, _, _ = response_log_probs(model, [list(s.prompt_ids) for s in samples],
                                      [list(s.response_ids) for s in samples], contract.temperature)
    return max(float((torch.tensor(s.rollout_log_probs) - lp[b, :len(s.response_ids)]).abs().max())
               for b, s in enumerate(samples)), samples


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (50, 1.0), (0, 0.9), (100, 0.95)])
def test_gqa_tied_large_vocab_parity_fp32(top_k, top_p):
    model, tokenizer = build_mid(seed=0, vocab_size=8192, hidden=64, layers=2, heads=4, kv_heads=2, mlp=128)
    engine, manifest = _engine(model, tokenizer)
    assert engine.backend_name == "LeanBackend"
    gap, samples = _parity(engine, manifest, model, SamplingContract(temperature=0.8, top_k=top_k, top_p=top_p,
                                                                     max_new_tokens=12))
    assert gap <= 1e-5
    assert all(len(s.response_ids) == 12 for s in samples)  # random init: no EOS, full length


def test_bf16_export_checksums_what_loads_and_bounds_the_parity_gap():
    model, tokenizer = build_mid(seed=0, vocab_size=8192, hidden=64, layers=2, heads=4, kv_heads=2, mlp=128)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    manifest32 = build_manifest(state, "run", 3, 0, tokenizer_hash(tokenizer), model_config_hash(model.config))
    same = in_dtype(state, manifest32, "fp32")
    assert same[0] is state and same[1] is manifest32
    cast, manifest16 = in_dtype(state, manifest32, "bf16")
    assert all(t.dtype == torch.bfloat16 for t in cast.values())
    assert manifest16.version.weights_hash != manifest32.version.weights_hash  # another version
    assert manifest16.version.step == 3
    verify_weights(cast, manifest16)
    with pytest.raises(WeightSyncError):
        verify_weights(state, manifest16)  # the fp32 tensors are not what the manifest describes
    engine = RolloutEngine(model, tokenizer)
    engine.load_weights(cast, manifest16)
    assert engine.backend == ("LeanBackend", "bfloat16")
    bf16_model = build_mid(seed=0, vocab_size=8192, hidden=64, layers=2, heads=4, kv_heads=2, mlp=128)[0]
    bf16_model = bf16_model.to(torch.bfloat16)
    gap, _ = _parity(engine, manifest16, bf16_model, SamplingContract(temperature=1.0, max_new_tokens=12))
    print(f"bf16 rollout vs bf16 teacher-forced max |log-prob gap| = {gap:.4f}")
    assert gap <= 0.25  # bf16 rounding, other kernels; the fp32 gap is <= 1e-5


def test_chunked_lm_head_equals_one_gemm():
    """A head over more than LM_HEAD_CHUNK tokens runs in row blocks: same logits as one GEMM
    with the final norm folded in (h @ (W * norm).T), within fp32 rounding."""
    from sealrl.rollout.lean import LM_HEAD_CHUNK, LeanCausalLM
    model, _ = build_mid(seed=0, vocab_size=3 * LM_HEAD_CHUNK + 5, hidden=64, layers=1, heads=4, kv_heads=2, mlp=128)
    w = model.state_dict()
    lm = LeanCausalLM(w, model.config, model.model.rotary_emb, torch.device("cpu"))
    assert [c.shape[0] for c in lm.lm_head_chunks] == [LM_HEAD_CHUNK] * 3 + [5]
    h = torch.randn(7, 64, generator=torch.Generator().manual_seed(0))
    want = h @ (w["model.embed_tokens.weight"] * w["model.norm.weight"][None, :]).t()
    assert torch.allclose(lm.logits(h), want, rtol=0, atol=1e-5)
