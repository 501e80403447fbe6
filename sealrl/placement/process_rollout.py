"""The rollout role in its own process, a client of the rollout seam (seams/rollout.py; its
capabilities are CLIENTS["process"]): the generation lane of an asynchronous
run (rollout.lane=process, trainer/pipeline.py) samples there while the actor trains here, each
process with its own torch threads and its own GIL.

The process is a process host (seams/host.py) with two channels, one per direction of work,
so neither waits on the other:

- calls (channel 0): generate (and retain). The caller's thread waits for the answer; a streamed
  generate (reward.stream) receives the rows that finished at each decode step ahead of its
  answer, handed on in the caller's thread.
- weights (channel 1): load(state, manifest), and with LoRA once pin_base (the frozen base). The
  child stages the state, verifies every checksum of the manifest (the two-phase sync of
  sealrl/sync: a corrupted tensor raises WeightSyncError naming it and activates nothing), then
  switches the active version. It runs while a generate call is in flight: that call keeps the
  version it was asked for (the engine retains the last `retain` versions), so a publication
  never waits for a generation to end and a generation never waits for a whole transfer
  (double buffering: the retained version samples while the next one loads).

The state crosses as torch.save bytes (a copy: nothing of the actor's memory is shared), the
factory that builds the role as plain-pickle bytes. `version` and `backend` are the child's
answers to the last load, kept here, so asking them never queues behind a generation.

Every wait polls the child: if it exits, or misses `timeout_s`, the call raises the host's
HostLostError naming the process, its exit code and the call; every later call raises the same
error (`failed`). A role's own exception (a bad request, WeightSyncError) comes back as itself
(or its RemoteCallError form) and the process serves on.
"""
from __future__ import annotations

import functools
import io

import torch

from sealrl.experience import PolicyVersion
from sealrl.seams.host import HostLostError, ProcessHost
from sealrl.seams.rollout import CLIENTS

CALLS, WEIGHTS = 0, 1


class ProcessRollout:
    """A rollout role built by `factory` (picklable: e.g. functools.partial(Rollout, model,
    tokenizer)) in a process host that runs `threads` torch threads and serves `retain` versions."""

    capabilities = CLIENTS["process"].capabilities

    def __init__(self, factory, threads: int, retain: int = 1, timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s
        self.version: PolicyVersion | None = None
        self.backend: tuple[str, str] = ("none", "none")
        self._last: tuple[bytes, object] | None = None   # the last loaded state (bytes) and manifest
        # imports torch and builds the role: slow on a busy machine
        self.host = ProcessHost("generation process", functools.partial(_GenerationRole, factory, threads, retain),
                                channels=2, startup_timeout_s=max(timeout_s, 120.0))
        self.pid = self.host.pid

    @property
    def failed(self) -> HostLostError | None:
        return self.host.lost

    # ---- the rollout client (seams/rollout.py) ------------------------------------------------
    def generate(self, requests, contract, version, stream=None):
        """`stream(samples)`: the rows that finished at a decode step, sent ahead of the answer
        and handed on here, in the calling thread."""
        return self._call("generate", requests, contract, version, stream=stream)

    def generate_switching(self, requests, contract, version, plan=None, resolve=None, stream=None):
        """rollout.partial=switch: the switch happens there, on the loads it receives meanwhile;
        a replay's `plan` names the recorded versions themselves, waited for there (`resolve`,
        a function of this process, cannot cross)."""
        if resolve is not None:
            raise ValueError("generate_switching in the generation process: the plan's keys must be the "
                             "versions themselves (a resolve function cannot cross processes)")
        return self._call("generate_switching", requests, contract, version, plan, stream=stream)

    def pin_base(self, state, manifest) -> str:
        """LoRA: the frozen base, sent once over the weights channel and verified there; every
        later version is an adapter the child merges into it. Returns the base's hash."""
        return self.host.call("pin_base", _bytes(state), manifest, channel=WEIGHTS, timeout_s=self.timeout_s)

    def retain(self, versions: int) -> None:
        self._call("retain", versions)

    def load(self, state, manifest) -> PolicyVersion:
        """Stage, verify and activate in the child (which may be generating meanwhile)."""
        data = _bytes(state)
        self.version, self.backend = self.host.call("load", data, manifest, channel=WEIGHTS,
                                                    timeout_s=self.timeout_s)
        self._last = (data, manifest)
        return self.version

    def last_loaded(self) -> tuple[dict, object] | None:
        """The last state and manifest loaded (to bring another rollout to the same version)."""
        if self._last is None:
            return None
        return torch.load(io.BytesIO(self._last[0]), weights_only=True), self._last[1]

    def take_served(self) -> list[dict]:
        return []

    def take_recoveries(self) -> list[float]:
        return []

    def take_engine_stats(self) -> dict[str, float]:
        return self._call("take_engine_stats")   # the child's meter

    def close(self) -> None:
        """Stop the process (a polite stop, then kill)."""
        self.host.close()

    def _call(self, method: str, *args, stream=None):
        kw = {} if stream is None else {"stream": stream}
        return self.host.call(method, *args, channel=CALLS, timeout_s=self.timeout_s, **kw)


def _bytes(state) -> bytes:
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    return buf.getvalue()


class _GenerationRole:
    """What the generation process serves: the role, with its torch settings, and loads that
    arrive as torch.save bytes."""

    def __init__(self, factory, threads: int, retain: int) -> None:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(True, warn_only=True)   # as the driver's process
        self.role = factory()
        self.role.retain(retain)

    def __getattr__(self, name):
        if name == "role":   # not built (the factory raised)
            raise AttributeError(name)
        return getattr(self.role, name)

    def load(self, data: bytes, manifest):
        version = self.role.load(torch.load(io.BytesIO(data), weights_only=True), manifest)
        return version, self.role.backend

    def pin_base(self, data: bytes, manifest) -> str:   # LoRA: the base later adapter versions merge into
        return self.role.pin_base(torch.load(io.BytesIO(data), weights_only=True), manifest)
