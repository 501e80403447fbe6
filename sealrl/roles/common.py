"""Plumbing the roles share: teacher-forced log-probs of a batch in micro-batches, the
learning-rate schedule, and the one optimizer step of the actor and the critic."""
from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from sealrl.experience import ExperienceBatch
from sealrl.models.lean_forward import unsupported_reason
from sealrl.models.lora import load_trainable_state, trainable_state
from sealrl.models.packing import TeacherForcing
from sealrl.roles.distributed import clip_grad_norm, sum_grads

FAST_CHUNK = 1024   # LM-head tokens per chunk on the fast path (faster than the whole head at every
                    # vocabulary measured, 256 to 49,152: docs/benchmarks.md, "Fast by default")
EXACT_MICRO = 64    # samples per micro-batch on the exact path when actor.micro_batch_size is unset


def teacher_forcing(actor_cfg, model=None, exact: bool = True, group: int = 1) -> TeacherForcing:
    """How a run's teacher-forced passes run (actor section; the reference's and critic's follow).

    `exact` (run.exact) or no model: the Hugging Face reference path, padded, bitwise what HF
    computes. Otherwise the fast path, chosen once for the model: the lean forward with each
    group's prompt run once where it covers the model (Llama/Qwen2, models/lean_forward.py),
    the LM head FAST_CHUNK tokens at a time with its logits kept for the backward, and
    micro-batches of whole groups (`group` = rollout.n) when a micro-batch holds more than one:
    with actor.micro_batch_size unset (0), the fewest whole groups of at most AUTO_MICRO_TOKENS
    tokens (models/packing.py; the exact path: EXACT_MICRO samples).
    actor.logit_chunk_tokens > 0 on either path: that chunk, logits recomputed (less memory)."""
    chunk, micro = actor_cfg.logit_chunk_tokens, actor_cfg.micro_batch_size
    if exact or model is None:
        return TeacherForcing(micro_batch_size=micro or EXACT_MICRO, max_tokens=actor_cfg.max_tokens_per_micro_batch,
                              chunk=chunk)
    lean = unsupported_reason(model) is None
    if micro > group > 1 and micro % group:
        micro -= micro % group
    return TeacherForcing(micro_batch_size=micro, max_tokens=actor_cfg.max_tokens_per_micro_batch, pack=lean,
                          chunk=chunk or FAST_CHUNK, keep_logits=not chunk, lean=lean, share_prompts=lean,
                          group=max(1, group))


def adamw(params, fused: bool, **hyper) -> torch.optim.AdamW:
    """AdamW with torch's default implementation for the parameters' device (on the CPU the
    per-parameter loop, on CUDA the multi-tensor one: bit for bit the same arithmetic), or with
    `fused` (the fast path: not run.exact) its fused kernel (one pass over each tensor, 4-6x
    faster on the CPU; same update up to float rounding, not bitwise)."""
    return torch.optim.AdamW(params, fused=True, **hyper) if fused else torch.optim.AdamW(params, **hyper)


def set_gradient_checkpointing(model, on: bool) -> None:
    """Activation checkpointing of a Hugging Face model (non-reentrant: exact same numbers)."""
    if on:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})


def sample_lengths(samples) -> list[int]:
    """Tokens (prompt + response) of each sample: what a token budget counts."""
    return [len(s.prompt_ids) + len(s.response_ids) for s in samples]


def micro_batches(tf: TeacherForcing, rows: list[int], samples) -> list[list[int]]:
    """`rows` (indices into `samples`) split into micro-batches: by count (consecutive), or by
    the token budget. Sharded data-parallel ranks must all run the same number of passes: each
    adds idle ones (distributed.idle_passes, counted by `pass_counter`)."""
    return [[rows[i] for i in part] for part in tf.micro_batches(sample_lengths([samples[r] for r in rows]))]


def pass_counter(tf: TeacherForcing, samples) -> Callable[[list[str]], int]:
    """The micro-batch passes `tf` runs over the samples of some sample ids (any order: a token
    budget's partition depends only on the lengths), for distributed.idle_passes."""
    length = {s.sample_id: n for s, n in zip(samples, sample_lengths(samples))}
    return lambda ids: len(tf.micro_batches([length[i] for i in ids]))


def clone_state(x):
    """A copy of a (nested) state dict that shares no tensor with the original: tensors are
    cloned, containers rebuilt, other leaves (numbers, strings, None) are immutable and kept.
    What copy.deepcopy gives for model and optimizer state, at a third of its cost."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return type(x)((k, clone_state(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return type(x)(clone_state(v) for v in x)
    return x


class Snapshot:
    """A training role's committed state (weights, optimizer, counters), to restore if an
    update fails; with LoRA only the trainable tensors (the base never changes).

    Weights and optimizer state change only in an optimizer step, so their copy is taken
    lazily, by `optimizer_step`, just before the first step after the snapshot: once the
    update's forward and backward are done, so the copy is never alive beside their
    activations, and an update that fails before stepping copies nothing. Until then the
    committed tensors are the live ones; `restore` checks that (`_marks`) and refuses to
    restore a state that changed in place or was replaced without a step.

    `copy=False` (an update of one optimizer step, the last of the iteration): no copy is ever
    taken. That step is the update's commit point: a failure before it restores as above, and a
    failure once it has changed the state raises NoRollback instead of restoring. It saves a copy
    of the weights and optimizer state per iteration (three times the weights with AdamW)."""

    def __init__(self, role, copy: bool = True) -> None:
        self.step, self.skipped = role.step, role.skipped_steps
        self.model: dict | None = None   # the copies, once an optimizer step is about to run
        self.optim: dict | None = None
        self.copy = copy
        self.marks = _marks(role.model, role.optimizer)
        if copy:
            _PENDING[role.optimizer] = weakref.ref(self)   # the newest snapshot of an optimizer is filled
        else:
            _PENDING.pop(role.optimizer, None)   # an older snapshot is stale from here on: never filled

    def fill(self, model, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optim = clone_state(trainable_state(model)), clone_state(optimizer.state_dict())


# optimizer -> its newest unfilled Snapshot (weak both ways: a dropped snapshot is never copied)
_PENDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _marks(model, optimizer: torch.optim.Optimizer) -> tuple:
    """Storage, shape and in-place version counter of every tensor a snapshot covers, and the
    optimizer's hyperparameters: unchanged marks mean unchanged contents."""
    tensors = [*trainable_state(model).items(),
               *((f"{i}.{k}", t) for i, s in enumerate(optimizer.state.values()) for k, t in s.items())]
    tensors = [(n, getattr(t, "_local_tensor", t)) for n, t in tensors if isinstance(t, torch.Tensor)]
    return ([(n, t.data_ptr(), tuple(t.shape), t._version) for n, t in tensors],
            [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups])


class NoRollback(RuntimeError):
    """A snapshot taken without a copy (`Snapshot(copy=False)`) cannot restore: the update's
    optimizer step had changed the weights or optimizer state when it failed."""


def snapshot(role, copy: bool = True) -> Snapshot:
    return Snapshot(role, copy)


def restore(role, snap: Snapshot) -> None:
    if snap.model is not None:
        load_trainable_state(role.model, snap.model)
        role.optimizer.load_state_dict(snap.optim)
    elif _marks(role.model, role.optimizer) != snap.marks:
        if not snap.copy:
            raise NoRollback("its optimizer step had changed the weights or optimizer state, and an update of "
                             "one step keeps no copy of the state before it")
        raise RuntimeError("rollback: weights or optimizer state changed without an optimizer step since the "
                           "snapshot (nothing was copied); cannot restore the committed state")
    role.step, role.skipped_steps = snap.step, snap.skipped
    role.optimizer.zero_grad(set_to_none=True)


def pad_width(x: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad (B, r) to (B, width) with zeros (padding never contributes)."""
    return F.pad(x, (0, width - x.shape[1])) if x.shape[1] < width else x


def batch_log_probs(model, batch: ExperienceBatch, temperature: float, pad_id: int,
                    micro_batch_size: int, with_entropy: bool = False, tf: TeacherForcing | None = None):
    """(B, R) log-probs (and entropy) of the batch's response tokens under `model`, no grad.
    Positions past each response are exactly 0. `tf` (default: micro-batches of
    `micro_batch_size` samples, padded, full logits) says how the passes run."""
    tf = tf or TeacherForcing(micro_batch_size=micro_batch_size)
    width, out_lp, out_ent, order = batch.num_response_tokens, [], [], []
    with torch.no_grad():
        for rows in tf.micro_batches(sample_lengths(batch.samples)):
            part = [batch.samples[i] for i in rows]
            lp, ent, _ = tf.log_probs(model, [list(s.prompt_ids) for s in part], [list(s.response_ids) for s in part],
                                      temperature, pad_id, with_entropy)
            out_lp.append(pad_width(lp.float(), width))
            if with_entropy:
                out_ent.append(pad_width(ent.float(), width))
            order.extend(rows)
    return _in_batch_order(out_lp, order, batch), _in_batch_order(out_ent, order, batch) if with_entropy else None


def _in_batch_order(parts: list[torch.Tensor], order: list[int], batch: ExperienceBatch) -> torch.Tensor:
    """Micro-batch outputs (rows in `order`) as one (B, R) CPU tensor in batch order, 0 past each response."""
    if not parts:
        return torch.zeros(0, batch.num_response_tokens)
    back = torch.empty(len(order), dtype=torch.long)  # micro-batch order -> batch order
    back[torch.tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return torch.cat(parts).cpu()[back].masked_fill(~batch.token_mask(), 0.0)


def batch_sum_pi_squared(model, batch: ExperienceBatch, temperature: float, pad_id: int,
                         tf: TeacherForcing) -> torch.Tensor:
    """(B, R) sum_v pi(v)^2 of softmax(logits / T) at each response token of the batch under
    `model`, no grad (the optimal token baseline's gradient-norm proxy). 0 past each response."""
    width, out, order = batch.num_response_tokens, [], []
    with torch.no_grad():
        for rows in tf.micro_batches(sample_lengths(batch.samples)):
            part = [batch.samples[i] for i in rows]
            sq = tf.sum_pi_squared(model, [list(s.prompt_ids) for s in part], [list(s.response_ids) for s in part],
                                   temperature, pad_id)
            out.append(pad_width(sq.float(), width))
            order.extend(rows)
    return _in_batch_order(out, order, batch)


def lr_at(step: int, base: float, warmup: int, schedule: str, total: int, min_ratio: float) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warm-up, then constant, cosine
    or linear decay to `min_ratio * base` at step `total`. A pure function of the step, so a
    resumed run needs no scheduler state."""
    if warmup and step < warmup:
        return base * (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return base
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * frac)) if schedule == "cosine" else 1 - frac
    return base * (min_ratio + (1 - min_ratio) * shape)


def optimizer_step(model, optimizer: torch.optim.Optimizer, grad_clip: float, lr: float,
                   before_step: Callable[[], object] = lambda: None) -> float:
    """After the backward passes of one step: gradients SUMMED over data-parallel ranks (a no-op
    on one process; the ranks' losses are shares of one loss), clipped on the global norm, then
    one step at `lr` on every rank alike. A non-finite norm drops the gradients and takes no
    step. Returns the global gradient norm (the caller counts a non-finite one as skipped).
    The role's pending rollback Snapshot copies the committed state just before the step.
    `before_step` runs after the collectives, just before the step (a fault-injection point)."""
    sum_grads(list(model.parameters()))
    grad_norm = clip_grad_norm(model.parameters(), grad_clip)
    before_step()
    if not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return grad_norm
    pending = _PENDING.pop(optimizer, None)
    if pending is not None and (snap := pending()) is not None:
        snap.fill(model, optimizer)   # the committed state, before this step changes it (Snapshot)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)   # free the gradients now: the next step starts from none
    return grad_norm


# ---- an optimizer's state as named tensors + JSON (a checkpoint's form: trainer/resume) ----------

def optimizer_to_flat(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Adam-style state: every tensor under `state.<param index>.<name>`, the rest as JSON."""
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, entry in sd["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{idx}.{name}"] = value
            else:
                scalars[f"{idx}.{name}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_flat(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = value
    for key, value in meta["scalars"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    groups = [dict(g, betas=tuple(g["betas"])) if "betas" in g else g for g in meta["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def structure(role):
    """A role's model for its config and shapes only: a data-parallel group's mirror as it stands
    (on the meta device; its `model` would pull the ranks' full weights into the driver)."""
    return role.structure if hasattr(role, "structure") else role.model
