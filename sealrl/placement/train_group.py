"""Data-parallel actor and critic: N Ray actors joined in one torch.distributed group, behind
the interface of one Actor / Critic, so the driver loop does not change
(`placement.actor_ranks` / `placement.critic_ranks` > 1, `placement.backend=ray`).

Each rank hosts an ordinary Actor (Critic). Every rank receives the WHOLE batch
(one object-store copy) and runs the same update loop: the same minibatch order from the
shared seed, the same normaliser counted on the whole minibatch (global by construction), then
in every optimizer step it keeps only its rows, a contiguous range of the minibatch's sorted
sample ids (`roles.distributed.own_rows`). Its loss is its share of the global loss; gradients and
metric shares are SUMMED over ranks (`sum_grads`, `all_reduce_sums`), so clip and AdamW see the
one-process gradient on every rank. Per-rank torch seeds are derived (`rank_seed`), never random.

`placement.dp_strategy`: `fsdp2` (default) shards each rank's decoder layers and root with
FSDP2 (`fully_shard`) right after the group is joined, then makes the optimizer again over the
sharded (DTensor) parameters; FSDP reduce-scatters the gradients in backward and every rank
steps on its shard of the weights and moments. `allreduce` keeps a full replica per rank and
sums the gradients in one flat all-reduce. Without FSDP2 in this torch, `fsdp2` falls back to
`allreduce` (logged).

Forward-only work is split, not repeated: old log-probs (recompute mode) and critic values are
computed on each rank's shard of sorted ids and joined by sample id on the driver.

The driver keeps a local copy of the role (`local`), built from the same arguments, as the
ranks' mirror; without LoRA it holds no weights: its model is the role's structure on the meta
device, with no optimizer (Replicas). Checkpoints and the run's final Hugging Face folder stream
the ranks' weights and optimizer state a bucket at a time (`streamed`, `save_pretrained`), so
neither is ever whole in the driver. Reading `model` or `optimizer` (a resume, the
optimal-token baseline) fills the mirror from the ranks until the next update or rollback. A
restore pushes the mirror to the ranks: position.restore_position loads `model` and `optimizer`,
then calls `set_counters`, which is the push (rank 0 reads it from the object store and
broadcasts it a tensor at a time: roles/distributed.load_from_rank0).

`publish()` has rank 0 build the manifest and put what the rollout loads into Ray's object store
itself (sync/remote.py): the driver gets the reference, the manifest and every other rank's
weights hash, which must equal rank 0's (ReplicaMismatchError names the rank); the weights go rank
0 -> object store -> replicas, not through the driver (with LoRA what ships is the adapter:
Actor.exported_tensors). Pull, publish and push go to EVERY rank: with fsdp2, gathering full
tensors (and cutting them back into shards) is a collective; only rank 0 ships what it gathered.
FSDP2 also gathers in every forward, so the forward-only calls (old log-probs, values) run as many
micro-batches on every rank (`roles.distributed.idle_passes`). Rollback snapshots stay inside each
rank (sharded).

Process group: `precision.process_group_backend` of the role's device: nccl when the role's
model is on CUDA (`actor.device` / `critic.device`), gloo on CPU.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch

from sealrl.config import StoppedRun
from sealrl.experience import ExperienceBatch, PolicyVersion, Role
from sealrl.models.hf import save_causal_lm_shards
from sealrl.models.lora import has_lora
from sealrl.placement.workers import HOSTS, WorkerError, WorkerGroup
from sealrl.roles.common import batch_log_probs, optimizer_to_flat, pass_counter
from sealrl.roles.distributed import (
    decoder_layers,
    fill_from_rank0,
    fsdp2_available,
    fsdp2_shard,
    full_optimizer_state,
    full_state,
    idle_passes,
    is_sharded,
    load_from_rank0,
    load_full_optimizer_state,
    load_full_state,
    rank_seed,
    shard_batch,
    take_collective_seconds,
    world,
)
from sealrl.rollout.backends import allocate, weightless_template
from sealrl.sync.adapter import copy_once, rollout_copy, sync_bytes
from sealrl.sync.manifest import WeightManifest, entries_digest, tensor_entry
from sealrl.sync.remote import RemoteState, received, stored, unlisted

COLLECTIVES = "_collectives_s"   # a rank's seconds in explicit collectives, beside its update's metrics
CHECKPOINT_BUCKET_BYTES = 64 << 20   # optimizer state per call when a checkpoint gathers it from the ranks


class ReplicaMismatchError(RuntimeError):
    """Data-parallel replicas hold different weights or counters after a step."""


# ---- inside each Ray actor -----------------------------------------------------------------

class TrainRank:
    """One data-parallel rank of a trainable role (hosted by workers._RoleHost). The process
    group is joined after construction (RayWorkerGroup.init_process_group), then `setup`."""

    forward_methods: tuple[str, ...] = ()   # root methods that run a forward besides `forward`

    def __init__(self, make_worker: Callable[..., Any], run_seed: int, dp_strategy: str = "allreduce",
                 template: torch.nn.Module | None = None, weights: list | None = None) -> None:
        """`make_worker()` makes the worker here; with `template` (fsdp2: the model with its weights
        on the meta device, sharded_from_rank0) the worker is `make_worker(model)`, made in
        `setup` once rank 0 has filled every rank's shards from `weights` ([a reference to the
        full state in Ray's object store], read by rank 0 only): no other rank receives the whole
        model."""
        self.run_seed, self.dp_strategy = run_seed, dp_strategy
        self._deferred = (make_worker, template, weights) if template is not None else None
        self.worker = make_worker() if template is None else None
        self._snapshot: dict | None = None

    def setup(self) -> int:
        """After joining the group: this rank's derived seed, deterministic kernels; with fsdp2,
        the model sharded (decoder layers, then the root) and the optimizer made again over the
        sharded parameters (it held the replaced ones), or, from a template, the shards filled
        and the worker made over them."""
        rank, size = world()
        if self._deferred is not None:   # sharded and filled here; the worker's optimizer is made over the shards
            make_worker, template, weights = self._deferred
            fsdp2_shard(template, decoder_layers(template), self.forward_methods)
            fill_from_rank0(template, weights[0] if rank == 0 else None)
            self.worker, self._deferred = make_worker(template), None
        torch.manual_seed(rank_seed(self.run_seed, rank))
        torch.use_deterministic_algorithms(True, warn_only=True)
        if self.dp_strategy == "fsdp2" and size > 1 and not fsdp2_available():
            import logging
            logging.getLogger(__name__).warning("FSDP2 is not available in this torch: placement.dp_strategy="
                                                "allreduce is used instead")
            self.dp_strategy = "allreduce"
        if self.dp_strategy == "fsdp2" and size > 1 and not self.sharded():
            model = self.worker.model
            fsdp2_shard(model, decoder_layers(model), self.forward_methods)
            self.worker.optimizer = self.worker.make_optimizer()
        return rank

    def sharded(self) -> bool:
        """Whether this rank's model is sharded (FSDP2 DTensor parameters)."""
        return is_sharded(self.worker.model)

    def state(self, model: bool = True, optim: bool = True) -> tuple[dict | None, dict | None] | None:
        """(model state, optimizer state), full tensors, for the driver's mirror: rank 0's, each
        None unless asked for; None on the others, which take part in gathering the shards."""
        w = self.worker
        model_state = full_state(w.model.state_dict()) if model else None
        optim_state = full_optimizer_state(w.optimizer) if optim else None
        return (model_state, optim_state) if world()[0] == 0 else None

    def _flat(self, part: str) -> tuple[dict[str, torch.Tensor], dict | None]:
        """("model": the state dict; "optim": the optimizer state in a checkpoint's flat form,
        roles/common.optimizer_to_flat, with its JSON part). Sharded tensors stay sharded."""
        if part == "model":
            return self.worker.model.state_dict(), None
        return optimizer_to_flat(self.worker.optimizer)

    def layout(self, part: str) -> tuple[list[tuple[str, int]], dict | None] | None:
        """Rank 0: (key, bytes) of every tensor of `part` (_flat) and its JSON part (None for the
        model); None on the others. Nothing is gathered: a shard's shape is its whole tensor's."""
        tensors, meta = self._flat(part)
        if world()[0] != 0:
            return None
        return [(k, t.numel() * t.element_size()) for k, t in tensors.items()], meta

    def tensors(self, part: str, keys: list[str]) -> dict[str, torch.Tensor] | None:
        """Rank 0: the full tensors of `keys` (layout's) on the CPU; None on the others, which take
        part in gathering them (a collective per sharded tensor, in `keys`' order)."""
        tensors, _ = self._flat(part)
        out = full_state({k: tensors[k] for k in keys})
        return out if world()[0] == 0 else None

    def load_state(self, model_state: list, optim_state: list, counters: dict[str, int]) -> None:
        """Full model and optimizer state (the mirror's, each as [a reference in Ray's object
        store], or [itself] outside Ray), cut into this rank's shards if sharded. With several
        ranks only rank 0 reads them, and broadcasts them a tensor at a time (load_from_rank0)."""
        rank, size = world()
        if size == 1:
            load_full_state(self.worker.model, unlisted(model_state))
            load_full_optimizer_state(self.worker.optimizer, unlisted(optim_state))
        else:
            read = unlisted if rank == 0 else (lambda x: None)
            load_from_rank0(self.worker.model, self.worker.optimizer, read(model_state), read(optim_state))
        self.set_counters(counters)

    def set_counters(self, counters: dict[str, int]) -> None:
        for name, value in counters.items():
            setattr(self.worker, name, value)

    def _update(self, *args) -> tuple[dict, dict]:
        """(the worker's update metrics plus this rank's seconds in collectives, its counters)."""
        take_collective_seconds()
        metrics = self.worker.update(*args)
        return {**metrics, COLLECTIVES: take_collective_seconds()}, \
            {"step": self.worker.step, "skipped_steps": self.worker.skipped_steps}

    def keep_snapshot(self, copy: bool = True) -> None:
        """The committed state, kept here (never shipped) until `restore_snapshot`."""
        self._snapshot = self.worker.snapshot(copy)

    def restore_snapshot(self) -> None:
        self.worker.restore(self._snapshot)


class ActorRank(TrainRank):
    def publish(self, attempt: int, dtype: str, base_hash: str | None):
        """EXPORTING(v) on the ranks, the driver out of the data path. Every rank gathers the full
        tensors the actor ships (a collective with fsdp2; with LoRA the adapter's). Rank 0 builds
        their manifest at the driver's `attempt`, makes what the rollout loads of them
        (sync/adapter.rollout_copy: its dtype, or the adapter named on the pinned base) and puts
        that in the object store itself: it returns (sync/remote.stored, its bytes, the hash of
        the manifest's entries, the rollout's manifest). Every other rank returns its hash."""
        state = copy_once(full_state(self.worker.exported_tensors()), torch.Tensor.clone)
        if world()[0] != 0:
            return entries_digest({name: tensor_entry(t) for name, t in state.items()})
        self.worker.attempt = attempt
        manifest = self.worker.manifest_of(state)
        loaded, loaded_manifest = rollout_copy(state, manifest, dtype, base_hash)
        return stored(loaded), sync_bytes(loaded), entries_digest(manifest.entries), loaded_manifest

    def old_log_probs(self, batch: ExperienceBatch) -> tuple[list[str], torch.Tensor]:
        """(sample ids, (b, R) log-probs) of this rank's shard: the actor's recompute forward."""
        shard, w = shard_batch(batch, *world()), self.worker
        w.model.eval()
        lp, _ = batch_log_probs(w.model, shard, w.temperature, w.pad_id, w.tf.micro_batch_size, tf=w.tf)
        with torch.no_grad():   # FSDP2: as many forwards as the rank with the most rows
            for _ in range(idle_passes(w.model, batch.sample_ids, pass_counter(w.tf, batch.samples))):
                first = batch.samples[0]
                w.tf.log_probs(w.model, [list(first.prompt_ids)], [list(first.response_ids)], w.temperature, w.pad_id)
        return shard.sample_ids, lp

    def update(self, batch: ExperienceBatch, version: PolicyVersion, iteration: int, seed: int, kl_coef: float):
        return self._update(batch, version, iteration, seed, kl_coef)


class CriticRank(TrainRank):
    forward_methods = ("values",)

    def values(self, batch: ExperienceBatch) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        """(sample ids, (b, R) values, (b,) last values) of this rank's shard."""
        shard, w = shard_batch(batch, *world()), self.worker
        if len(shard):   # an empty shard (more ranks than samples) has no rows to return
            w.compute(shard)
        with torch.no_grad():   # FSDP2: as many forwards as the rank with the most rows
            for _ in range(idle_passes(w.model, batch.sample_ids, pass_counter(w.tf, batch.samples))):
                w.model.values([list(batch.samples[0].prompt_ids)], [list(batch.samples[0].response_ids)],
                               pad_id=w.pad_id)
        if not len(shard):
            return [], torch.zeros(0, batch.num_response_tokens), torch.zeros(0)
        return shard.sample_ids, shard.get("values"), shard.get("last_values")

    def update(self, batch: ExperienceBatch, seed: int = 0):
        return self._update(batch, seed)


# ---- on the driver -------------------------------------------------------------------------

def join_rows(batch: ExperienceBatch, parts: list[tuple[list[str], torch.Tensor]]) -> torch.Tensor:
    """Every rank's rows put at their sample ids' positions in `batch`; each id exactly once."""
    pos = {sid: i for i, sid in enumerate(batch.sample_ids)}
    ids = [sid for part_ids, _ in parts for sid in part_ids]
    if sorted(ids) != sorted(pos):
        missing, extra = sorted(set(pos) - set(ids)), sorted(set(ids) - set(pos))
        raise RuntimeError(f"data-parallel shards do not cover the batch once: missing {missing[:3]}, "
                           f"unknown {extra[:3]}, {len(ids)} rows for {len(pos)} ids")
    rows = torch.cat([t for _, t in parts])
    out = torch.empty_like(rows)
    out[torch.tensor([pos[s] for s in ids], dtype=torch.long)] = rows
    return out


def rank_lost(e: WorkerError) -> StoppedRun:
    """The one line (and failures.jsonl record) of a rank whose process or node is gone."""
    where = HOSTS.get((e.role, e.worker), {})
    host, node = where.get("host", "?"), where.get("node_id", "")[:12] or "?"
    message = (f"{e.role} rank {e.worker} on host {host} (Ray node {node}) was lost during {e.method} "
               f"({e.reason}); the run stops here: nothing after the last committed checkpoint is kept, "
               "and resume=auto on the remaining nodes continues from it exactly")
    return StoppedRun(message, {"stage": e.method, "role": e.role, "worker": e.worker, "host": host,
                                "node_id": where.get("node_id", ""), "reason": e.reason})


class Replicas:
    """Plumbing both facades compose: the rank group and the driver's mirror of rank 0.

    The mirror holds no weights between reads: its model is the role's structure on the meta
    device (rollout/backends.weightless_template) and it has no optimizer. Reading `model` or
    `optimizer` (a resume, the optimal-token baseline, a test) fills it from the ranks; the next
    update or rollback empties it again. With LoRA the mirror stays whole: its frozen base serves
    the reference in this process and names the base by hash."""

    def __init__(self, group: WorkerGroup, local, timeout_s: float | None = None) -> None:
        self.group, self.local, self.timeout_s = group, local, timeout_s
        self.model_stale = self.optim_stale = False   # the ranks moved on since the last pull
        self.template = None if has_lora(local.model) else weightless_template(local.model, trainable=True)
        self.empty()

    def call(self, method: str, *args) -> list:
        try:
            return self.group.call(method, *args, timeout_s=self.timeout_s)
        except WorkerError as e:
            if e.lost:   # its shard of the weights and Adam state went with it: no rank can go on
                raise rank_lost(e) from e
            raise

    def share(self, batch: ExperienceBatch):
        return self.group.put(batch)   # one copy in the object store, read by every rank

    def changed(self) -> None:
        self.model_stale = self.optim_stale = True
        self.empty()

    def empty(self) -> None:
        """The mirror back to the meta device: what the ranks hold is not kept here."""
        if self.template is not None:
            self.local.model, self.local.optimizer = self.template, None
            self.model_stale = self.optim_stale = True

    def _filled(self) -> None:
        """A model with storage (values unset until pulled) and an optimizer over it, for a read."""
        if self.template is not None and self.local.model is self.template:
            self.local.model = copy.deepcopy(self.template)
            allocate(self.local.model, self.local.device)
            self.local.optimizer = self.local.make_optimizer()

    def model(self):
        self._filled()
        if self.model_stale:   # the weights only: the end of a run exports the policy, not Adam's moments
            self.pull(optim=False)
        return self.local.model

    def optimizer(self):
        self._filled()
        if self.optim_stale:
            self.pull(model=self.model_stale)
        return self.local.optimizer

    def pull(self, model: bool = True, optim: bool = True) -> None:
        """The ranks' full weights and/or optimizer state into the mirror: every rank gathers
        (fsdp2), rank 0 ships it."""
        model_state, optim_state = self.call("state", model, optim)[0]
        if model:
            self.local.model.load_state_dict(model_state, strict=True)
            self.model_stale = False
        if optim:
            self.local.optimizer.load_state_dict(optim_state)
            self.optim_stale = False

    def push(self, counters: dict[str, int]) -> None:
        """The mirror's weights, optimizer state and counters onto every rank (resume)."""
        model_state, optim_state = self.model().state_dict(), self.optimizer().state_dict()
        # each in a list: Ray hands a listed reference over unresolved, so only rank 0 reads it
        self.call("load_state", [self.group.put(model_state)], [self.group.put(optim_state)], counters)

    def check_weights(self, role: str, hashes: list[str], want: str) -> None:
        bad = [r for r, h in enumerate(hashes, start=1) if h != want]
        if bad:
            raise ReplicaMismatchError(f"{role}: weights of ranks {bad} differ from rank 0 "
                                       f"(rank 0 {want[:12]}, rank {bad[0]} {hashes[bad[0] - 1][:12]})")

    def close(self) -> None:
        self.group.close()


class _RoleGroup:
    """What both facades share: the rank group with rank 0's mirror, the counters (kept in the
    mirror; set by an update, a rollback, or a checkpoint restore, which pushes the mirror's
    state to every rank), updates and rollbacks, and the mirror's model and optimizer, pulled
    from rank 0 when read."""

    def __init__(self, group: WorkerGroup, local, timeout_s: float | None = None) -> None:
        self.replicas = Replicas(group, local, timeout_s)
        self.local = local

    @property
    def num_workers(self) -> int:
        return self.replicas.group.num_workers

    @property
    def step(self) -> int:
        return self.local.step

    def set_counters(self, **counters: int) -> None:
        """Restoring a checkpoint: position.py has loaded `model` and `optimizer` into the
        mirror; the mirror's state and these counters are pushed to every rank."""
        for name, value in counters.items():
            setattr(self.local, name, value)
        self.replicas.push(counters)

    @property
    def skipped_steps(self) -> int:
        return self.local.skipped_steps

    def _update(self, role: str, *args) -> dict:
        """Every rank updates; their step counters must agree. Metrics are all-reduced: the same
        on every rank."""
        self.replicas.changed()
        results = self.replicas.call("update", *args)
        counters = results[0][1]
        if any(c != counters for _, c in results):
            raise ReplicaMismatchError(f"{role} ranks disagree on counters: {[c for _, c in results]}")
        self.local.step, self.local.skipped_steps = counters["step"], counters["skipped_steps"]
        seconds = [m.pop(COLLECTIVES) for m, _ in results]   # each rank's own: the slowest waited longest
        if len(results) == 1:   # one rank talks to no one
            return results[0][0]
        return {**results[0][0], f"perf/{role}_collectives_s": max(seconds)}

    def streamed(self, part: str) -> tuple[Iterator[dict[str, torch.Tensor]], dict | None]:
        """The ranks' full `part` ("model": weights, "optim": optimizer state) for a checkpoint or
        an export, never whole in the driver: its JSON part (None for the model), and chunks of
        its tensors, CHECKPOINT_BUCKET_BYTES at a time (at least one chunk), each gathered by every
        rank and shipped by rank 0 when the writer asks for it (trainer/resume/checkpoint.StreamedPart
        and models/hf.save_causal_lm_shards write each as it comes)."""
        layout, meta = self.replicas.call("layout", part)[0]
        buckets: list[list[str]] = [[]]
        size = 0
        for key, nbytes in layout:
            if buckets[-1] and size + nbytes > CHECKPOINT_BUCKET_BYTES:
                buckets.append([])
                size = 0
            buckets[-1].append(key)
            size += nbytes
        return (self.replicas.call("tensors", part, keys)[0] for keys in buckets), meta

    @property
    def structure(self) -> torch.nn.Module:
        """The model for its config and shapes only, never pulled (on the meta device between reads)."""
        return self.local.model

    def save_pretrained(self, tokenizer, path) -> None:
        """The ranks' policy as a Hugging Face folder, streamed (models/hf.save_causal_lm_shards)."""
        save_causal_lm_shards(self.local.model, self.streamed("model")[0], tokenizer, path)

    def snapshot(self, copy: bool = True) -> dict:
        """Every rank keeps its own (sharded) committed state; the driver keeps the counters."""
        self.replicas.call("keep_snapshot", copy)
        return {"step": self.local.step, "skipped": self.local.skipped_steps}

    def restore(self, snap: dict) -> None:
        self.replicas.call("restore_snapshot")
        self.replicas.changed()
        self.local.step, self.local.skipped_steps = snap["step"], snap["skipped"]

    @property
    def model(self):
        return self.replicas.model()

    @property
    def optimizer(self):
        return self.replicas.optimizer()

    def close(self) -> None:
        self.replicas.close()


class ActorGroup(_RoleGroup):
    """The actor over N data-parallel ranks, with the Actor interface the driver and
    position.py use (export, compute_old_log_probs, update, snapshot, restore, step, attempt,
    skipped_steps, model, optimizer)."""

    @property
    def attempt(self) -> int:   # only the manifest uses it, and the manifest is built here
        return self.local.attempt

    @attempt.setter
    def attempt(self, value: int) -> None:
        self.local.attempt = value

    def publish(self, dtype: str, base_hash: str | None) -> tuple[RemoteState | dict, WeightManifest]:
        """EXPORTING(v): what the rollout loads, as ActorRank.publish made it on rank 0 (in Ray, a
        RemoteState: the tensors stay in the object store); every other rank's hash must equal
        rank 0's. The mirror is not refreshed: it is pulled only when read (checkpoints, the end)."""
        (state, nbytes, want, manifest), *hashes = self.replicas.call("publish", self.local.attempt, dtype, base_hash)
        self.replicas.check_weights("actor", hashes, want)
        return received(state, nbytes), manifest

    def compute_old_log_probs(self, batch: ExperienceBatch, version: PolicyVersion, fuse=None) -> None:
        """Recompute mode, split by sample id over the ranks and joined by id (`fuse` is for one
        process: Actor.compute_old_log_probs)."""
        parts = self.replicas.call("old_log_probs", self.replicas.share(batch))
        batch.put("old_log_probs", join_rows(batch, parts), Role.ACTOR, version.id)

    def update(self, batch: ExperienceBatch, version: PolicyVersion, iteration: int, seed: int,
               kl_coef: float) -> dict:
        """Every rank runs Actor.update on the whole batch, keeping its rows per step."""
        return self._update("actor", self.replicas.share(batch), version, iteration, seed, kl_coef)


class CriticGroup(_RoleGroup):
    """The critic over N data-parallel ranks, with the Critic interface (compute,
    update, snapshot, restore, step, version, model, optimizer)."""

    @property
    def version(self) -> str:
        return self.local.version

    def compute(self, batch: ExperienceBatch) -> None:
        """Values split by sample id over the ranks and joined by id."""
        parts = self.replicas.call("values", self.replicas.share(batch))
        batch.put("values", join_rows(batch, [(ids, v) for ids, v, _ in parts]), Role.CRITIC, self.version)
        batch.put("last_values", join_rows(batch, [(ids, last) for ids, _, last in parts]), Role.CRITIC,
                  self.version)

    def update(self, batch: ExperienceBatch, seed: int = 0) -> dict[str, float]:
        return self._update("critic", self.replicas.share(batch), seed)
