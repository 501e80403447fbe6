"""Rollout role: samples responses from one committed snapshot and records behaviour
log-probs and stop reasons. It owns inference weights and never holds an optimizer."""
from __future__ import annotations

import torch

from sealrl.experience import PolicyVersion, SamplingContract
from sealrl.rollout.engine import GenerationRequest, RolloutEngine, RolloutSample
from sealrl.sync.manifest import WeightManifest


class RolloutWorker:
    def __init__(self, model, tokenizer, device: str = "cpu"):
        self.engine = RolloutEngine(model, tokenizer, device=device)

    @property
    def version(self) -> PolicyVersion | None:
        return self.engine.active_version

    def load(self, state: dict[str, torch.Tensor], manifest: WeightManifest) -> PolicyVersion:
        """ROLLOUT_LOADING(v) -> ROLLOUT_READY(v): stage, verify every checksum, switch."""
        self.engine.load_weights(state, manifest)
        return manifest.version

    def generate(self, requests: list[GenerationRequest], contract: SamplingContract,
                 version: PolicyVersion) -> list[RolloutSample]:
        """GENERATING(v): refuses any version other than the active one."""
        return self.engine.generate(requests, contract, version)
