"""Data-parallel collectives the training roles call (no-ops on one process): torch.distributed,
gloo on CPU, nccl on CUDA. The ranks themselves are placement/train_group.py.

One optimizer step on N ranks must equal the same step on one process (DESIGN section 9.4):

1. Shard by sample id: every rank holds the WHOLE batch and, in each optimizer step, keeps its
   rows of the minibatch by sample id (`own_rows`: a contiguous range of the SORTED ids,
   experience.split_ids). Positions in the driver's tensors and completion order play no part,
   so every rank computes the same split without talking.
2. Global normaliser: computed from the whole minibatch's mask on every rank, so each rank's
   loss is its *share* of the global loss (algos.losses.aggregate) and the shares add up to the
   one-process loss. A per-rank normaliser would weight a short shard's tokens more: wrong.
3. Gradients: because the shares already add up, the global gradient is the SUM of the ranks'
   gradients. We all-reduce with SUM by hand (`all_reduce_grads`, one flat buffer) rather than
   wrap the model in DDP: DDP AVERAGES (it would need every share scaled by N), and with
   several micro-batch backward passes per step it needs `no_sync()` on all but the last one;
   a single explicit collective after the last backward is simpler and does the same
   communication. Ranks with an empty shard still join the collective (zero gradients).
4. Same optimizer step everywhere: after the all-reduce every rank holds the same gradient, so
   the same clip and step keep the weights identical (the actor facade checks the ranks'
   weights hashes at every export).
5. Seeds: `rank_seed(run_seed, rank)` derives each rank's stream (dropout etc.) from the run
   seed; the minibatch order is NOT per-rank: it is drawn on the whole batch from the shared
   seed, then each minibatch is sharded by id.

FSDP2 (`fsdp2_shard`, torch.distributed.fsdp.fully_shard; `placement.dp_strategy=fsdp2`):
parameters become DTensors sharded over ranks and FSDP reduce-scatters gradients in backward
itself, AVERAGING them; `sum_grads` then multiplies the sharded gradients by the world size to
get the SUM (exact: a power-of-two world divides and multiplies exactly; otherwise within
rounding). `set_gradient_divide_factor(1.0)` would avoid that but needs ReduceOp.PREMUL_SUM,
which gloo lacks (torch 2.13). Every forward all-gathers and every backward reduce-scatters, so
every rank must run the SAME number of micro-batch passes: a rank with fewer rows adds idle
passes (`idle_passes`: one row, loss x 0, zero gradient). Full tensors for export, checkpoints
and resume are gathered / cut with `full_state`, `full_optimizer_state`, `load_full_state`,
`load_full_optimizer_state` (collectives when sharded: every rank calls them, in one order);
rollback snapshots stay sharded. Works on CPU with gloo; the same code runs with nccl on GPUs.

Time in collectives: the calls here that talk to the other ranks (`all_reduce_sums`,
`all_gather_cat`, `all_reduce_grads`, the gathered gradient norm) add their wall seconds to a
per-process counter that `take_collective_seconds` reads and resets (docs/metrics.md,
`perf/<role>_collectives_s`). FSDP2's own all-gathers and reduce-scatters run inside forward and
backward, overlapped with compute, and are not in it.
"""
from __future__ import annotations

import functools
import hashlib
import time

import torch
import torch.distributed as dist

from sealrl.experience import ExperienceBatch, split_ids
from sealrl.rollout.backends import allocate
from sealrl.sync.adapter import copy_once

_collective_s = [0.0]   # wall seconds in the collectives below since the last take (this process)


def _timed(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _collective_s[0] += time.perf_counter() - t
    return wrapper


def take_collective_seconds() -> float:
    """Seconds this process spent in the explicit collectives since the last take (then 0)."""
    seconds, _collective_s[0] = _collective_s[0], 0.0
    return seconds


def rank_seed(run_seed: int, rank: int) -> int:
    """A 63-bit seed for `rank`, derived from the run seed (never random, never rank-shared)."""
    h = hashlib.sha256(f"sealrl/rank-seed/{run_seed}/{rank}".encode()).digest()
    return int.from_bytes(h[:8], "little") >> 1


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard_batch(batch: ExperienceBatch, rank: int, world_size: int) -> ExperienceBatch:
    """This rank's shard: a contiguous range of the sorted sample ids (provenance kept)."""
    return batch.select_ids(split_ids(batch.sample_ids, world_size)[rank])


def own_rows(batch: ExperienceBatch, idx: torch.Tensor) -> torch.Tensor:
    """The rows of `idx` (a minibatch of `batch`, every rank holding the whole batch) that
    this rank processes: a contiguous range of the minibatch's sorted sample ids. Order kept."""
    rank, size = world()
    if size == 1:
        return idx
    ids = [batch.samples[i].sample_id for i in idx.tolist()]
    mine = set(split_ids(ids, size)[rank])
    return idx[torch.tensor([sid in mine for sid in ids], dtype=torch.bool)]


@_timed
def all_reduce_sums(values: dict[str, float]) -> dict[str, float]:
    """SUM of per-rank scalars (loss shares, token-weighted metrics). A rank may lack keys (a
    rank without rows in a minibatch has no metrics): the union is reduced, missing = 0."""
    if world()[1] == 1:
        return dict(values)
    gathered: list[list[str] | None] = [None] * world()[1]
    dist.all_gather_object(gathered, sorted(values))  # every rank waits for every key list
    keys = sorted(set().union(*gathered))
    if not keys:
        return {}
    t = torch.tensor([float(values.get(k, 0.0)) for k in keys], dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return dict(zip(keys, t.tolist()))


@_timed
def all_gather_cat(values: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-D tensor, concatenated in rank order (CPU). For statistics that do not add
    up over ranks (min, max, quantiles of per-token values): over the gathered values they are
    those of one process. Every rank must call it (it waits for all of them)."""
    if world()[1] == 1:
        return values
    gathered: list[torch.Tensor | None] = [None] * world()[1]
    dist.all_gather_object(gathered, values.detach().cpu())
    return torch.cat(gathered)


@_timed
def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """SUM every trainable parameter's gradient over ranks, in one flat buffer.
    A parameter without a gradient on this rank (empty shard) takes part as zeros; one that
    has no gradient on ANY rank (an unused branch) stays None, as on one process, so the
    optimizer skips it there too (AdamW would otherwise decay it and move its moments)."""
    if world()[1] == 1:
        return
    params = [p for p in params if p.requires_grad]
    has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=_device())
    dist.all_reduce(has, op=dist.ReduceOp.SUM)
    params = [p for p, h in zip(params, has.tolist()) if h]
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)  # blocks until every rank has contributed
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n


def fsdp2_available() -> bool:
    """Whether this torch has FSDP2 (fully_shard) and DTensor; else the roles all-reduce."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        from torch.distributed.tensor import DTensor  # noqa: F401
    except ImportError:
        return False
    return dist.is_available()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a (wrapped) HF model: the first ModuleList named layers/h/blocks."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks"):
            return list(module)
    raise ValueError(f"{type(model).__name__}: no decoder layers (a ModuleList named layers, h or blocks)")


def fsdp2_shard(model: torch.nn.Module, blocks: list[torch.nn.Module],
                forward_methods: tuple[str, ...] = ()) -> torch.nn.Module:
    """FSDP2 over all ranks: each block (e.g. `model.model.layers`) is one unit, then the root.
    `forward_methods`: methods other than forward called on the root (e.g. a critic's
    `values`), which must gather the root's parameters as forward does."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
    mesh = init_device_mesh(_device().type, (world()[1],))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for name in forward_methods:
        register_fsdp_forward_method(model, name)
    return model


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor: nothing is sharded
        return False
    return isinstance(t, DTensor)


def is_sharded(model: torch.nn.Module) -> bool:
    return any(_is_dtensor(p) for p in model.parameters())


def idle_passes(model: torch.nn.Module, sample_ids: list[str], passes) -> int:
    """Micro-batch passes this rank adds so that it runs as many as the rank with the most
    passes over its rows of `sample_ids` (split as own_rows / shard_batch split them): FSDP2
    gathers parameters in every forward and reduce-scatters in every backward, collectives every
    rank must join. `passes`: the micro-batch size (passes by count), or a function giving the
    passes over a rank's sample ids (a token budget: roles/common.pass_counter). 0 when the
    model is not sharded."""
    rank, size = world()
    if size == 1 or not is_sharded(model):
        return 0
    count = passes if callable(passes) else (lambda ids: -(-len(ids) // passes))
    per_rank = [count(part) for part in split_ids(sample_ids, size)]
    return max(per_rank) - per_rank[rank]


def sum_grads(params: list[torch.nn.Parameter]) -> None:
    """The SUM of the ranks' gradients on every rank: FSDP2 (DTensor parameters) has already
    reduce-scattered them with AVG in backward, so multiply by the world size; otherwise one
    all-reduce (`all_reduce_grads`). No-op on one process."""
    params = [p for p in params if p.requires_grad]
    if any(_is_dtensor(p) for p in params):
        for p in params:
            if p.grad is not None:
                p.grad.mul_(world()[1])
    else:
        all_reduce_grads(params)


def clip_grad_norm(params, max_norm: float) -> float:
    """clip_grad_norm_ (max_norm <= 0: no clipping) on plain or DTensor gradients; the norm of
    the whole (global) gradient, the same float on every rank."""
    total = torch.nn.utils.clip_grad_norm_(list(params), max_norm if max_norm > 0 else float("inf"))
    return float(_timed(_full)(total))


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded DTensor (a collective: every rank must call it)."""
    return t.full_tensor() if _is_dtensor(t) else t


def full_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A model state dict with every DTensor gathered whole, detached, on the CPU (a collective
    when sharded: every rank calls it, in the same key order)."""
    return copy_once(state, lambda t: _full(t).detach().cpu())   # a tied pair: gathered once


def fill_from_rank0(model: torch.nn.Module, full_state_ref) -> None:
    """A model built on the meta device (its non-persistent buffers real, e.g. RoPE frequencies:
    rollout/backends.weightless_template), sharded, then filled: rank 0 reads the full state from
    Ray's object store (`full_state_ref`; None on the others) and broadcasts it (_model_from_rank0).
    Every rank calls it."""
    allocate(model, _device())
    full = None
    if full_state_ref is not None:
        import ray
        full = ray.get(full_state_ref)
    _model_from_rank0(model, full)


def _model_from_rank0(model: torch.nn.Module, full: dict | None) -> None:
    """Rank 0's full model state (None on the others) into every rank's model, plain or sharded:
    torch broadcasts it and each rank keeps its own cut (set_model_state_dict, broadcast_from_rank0)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    set_model_state_dict(model, full or {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """optimizer.state_dict() with DTensor state (moments of sharded parameters) gathered whole
    (a collective when sharded: keys are visited in sorted order on every rank)."""
    sd = optimizer.state_dict()
    state = {i: {k: _full(v).detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in sorted(s.items())}
             for i, s in sorted(sd["state"].items())}
    return {"state": state, "param_groups": sd["param_groups"]}


def _shard_like(full: torch.Tensor, ref):
    """`full` cut like the DTensor `ref` (this rank's chunk, cut locally: every rank holds the
    same full tensor, so nothing is sent); `full` itself when `ref` is not a DTensor."""
    if not _is_dtensor(ref) or _is_dtensor(full):
        return full
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(full.detach().to(ref.device), ref.device_mesh, ref.placements, src_data_rank=None)


def load_full_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load full tensors (a checkpoint, the driver's mirror) into a plain or sharded model."""
    own = model.state_dict()
    model.load_state_dict({name: _shard_like(t, own.get(name)) for name, t in state.items()}, strict=True)


def load_from_rank0(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict | None,
                    optim_state: dict | None) -> None:
    """load_full_state and load_full_optimizer_state when only rank 0 holds the full state (the
    others pass None): the model as _model_from_rank0 fills it; the optimizer's layout broadcast
    from rank 0, then each of its tensors, one at a time, every rank keeping its own cut (a copy,
    so the full tensor is freed before the next). No rank but 0 ever holds the whole state.
    Every rank calls it."""
    _model_from_rank0(model, model_state)
    layout: list = [None]
    if dist.get_rank() == 0:
        layout = [{"param_groups": optim_state["param_groups"],
                   "state": {i: _layout(s) for i, s in optim_state["state"].items()}}]
    dist.broadcast_object_list(layout, src=0)
    optim_layout = layout[0]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict = {}
    for i, entry in optim_layout["state"].items():
        state[i] = {}
        for k, spec in entry.items():
            if spec[0] == "value":
                state[i][k] = spec[1]
                continue
            full = _broadcast(optim_state and optim_state["state"][i][k], spec)
            state[i][k] = _own_copy(_shard_like(full, params[int(i)])) if full.dim() else full
    optimizer.load_state_dict({"param_groups": optim_layout["param_groups"], "state": state})


def _layout(state: dict) -> dict:
    return {k: ("tensor", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("value", v)
            for k, v in state.items()}


def _broadcast(t: torch.Tensor | None, spec: tuple) -> torch.Tensor:
    """Rank 0's tensor `t` on every rank (the others pass None and get a buffer of `spec`)."""
    _, shape, dtype = spec
    buf = t.detach().contiguous().to(_device()) if t is not None else torch.empty(shape, dtype=dtype, device=_device())
    dist.broadcast(buf, src=0)
    return buf


def _own_copy(t: torch.Tensor) -> torch.Tensor:
    """A DTensor whose local shard owns its storage (a cut of a full tensor is a view of it)."""
    if not _is_dtensor(t):
        return t.clone()
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(t.to_local().clone(), t.device_mesh, t.placements, run_check=False,
                              shape=t.shape, stride=t.stride())


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict) -> None:
    """Load a full optimizer state dict (full_optimizer_state's form); the moments of a sharded
    parameter are cut like it. State key i is the i-th parameter over the param groups."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {i: {k: _shard_like(v, params[int(i)]) if isinstance(v, torch.Tensor) and v.dim() else v
                 for k, v in s.items()} for i, s in sd["state"].items()}
    optimizer.load_state_dict({**sd, "state": state})


class ReplicaMismatchError(RuntimeError):
    """Data-parallel replicas hold different weights after a step."""


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


