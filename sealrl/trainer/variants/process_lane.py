"""rollout.lane=process: the generation lane of an asynchronous run (trainer/pipeline.py)
samples in its own process (placement/process_rollout.py) while this one trains.

For the pipeline's lifetime the run's rollout role is the process's: the lane's generate
calls, the training lane's publications (two-phase verified, loaded while the process keeps
sampling with the retained version) and mid-run evaluations all go there. The lane thread
stays here and only waits on the process, samples prompts and scores: the fixed-lag schedule
is the thread lane's, so a run is bitwise the same. On close the process is stopped and the
in-process rollout is brought to the last published version (the final evaluation's).
"""
from __future__ import annotations

import torch

from sealrl.placement.process_rollout import ProcessRollout
from sealrl.sync.adapter import rollout_copy
from sealrl.trainer.adapters import pinned_base
from sealrl.trainer.resume.retained import version_manifest


class ProcessLane:
    def __init__(self, run, first_version, retain: int, recalled: dict | None = None) -> None:
        self.run, self.local = run, run.roles.rollout
        self.proc = ProcessRollout(run.roles.rollout_factory, torch.get_num_threads(), retain,
                                   run.cfg.placement.timeout_s)
        try:
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
                raise RuntimeError(f"generation process (pid {self.proc.pid}) loaded {manifest.version}, "
                                             f"the run starts from {first_version}")
        except BaseException:
            self.proc.close()
            raise
        run.roles.rollout = self.proc
        self.worker = run.timer.workers.get("rollout")
        run.timer.workers["rollout"] = f"pid {self.proc.pid} (generation process)"   # named in the trace

    def check(self) -> None:
        """The process's failure, if it failed (its generate errors are otherwise retried as
        failed samples): the named error, not an iteration of empty groups."""
        if self.proc.failed is not None:
            raise self.proc.failed

    def failure(self, e: BaseException) -> BaseException:
        """What the training lane raises for the lane's exception `e`."""
        return self.proc.failed or e

    def close(self) -> None:
        self.run.roles.rollout = self.local
        self.run.timer.workers.pop("rollout")
        if self.worker is not None:
            self.run.timer.workers["rollout"] = self.worker
        last = self.proc.last_loaded()
        failed = self.proc.failed
        self.proc.close()
        if last is not None and failed is None and self.local.version != self.proc.version:
            self.local.load(*last)
