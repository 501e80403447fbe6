"""rollout.lane=process: the rollout role runs in its own process for the whole run, so that the
generation lane of an asynchronous run (trainer/pipeline.py) samples there while this process
trains, each with its own torch threads and GIL. trainer/setup.py:process_rollout_pool builds it:
a rollout pool of one worker on a process host (placement/process_group.py over seams/host.py),
the client the Ray replicas are behind, with its two-phase verified loads, retained versions and
replacement of a lost worker; there is no generation-process code of its own, and the run's roles
never change while it goes.

Every rollout call goes there: the lane's generate calls, the training lane's publications
(verified there, loaded while the process keeps sampling with the retained version: the worker
runs two calls at once) and the evaluations. The lane thread stays here and only waits on the
process, samples prompts and scores: the fixed-lag schedule is the thread lane's, so a run is
bitwise the same. A process that dies or misses its deadline is replaced (a fresh one brought
to the pinned base and every retained version, verified) and its shard sent again with the same
seeds: the run goes on, bitwise. One whose replacement cannot start either stops the run with
the host's HostLostError (`loss`: what the pipeline raises instead of an iteration of empty
groups).
"""
from __future__ import annotations

from sealrl.placement.process_group import ProcessWorkerGroup


def loss(rollout) -> BaseException | None:
    """The HostLostError of a replacement generation process that could not start (the run
    cannot go on); None for any other rollout, or while the process serves or is being replaced."""
    group = getattr(rollout, "group", None)
    return group.unreplaced if isinstance(group, ProcessWorkerGroup) else None
