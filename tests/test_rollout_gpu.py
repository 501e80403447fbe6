"""The engine on CUDA: same contract as on CPU (parity, reproducibility). Opt-in marker."""
from __future__ import annotations

import pytest
import torch

from sealrl.experience.records import SamplingContract
from sealrl.experience.wire import GenerationRequest
from sealrl.models.hf import model_config_hash, tokenizer_hash
from sealrl.models.logprobs import response_log_probs
from sealrl.models.tiny import build_tiny_model
from sealrl.rollout import RolloutEngine
from sealrl.sync.manifest import build_manifest

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("prefer_lean", [True, False])
def test_cuda_rollout_parity_and_retry(prefer_lean):
    model, tokenizer = build_tiny_model(seed=0)
    model = model.cuda()
    manifest = build_manifest(model.state_dict(), "run", 0, 0, tokenizer_hash(tokenizer),
                              model_config_hash(model.config))
    engine = RolloutEngine(model, tokenizer, device="cuda", prefer_lean=prefer_lean)
    engine.load_weights(model.state_dict(), manifest)
    requests = [GenerationRequest("g/0", (11, 12, 14, 8, 6, 18), 1, tuple(range(8))),
                GenerationRequest("g/1", (5, 6, 7), 2, (0, 1))]
    contract = SamplingContract(temperature=0.7, max_new_tokens=16)
    samples = engine.generate(requests, contract, manifest.version)
    with torch.no_grad():
        lp, _, _ = response_log_probs(model, [list(s.prompt_ids) for s in samples],
                                      [list(s.response_ids) for s in samples], 0.7)
    for b, s in enumerate(samples):
        got = torch.tensor(s.rollout_log_probs, device="cuda")
        assert (got - lp[b, :len(got)]).abs().max() <= 1e-4  # TF32-free fp32, other kernels
    retry = engine.generate([GenerationRequest("g/0", (11, 12, 14, 8, 6, 18), 1, (5,))],
                            contract, manifest.version)
    assert retry[0].response_ids == samples[5].response_ids
