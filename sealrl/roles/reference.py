"""Reference role: teacher-forced log-probs of a frozen, versioned model (the KL anchor only)."""
from __future__ import annotations

import copy

from sealrl.experience import ExperienceBatch, PolicyVersion, Role
from sealrl.roles.common import batch_log_probs


class Reference:
    def __init__(self, model, version: PolicyVersion, temperature: float, pad_id: int,
                 micro_batch_size: int = 64):
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        self.version = version
        self.temperature, self.pad_id, self.micro = temperature, pad_id, micro_batch_size

    def compute(self, batch: ExperienceBatch) -> None:
        lp, _ = batch_log_probs(self.model, batch, self.temperature, self.pad_id, self.micro)
        batch.put("ref_log_probs", lp, Role.REFERENCE, self.version.id)
