"""rollout.lane=process: the generation lane of an asynchronous run (trainer/pipeline.py)
samples in its own process while this one trains. That process is a rollout pool of one worker
on a process host (placement/process_group.py over seams/host.py): the client the Ray replicas
are behind, with its two-phase verified loads, retained versions and replacement of a lost
worker; no generation-process code of its own.

For the pipeline's lifetime the run's rollout role is the pool's: the lane's generate calls,
the training lane's publications (verified there, loaded while the process keeps sampling with
the retained version: each worker runs two calls at once) and mid-run evaluations all go there.
The lane thread stays here and only waits on the process, samples prompts and scores: the
fixed-lag schedule is the thread lane's, so a run is bitwise the same. A process that dies or
misses its deadline is replaced (a fresh one brought to the pinned base and every retained
version, verified) and its shard sent again with the same seeds: the run goes on, bitwise. One
that cannot be replaced stops the run with the host's HostLostError. On close the process is
stopped and the in-process rollout is brought to the last published version (the final
evaluation's).
"""
from __future__ import annotations

import torch

from sealrl.placement.process_group import ProcessWorkerGroup
from sealrl.placement.rollout_pool import RolloutPool
from sealrl.sync.adapter import rollout_copy
from sealrl.trainer.adapters import pinned_base
from sealrl.trainer.resume.retained import version_manifest


class ProcessLane:
    def __init__(self, run, first_version, retain: int, recalled: dict | None = None) -> None:
        self.run, self.local = run, run.roles.rollout
        timeout_s = run.cfg.placement.timeout_s
        self.group = ProcessWorkerGroup("rollout", run.roles.rollout_factory, 1, timeout_s,
                                        threads=torch.get_num_threads(), concurrency=2)
        self.proc = RolloutPool(self.group, timeout_s=timeout_s)
        try:
            self.proc.retain(retain)
            if run.roles.rollout_base is not None:   # LoRA: the base the versions merge into, pinned there too
                actor = run.roles.actor
                self.proc.pin_base(*pinned_base(actor.model, actor.base, run.cfg.rollout.dtype))
            loaded = set()
            for _, (version, weights) in sorted((recalled or {}).items()):   # a resume: the versions the lane
                if weights is not None and version.id not in loaded:          # still samples from, oldest first
                    self.proc.load(weights, version_manifest(run, weights, version))
                    loaded.add(version.id)
            # the version the run starts from, exported again and verified there
            state, manifest = rollout_copy(*run.roles.actor.export(), run.cfg.rollout.dtype, run.roles.rollout_base)
            if self.proc.load(state, manifest) != first_version:
                raise RuntimeError(f"generation process (pid {self.group.pids[0]}) loaded {manifest.version}, "
                                   f"the run starts from {first_version}")
        except BaseException:
            self.proc.close()
            raise
        run.roles.rollout = self.proc
        self.worker = run.timer.workers.get("rollout")
        run.timer.workers["rollout"] = f"pid {self.group.pids[0]} (generation process)"   # named in the trace

    @property
    def failed(self):
        """The host's HostLostError if the process is lost and was not replaced, else None."""
        hosts = self.group.actors
        return hosts[0].lost if hosts else None

    def check(self) -> None:
        """The process's failure, if it could not be replaced (its generate errors are otherwise
        retried as failed samples): the named error, not an iteration of empty groups."""
        if self.failed is not None:
            raise self.failed

    def failure(self, e: BaseException) -> BaseException:
        """What the training lane raises for the lane's exception `e`."""
        return self.failed or e

    def close(self) -> None:
        self.run.roles.rollout = self.local
        self.run.timer.workers.pop("rollout")
        if self.worker is not None:
            self.run.timer.workers["rollout"] = self.worker
        failed = self.failed
        last = self.proc.last_loaded() if failed is None else None
        self.proc.close()
        if last is not None and self.local.version != last[1].version:
            self.local.load(*last)
