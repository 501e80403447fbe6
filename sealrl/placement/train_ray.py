"""Building a data-parallel role on Ray (placement/train_group.py holds the ranks and the
driver's facades): a local Ray or the cluster's, the rank group in its placement group joined in
one torch.distributed group, and, with fsdp2, ranks that build their shards from a weightless
template instead of each receiving the whole model."""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from sealrl.models.precision import model_device, process_group_backend
from sealrl.placement.train_group import TrainRank
from sealrl.placement.workers import WorkerGroup
from sealrl.roles.distributed import fsdp2_available


def start_ray(placement, closers: list) -> None:
    """A local Ray started here (shut down by `closers`), or the cluster at placement.address;
    nothing when Ray is already up (a test's, or another role's)."""
    import ray

    from sealrl.placement.workers import init_ray
    if not ray.is_initialized():
        init_ray(placement.address or None, (placement.num_cpus or None) if not placement.address else None)
        closers.append(ray.shutdown)


def sharded_from_rank0(make_worker: functools.partial, dp_strategy: str) -> tuple | None:
    """(model -> worker factory, weightless template of the model) when the ranks can build
    their shards without each receiving the whole model: fsdp2 in this torch, and no LoRA (an
    actor with LoRA hashes its frozen base when it is made, which needs the whole base). None
    otherwise. `make_worker` is functools.partial(Role, model, ...), as trainer/setup.py makes it."""
    from sealrl.models.lora import has_lora
    from sealrl.rollout.backends import weightless_template
    model = make_worker.args[0]
    if dp_strategy != "fsdp2" or not fsdp2_available() or has_lora(model):
        return None
    return (functools.partial(_made_with, make_worker.func, make_worker.args[1:], make_worker.keywords),
            weightless_template(model, trainable=True))


def _made_with(role: Callable, args: tuple, kwargs: dict, model: torch.nn.Module):
    """role(model, *args, **kwargs): the worker, made over the model a rank filled."""
    return role(model, *args, **kwargs)


def ray_train_group(role: str, rank_factory: Callable[[], TrainRank], num_workers: int, model,
                    timeout_s: float, closers: list, pool=None, bundle: dict | None = None) -> WorkerGroup:
    """`num_workers` Ray actors hosting `rank_factory()`, joined in one process group (gloo;
    nccl when `model` is on CUDA, one GPU per rank), each seeded by its rank: in their own
    placement group (`bundle`: PoolSpec's CPUs, custom resources and strategy; 1 CPU each by
    default), or rank k on bundle k of a shared `pool` (colocated with the rollout replicas;
    its creator closes it)."""
    from sealrl.placement.workers import PoolSpec, RayPool, RayWorkerGroup
    backend = process_group_backend(model_device(model))
    cuda = backend == "nccl"
    own = pool is None
    if own:
        pool = RayPool(PoolSpec(name=role, roles=(role,), num_workers=num_workers, **(bundle or {}),
                                num_gpus_per_worker=1.0 if cuda else 0.0), timeout_s=timeout_s)
    elif pool.spec.num_workers != num_workers:
        raise ValueError(f"{role}: {num_workers} ranks cannot share pool {pool.spec.name} of "
                         f"{pool.spec.num_workers} bundles")
    group = None
    try:  # a rank that fails to start or join: nothing of this group is left behind
        group = RayWorkerGroup(role, rank_factory, pool, timeout_s=timeout_s, threads=1)
        group.init_process_group(backend, timeout_s=timeout_s)
        ranks = group.call("setup", timeout_s=timeout_s)
        if ranks != list(range(num_workers)):
            raise RuntimeError(f"{role}: ranks {ranks} do not match worker indices")
    except BaseException:
        if group is not None:
            group.close()
        if own:
            pool.close()
        raise
    closers.extend([pool.close, group.close] if own else [group.close])  # reverse: actors, then pool
    return group
