"""RewardPool: score samples in worker processes, each request under a deadline.

What it guarantees: `score(samples)` returns one RewardRecord per sample, in input order (joined
by sample_id), within about `timeout_s` per request after that request was handed to a worker. A
scorer that raises or returns a non-score gives status error; one that runs past the deadline
gives status timeout, and its worker is killed with SIGKILL and replaced by a fresh one. Neither
ever becomes a number.

How: `num_scorers` process hosts (seams/host.py: fresh interpreters, never a fork: torch +
fork is unsafe) serving sealrl.rewards.worker.Scorer, each over its own socket pair, all waited
on at once. A worker has at most one request in flight, so a hang is attributable to that
request; a reply is joined only if it answers that request and comes from the worker's own
process (the host refuses any other, and the worker is replaced). A request is one sample,
or, for a BatchRewardFunction (a reward model), one contiguous chunk of the batch per worker:
then `timeout_s` bounds the whole chunk and a timeout marks every sample of it.

Why not multiprocessing's "spawn": a spawned child re-imports the driver's __main__ module, and
with a driver that imports torch that measured ~2 s per worker (forkserver children did the same
on Python 3.11). Launched as `python -c`, a worker imports only the host, sealrl.rewards.worker,
the scorer's module and what its `setup()` loads: ~0.05-0.1 s for a rule-based scorer, ~0.5 s
with math-verify (sympy), seconds for a reward model (torch, transformers, weights).

Start-up: the constructor waits until every worker is ready (bounded by `startup_timeout_s`). A
replacement for a killed worker boots in the background and takes work once ready, so a batch
right after a kill may wait for it; deadlines start at dispatch, never during boot. A worker
that cannot start at all is an infrastructure failure: the pool closes itself and raises.

Inline mode (num_scorers=0) calls the scorer in this process with the same validation; there is
no deadline enforcement (nothing can pre-empt a Python call in-process), so use it only for
trusted, fast scorers, tests, or a reward model on the driver's device.

Not thread-safe: one driver thread calls `score`. The scorer must pickle by reference (a
module-level class or function, importable with the driver's sys.path, which workers inherit).
Workers are killed on close(), when the pool is garbage-collected, and at interpreter exit; if
the driver is SIGKILLed, idle workers exit on the closed pipe but a hung one lives until its
scorer returns (a driver ended by its stage watchdog kills its children first).
"""
from __future__ import annotations

import functools
import math
import pickle
import time
import weakref
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Iterable, Sequence

from sealrl.experience.records import RewardRecord, RewardStatus
from sealrl.rewards.base import BatchRewardFunction, Outcome, RewardFunction, RewardSample, failure_message, score_raw
from sealrl.rewards.worker import Scorer
from sealrl.seams.host import HostLostError, ProcessHost

_CLOSE_GRACE_S = 1.0  # how long close() lets idle workers exit before SIGKILL


@dataclass(eq=False)
class _Worker:
    host: ProcessHost
    request: list[RewardSample] | None = None
    deadline: float = math.inf


class RewardPool:
    """Scores RewardSamples with `fn` in `num_scorers` processes (0 = inline), see module doc."""

    def __init__(self, fn: RewardFunction, num_scorers: int = 2, timeout_s: float = 5.0,
                 startup_timeout_s: float = 60.0, memory_mb: int = 0) -> None:
        """`memory_mb`: each scorer process's address-space limit (RLIMIT_AS; 0 = none): an
        allocation past it fails inside the scorer, which becomes that sample's error record."""
        if not isinstance(fn, RewardFunction):
            raise TypeError(f"RewardPool: {fn!r} is not a RewardFunction (needs name, version, "
                            "__call__)")
        if num_scorers < 0:
            raise ValueError(f"RewardPool.num_scorers must be >= 0 (0 = inline), got {num_scorers}")
        if not timeout_s > 0 or not startup_timeout_s > 0:
            raise ValueError(f"RewardPool: timeout_s and startup_timeout_s must be > 0, got "
                             f"{timeout_s} and {startup_timeout_s}")
        self.fn = fn
        self.num_scorers = num_scorers
        self.timeout_s = float(timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.memory_mb = int(memory_mb)
        self._scorers: list[_Worker] = []
        self._closed = False
        self._streaming = False   # a ScoreStream is open: its requests hold the workers
        # Replies refused: for no request the worker holds, or not from the worker's own process
        # (a scorer that forked). Counted, never joined (reward/stray_replies).
        self.stray_replies = 0
        self.scored_by: dict[str, int] = {}   # sample id -> pid of the scorer process that answered
        # Kills the workers if the pool is dropped without close(); holds the list, not self.
        self._finalizer = weakref.finalize(self, _shutdown, self._scorers)
        if num_scorers == 0:
            setup = getattr(fn, "setup", None)
            if setup is not None:
                setup()
            return
        try:
            pickle.dumps(fn)
        except Exception as e:
            raise TypeError(f"RewardPool: scorer {fn.name!r} cannot be pickled for worker "
                            f"processes ({type(e).__name__}: {e}); define it at module level or "
                            "use num_scorers=0") from e
        self._scorers.extend(self._spawn() for _ in range(num_scorers))
        self._run(deque(), {}, until_ready=True)

    # -- public -------------------------------------------------------------------------------

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (empty inline or after close)."""
        return [w.host.pid for w in self._scorers]

    def take_scored(self) -> tuple[dict[str, int], int]:
        """(sample id -> pid of the scorer process whose reply was joined, stray replies refused)
        since the last take (then forgotten); nothing inline."""
        scored, stray = self.scored_by, self.stray_replies
        self.scored_by, self.stray_replies = {}, 0
        return scored, stray

    def score(self, samples: Iterable[RewardSample]) -> list[RewardRecord]:
        """One RewardRecord per sample, in input order; sample ids must be unique."""
        if self._closed:
            raise RuntimeError("RewardPool.score after close()")
        if self._streaming:
            raise RuntimeError("RewardPool.score while a ScoreStream is open (finish it first)")
        samples = list(samples)
        _check_samples(samples, set())
        if not samples:
            return []
        if self.num_scorers == 0:
            return [self._record(o) for o in score_raw(self.fn, samples)]
        results: dict[str, RewardRecord] = {}
        try:
            self._run(deque(self._requests(samples)), results, until_ready=False)
        except BaseException:
            # e.g. KeyboardInterrupt: requests are still in flight and their late answers must
            # never be joined into a later batch (a retry reuses the sample id), so stop here.
            self.close()
            raise
        return [results[s.sample_id] for s in samples]

    def stream(self) -> "ScoreStream":
        """Score samples as they are handed in, while the caller goes on producing them."""
        if self._closed:
            raise RuntimeError("RewardPool.stream after close()")
        if self._streaming:
            raise RuntimeError("RewardPool.stream: a ScoreStream is already open")
        return ScoreStream(self)

    def close(self) -> None:
        """Stop every worker (SIGKILL after a short grace); idempotent."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- scheduling ---------------------------------------------------------------------------

    def _requests(self, samples: list[RewardSample]) -> list[list[RewardSample]]:
        if isinstance(self.fn, BatchRewardFunction):  # one chunk per worker
            size = -(-len(samples) // self.num_scorers)
            return [samples[i:i + size] for i in range(0, len(samples), size)]
        return [[s] for s in samples]

    def _run(self, requests: deque[list[RewardSample]], results: dict[str, RewardRecord],
             until_ready: bool) -> None:
        """Dispatch `requests` to ready workers and collect until all are answered."""
        while self._pump(requests, results, until_ready, block=True):
            pass

    def _pump(self, requests: deque[list[RewardSample]], results: dict[str, RewardRecord],
              until_ready: bool, block: bool) -> bool:
        """One round: dispatch to idle workers, collect what answered, enforce deadlines; False
        when nothing is left to wait for. `block`: wait on every busy or booting worker's pipe,
        waking at the earliest deadline; else only take what is there (a ScoreStream's poll).
        A busy worker past its deadline is killed and its request recorded as timeout.
        """
        for w in self._scorers:
            if requests and w.host.ready and w.request is None:
                self._dispatch(w, requests)
        busy = [w for w in self._scorers if w.request is not None]
        booting = [w for w in self._scorers if not w.host.ready]
        if not busy and not requests and not (until_ready and booting):
            return False
        deadlines = [w.deadline for w in busy]
        deadlines += [w.host.started + self.startup_timeout_s for w in booting]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if block else 0.0
        by_conn = {w.host.connection(): w for w in busy + booting}
        for conn in wait(list(by_conn), timeout):
            self._receive(by_conn[conn], requests, results)
        now = time.monotonic()
        for w in list(self._scorers):
            if w.request is not None and w.deadline <= now:
                detail = (f"no result within the {self.timeout_s:g} s deadline"
                          f"{_batch_note(w.request)}; worker pid {w.host.pid} killed")
                self._fail(w, RewardStatus.TIMEOUT, detail, results)
                self._replace(w)
            elif not w.host.ready and w.host.started + self.startup_timeout_s <= now:
                self._broken(f"a worker did not start within {self.startup_timeout_s:g} s")
        return True

    def _dispatch(self, w: _Worker, requests: deque[list[RewardSample]]) -> None:
        request = requests.popleft()
        try:
            w.host.submit("score", request)
        except HostLostError:  # it died while idle: the request never reached it
            requests.appendleft(request)
            self._replace(w)
            return
        w.request, w.deadline = request, time.monotonic() + self.timeout_s

    def _receive(self, w: _Worker, requests: deque[list[RewardSample]],
                 results: dict[str, RewardRecord]) -> None:
        try:
            kind, payload = w.host.receive()
        except HostLostError as e:
            if e.kind == "start":
                hint = ("; a scorer defined in the driver's __main__ cannot be imported by a worker, "
                        "move it to a module") if "__main__" in e.reason else ""
                self._broken(f"a worker {e.reason}{hint}")
            if e.kind == "exited" and not w.host.ready:
                self._broken(f"a worker exited during start-up (exit code {w.host.exitcode()})")
            if e.kind == "stray":
                # Refused and counted: a reply that is not the held request's answer from the
                # worker's own process means another process writes to its pipe (a scorer that
                # forked). What it holds can no longer be trusted: its request becomes an error.
                self.stray_replies += 1
                detail = (f"worker pid {w.host.served_by} sent a reply for a request it does not hold (stray "
                          f"reply refused; did the scorer fork?){_batch_note(w.request or ())}")
            else:   # the process exited or was killed from outside
                detail = f"worker pid {w.host.pid} died (exit code {w.host.exitcode()}){_batch_note(w.request or ())}"
            self._fail(w, RewardStatus.ERROR, detail, results)
            self._replace(w)
            return
        if kind == "ok":
            self._join(w, payload, results)
        elif kind == "error":   # the scoring loop itself failed (score_raw catches the scorer's errors)
            self._fail(w, RewardStatus.ERROR, f"worker pid {w.host.pid}: {payload}", results)

    def _join(self, w: _Worker, payload: tuple, results: dict[str, RewardRecord]) -> None:
        """Join a reply (sample ids, outcomes) to the request `w` holds (the host checked that it
        answers that request, from `w`'s own process)."""
        ids, outcomes = payload
        if list(ids) != [s.sample_id for s in w.request] or len(outcomes) != len(ids):
            raise RuntimeError(f"RewardPool: worker pid {w.host.pid} answered samples {list(ids)[:4]} for "
                               f"{[s.sample_id for s in w.request][:4]}")
        for sample, outcome in zip(w.request, outcomes):
            results[sample.sample_id] = self._record(outcome)
            self.scored_by[sample.sample_id] = w.host.served_by
        w.request, w.deadline = None, math.inf

    def _fail(self, w: _Worker, status: RewardStatus, detail: str,
              results: dict[str, RewardRecord]) -> None:
        name, version = self.fn.name, self.fn.version
        for sample in w.request or ():
            message = failure_message(name, version, sample.sample_id, detail)
            results[sample.sample_id] = RewardRecord.failure(status, name, message, version)
        w.request, w.deadline = None, math.inf

    def _record(self, outcome: Outcome) -> RewardRecord:
        name, version = self.fn.name, self.fn.version
        if isinstance(outcome, str):
            return RewardRecord.failure(RewardStatus.ERROR, name, outcome, version)
        total, components = outcome
        return RewardRecord.success(total, name, version, components)

    def _spawn(self) -> _Worker:
        """A fresh worker, booting (it takes work once its ready answer is received). What the
        scorer prints goes to stderr: the driver's stdout stays its own (a final JSON line)."""
        return _Worker(ProcessHost("reward scorer", functools.partial(Scorer, self.fn), output="stderr",
                                   memory_mb=self.memory_mb, startup_timeout_s=self.startup_timeout_s,
                                   wait_ready=False))

    def _replace(self, w: _Worker) -> None:
        self._scorers[self._scorers.index(w)] = _Worker(w.host.respawn(wait_ready=False))

    def _broken(self, reason: str) -> None:
        self.close()
        raise RuntimeError(f"RewardPool for scorer {self.fn.name!r} is broken and closed: {reason}")


class ScoreStream:
    """Samples handed to the pool while their producer goes on (RewardPool.stream): `add`
    dispatches them to idle workers and takes whatever answers are there, without waiting;
    `finish` waits for the rest and returns one record per sample added, in the order added.

    The records are those score() gives the same samples: each is scored alone by the same
    worker code, under the same deadline counted from its dispatch (a deadline passes only
    while the caller is between two calls if the worker really has not answered: an answer
    waiting in its pipe is taken before deadlines are checked). Only scorer processes stream;
    inline (num_scorers=0) and batch scorers (a reward model, whose chunks and padding must be
    score()'s) score everything in finish(), as score() would.
    While a stream is open the pool refuses score() and stream(): answers join by sample id.
    """

    def __init__(self, pool: RewardPool) -> None:
        self.pool = pool
        self.live = pool.num_scorers > 0 and not isinstance(pool.fn, BatchRewardFunction)
        self._samples: dict[str, RewardSample] = {}
        self._requests: deque[list[RewardSample]] = deque()
        self._results: dict[str, RewardRecord] = {}
        pool._streaming = True

    def add(self, samples: Iterable[RewardSample]) -> None:
        """Hand in more samples (none: only take answers and dispatch waiting samples)."""
        samples = list(samples)
        _check_samples(samples, self._samples.keys())
        self._samples.update((s.sample_id, s) for s in samples)
        if self.live:
            self._requests.extend([s] for s in samples)
            self._guarded(lambda: self.pool._pump(self._requests, self._results, until_ready=False,
                                                  block=False))

    def finish(self) -> dict[str, RewardRecord]:
        """Wait for every sample added; its record by sample id. The pool is free again."""
        try:
            if not self.live:
                self.pool._streaming = False
                samples = list(self._samples.values())
                return dict(zip(self._samples, self.pool.score(samples), strict=True))
            self._guarded(lambda: self.pool._run(self._requests, self._results, until_ready=False))
            return {i: self._results[i] for i in self._samples}
        finally:
            self.pool._streaming = False

    def _guarded(self, call) -> None:
        try:
            call()
        except BaseException:
            # as in score(): requests in flight must never be joined into a later batch
            self.pool._streaming = False
            self.pool.close()
            raise


def _check_samples(samples: list[RewardSample], ids) -> None:
    """RewardSamples with sample ids unique among themselves and not in `ids`."""
    seen = set()
    for s in samples:
        if not isinstance(s, RewardSample):
            raise TypeError(f"RewardPool.score expects RewardSample, got {type(s).__name__}")
        if s.sample_id in seen or s.sample_id in ids:
            raise ValueError(f"RewardPool.score: duplicate sample_id {s.sample_id!r}")
        seen.add(s.sample_id)


def _batch_note(request: Sequence[RewardSample]) -> str:
    return f" (request of {len(request)} samples)" if len(request) > 1 else ""


def _shutdown(workers: list[_Worker]) -> None:
    """Ask idle workers to exit, SIGKILL whatever is left after a grace period, reap all."""
    idle = [w for w in workers if w.host.ready and w.request is None]
    for w in idle:
        try:
            w.host.connection().send(None)
        except OSError:
            pass
    end = time.monotonic() + _CLOSE_GRACE_S
    for w in idle:
        w.host.exitcode(wait_s=max(0.0, end - time.monotonic()))
    for w in workers:
        w.host.kill()
        w.host.close(grace_s=0.0)
    workers.clear()
