"""Fault harnesses for the placement tests: real RolloutWorkers whose weight transfer is
corrupted, or whose process exits mid-call, the first time any replica of a pool reaches that
point (a marker file created with O_EXCL decides, atomically across processes). The replica
that failed is replaced by a fresh one from the same factory, which then behaves."""
from __future__ import annotations

import os
import time

from sealrl.placement.workers import RayWorkerGroup
from sealrl.roles.rollout import Rollout


def first_to_claim(marker: str) -> bool:
    """True for the single caller, in any process, that creates `marker`."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


class CorruptedTransfer(Rollout):
    """The first replica to stage a version of policy step `step` receives `tensor` with one
    value changed (as a bad transfer would deliver it); its own verification must catch it."""

    def __init__(self, model, tokenizer, marker: str, tensor: str, step: int):
        super().__init__(model, tokenizer)
        self.marker, self.tensor, self.step = marker, tensor, step

    def stage(self, state, manifest):
        if manifest.version.step == self.step and first_to_claim(self.marker):
            state = corrupted(state, self.tensor)
        return super().stage(state, manifest)


def corrupted(state: dict, tensor: str) -> dict:
    """`state` with one value of `tensor` changed (the caller's copy stays intact)."""
    state = dict(state)
    state[tensor] = state[tensor].clone()
    state[tensor].view(-1)[0] += 1e-3
    return state


class DiesMidGenerate(Rollout):
    """The first replica to generate for a group id starting with `prefix` computes its samples
    and then its process exits before answering (os._exit: no clean-up, no reply)."""

    def __init__(self, model, tokenizer, marker: str, prefix: str):
        super().__init__(model, tokenizer)
        self.marker, self.prefix = marker, prefix

    def generate(self, requests, contract, version):
        samples = super().generate(requests, contract, version)
        if any(r.group_id.startswith(self.prefix) for r in requests) and first_to_claim(self.marker):
            os._exit(17)
        return samples


class HangsMidGenerate(Rollout):
    """The first replica to generate hangs (sleeps `seconds`) before answering: a late replica
    whose task is still running when the caller's deadline passes."""

    def __init__(self, model, tokenizer, marker: str, seconds: float):
        super().__init__(model, tokenizer)
        self.marker, self.seconds = marker, seconds

    def generate(self, requests, contract, version):
        if first_to_claim(self.marker):
            time.sleep(self.seconds)
        return super().generate(requests, contract, version)


class DiesMidStage(Rollout):
    """The first replica to stage a version of policy step `step` exits while staging it."""

    def __init__(self, model, tokenizer, marker: str, step: int):
        super().__init__(model, tokenizer)
        self.marker, self.step = marker, step

    def stage(self, state, manifest):
        if manifest.version.step == self.step and first_to_claim(self.marker):
            os._exit(17)
        return super().stage(state, manifest)


class PatientRestarts(RayWorkerGroup):
    """A Ray group whose replacement actors get the group's own (generous) deadline to start,
    whatever deadline the caller passes: a test that times a pool's deadline on generate keeps
    that deadline short without also requiring a new actor process (torch imports, seconds on a
    busy machine) to start within it."""

    def restart(self, k: int, timeout_s: float | None = None) -> None:
        super().restart(k, timeout_s=self.timeout_s)


class CorruptedThenDiesMidStage(DiesMidStage):
    """CorruptedTransfer's fault at policy step `corrupt_step` (marker `corrupt_marker`), and
    DiesMidStage's at `step`: both stage drills on one pool (a new Ray actor imports torch)."""

    def __init__(self, model, tokenizer, corrupt_marker: str, tensor: str, corrupt_step: int, marker: str,
                 step: int):
        super().__init__(model, tokenizer, marker, step)
        self.corrupt_marker, self.tensor, self.corrupt_step = corrupt_marker, tensor, corrupt_step

    def stage(self, state, manifest):
        if manifest.version.step == self.corrupt_step and first_to_claim(self.corrupt_marker):
            state = corrupted(state, self.tensor)
        return super().stage(state, manifest)
