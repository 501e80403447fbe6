"""Critic role (PPO): values V(s_t) of the response states, the value loss and its own
optimizer. Not a reward model: it predicts returns, it does not score responses."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from sealrl import algos
from sealrl.experience import ExperienceBatch, Role
from sealrl.models import precision
from sealrl.models.critic import CriticModel
from sealrl.models.packing import TeacherForcing
from sealrl.roles import common
from sealrl.roles.common import lr_at, optimizer_step, pad_width
from sealrl.roles.distributed import all_reduce_sums, idle_passes, own_rows

if TYPE_CHECKING:
    from sealrl.config import CriticConfig


class Critic:
    def __init__(self, model: CriticModel, cfg: CriticConfig, pad_id: int, micro_batch_size: int,
                 loss_agg: str, horizon: int, tf: TeacherForcing | None = None, epochs: int = 1,
                 mini_batch_size: int = 0, warmup_steps: int = 0, checkpointing: bool = False,
                 fused: bool = False, dtype: str = "fp32", device: str = "auto", adam_eps: float = 1e-8,
                 weight_decay: float = 0.0):
        """`micro_batch_size`, `epochs`, `mini_batch_size`: the critic's own (critic.* keys, the
        actor's where unset: trainer/setup.py); mini_batch_size 0 is the whole batch.
        `warmup_steps`, `checkpointing` (gradient checkpointing), `fused` (AdamW's fused kernel:
        the fast path), `dtype`, `device` and AdamW's `adam_eps` and `weight_decay` follow the
        actor's keys."""
        self.device = precision.resolve_device(device, "actor.device")
        self.dtype, self.adam_eps, self.weight_decay = dtype, adam_eps, weight_decay
        self.model, self.cfg, self.pad_id = model.to(self.device), cfg, pad_id   # in place: moved, not copied
        self.micro, self.loss_agg, self.horizon = micro_batch_size, loss_agg, horizon
        self.epochs, self.mini, self.warmup_steps, self.fused = epochs, mini_batch_size, warmup_steps, fused
        self.tf = tf or TeacherForcing(micro_batch_size=micro_batch_size)  # micro-batches, packing
        common.set_gradient_checkpointing(model.backbone, checkpointing)
        self.optimizer = self.make_optimizer()
        self.step = 0            # committed optimizer steps
        self.skipped_steps = 0   # optimizer steps skipped for a non-finite gradient

    def make_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over the model's trainable parameters (with LoRA: the adapter and the value head);
        made again after FSDP2 replaces them with DTensors."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        return common.adamw(params, self.fused, lr=self.cfg.lr, eps=self.adam_eps,
                            weight_decay=self.weight_decay)

    @property
    def version(self) -> str:
        return f"critic@{self.step}"

    def _values(self, samples):
        """(values (B, R), last values (B,), mask) on the CPU, beside the batch's tensors."""
        with precision.compute(self.dtype, precision.model_device(self.model)):
            v, last, mask = self.tf.values(self.model, [list(s.prompt_ids) for s in samples],
                                           [list(s.response_ids) for s in samples], self.pad_id)
        return v.cpu(), last.cpu(), mask.cpu()

    def _micro_batches(self, rows: list[int], samples) -> list[list[int]]:
        return common.micro_batches(self.tf, rows, samples)

    def compute(self, batch: ExperienceBatch) -> None:
        """Values of every response state, and of the state after the last token."""
        width, vals, lasts, order = batch.num_response_tokens, [], [], []
        self.model.eval()
        with torch.no_grad():
            for part in self._micro_batches(list(range(len(batch))), batch.samples):
                v, last, _ = self._values([batch.samples[i] for i in part])
                vals.append(pad_width(v.float(), width))
                lasts.append(last.float())
                order.extend(part)
        back = torch.empty(len(order), dtype=torch.long)  # micro-batch order -> batch order
        back[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
        values = torch.cat(vals).cpu()[back].masked_fill(~batch.token_mask(), 0.0)
        batch.put("values", values, Role.CRITIC, self.version)
        batch.put("last_values", torch.cat(lasts).cpu()[back], Role.CRITIC, self.version)

    def snapshot(self, copy: bool = True) -> dict:
        return common.snapshot(self, copy)

    def restore(self, snap: dict) -> None:
        common.restore(self, snap)

    def set_counters(self, **counters: int) -> None:
        """Restoring a checkpoint (position.py): step and the other counters."""
        vars(self).update(counters)

    def update(self, batch: ExperienceBatch, seed: int = 0) -> dict[str, float]:
        """Value-loss optimizer steps: `epochs` passes over the batch in minibatches of
        `mini_batch_size` samples (shuffled by `seed` unless one step covers the batch), each
        normalised over its own minibatch, as the actor's are."""
        b, mini = len(batch), self.mini or len(batch)
        gen = torch.Generator().manual_seed(seed + 1)   # not the actor's order
        steps: list[dict[str, float]] = []
        self.model.train()
        try:
            for _ in range(self.epochs):
                order = torch.randperm(b, generator=gen) if (self.epochs > 1 or mini < b) else torch.arange(b)
                for start in range(0, b, mini):
                    steps.append(self._optimizer_step(batch, order[start:start + mini]))
        finally:
            self.model.eval()
        out = {f"critic/{k}": sum(s[k] for s in steps) / len(steps) for k in ("value_loss", "grad_norm", "clip_frac")}
        out["critic/skipped_steps"] = float(self.skipped_steps)
        return out

    def _optimizer_step(self, batch: ExperienceBatch, idx: torch.Tensor) -> dict[str, float]:
        """One value-loss step over minibatch `idx` (global normaliser over its tokens)."""
        mask, returns = batch.get("response_mask"), batch.get("returns")
        old_values = batch.get("values")
        norm = algos.make_normaliser(mask[idx], self.loss_agg, horizon=self.horizon)
        self.optimizer.zero_grad(set_to_none=True)
        total, clip_frac = 0.0, 0.0
        rows = own_rows(batch, idx)  # this data-parallel rank's rows (all on one process)
        for part in self._micro_batches(rows.tolist(), batch.samples):
            sl = torch.tensor(part, dtype=torch.long)
            v, _, _ = self._values([batch.samples[i] for i in sl.tolist()])
            v = pad_width(v, batch.num_response_tokens)
            loss, metrics = algos.value_loss(v, old_values[sl], returns[sl], mask[sl], norm,
                                             clip_eps=self.cfg.value_clip or None)
            loss.backward()
            total += float(loss.detach())
            share = float(mask[sl].sum()) / max(1.0, float(mask[idx].sum()))
            clip_frac += float(metrics.get("value_clip_frac", 0.0)) * share
        # FSDP2: as many passes as the rank with the most rows (collectives); these add nothing
        for _ in range(idle_passes(self.model, [batch.sample_ids[i] for i in idx.tolist()],
                                   common.pass_counter(self.tf, batch.samples))):
            (self._values(batch.samples[:1])[0].sum() * 0.0).backward()
        # Data-parallel (no-ops on one process): losses are shares of one loss, so SUM.
        sums = all_reduce_sums({"value_loss": total, "clip_frac": clip_frac})
        lr = lr_at(self.step, self.cfg.lr, self.warmup_steps, "constant", 0, 0.0)
        grad_norm = optimizer_step(self.model, self.optimizer, self.cfg.grad_clip, lr)
        if math.isfinite(grad_norm):
            self.step += 1
        else:
            self.skipped_steps += 1
        return {"value_loss": sums["value_loss"], "grad_norm": grad_norm, "clip_frac": sums["clip_frac"]}
