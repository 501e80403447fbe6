"""Reference role: teacher-forced log-probs of a frozen, versioned model (the KL anchor only).

With LoRA (`adapter_off`), the reference is the actor's own model with its adapter disabled,
in eval mode: the frozen base itself, no second copy in memory."""
from __future__ import annotations

import copy
from contextlib import nullcontext

from sealrl.experience import ExperienceBatch, PolicyVersion, Role
from sealrl.models.packing import TeacherForcing
from sealrl.models.precision import cast_model, resolve_device
from sealrl.roles.common import batch_log_probs


class Reference:
    """`tf`: how the passes run (default: micro-batches of `micro_batch_size`, padded);
    `dtype`: the frozen copy's weights (fp32 | bf16; log-probs are computed in fp32 from its logits);
    `device`: where the copy lives and runs (auto | cpu | cuda; log-probs come back on the CPU).
    With `adapter_off` the model is the actor's, on the actor's device."""

    def __init__(self, model, version: PolicyVersion, temperature: float, pad_id: int,
                 micro_batch_size: int = 64, tf: TeacherForcing | None = None, dtype: str = "fp32",
                 adapter_off: bool = False, device: str = "cpu"):
        self.adapter_off = adapter_off   # model: a peft model shared with the actor, used with its adapter off
        self.model = model if adapter_off else cast_model(copy.deepcopy(model).eval().requires_grad_(False), dtype
                                                          ).to(resolve_device(device, "reference.device"))
        self.version = version
        self.temperature, self.pad_id, self.micro = temperature, pad_id, micro_batch_size
        self.tf = tf

    def compute(self, batch: ExperienceBatch) -> None:
        batch.put("ref_log_probs", self.log_probs(batch), Role.REFERENCE, self.version.id)

    def log_probs(self, batch: ExperienceBatch):
        """The reference log-probs of `batch`'s response tokens (B, T), fp32 on the CPU."""
        training = self.model.training
        self.model.eval()   # no adapter dropout; the actor's mode is given back after
        try:
            with self.model.disable_adapter() if self.adapter_off else nullcontext():
                lp, _ = batch_log_probs(self.model, batch, self.temperature, self.pad_id, self.micro, tf=self.tf)
        finally:
            self.model.train(training)
        return lp
