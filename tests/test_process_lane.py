"""rollout.lane=process: generation in its own process (a rollout pool of one worker on a
process host: placement/process_group.py, trainer/variants/process_lane.py). The fixed-lag
schedule is the thread lane's, so a run is bitwise the same (k = 1; and k = 0 through the lane is
the synchronous run); weights reach the process through the verified sync and load while it
samples; a process that dies is replaced and the run goes on bitwise; one that hangs, or cannot
be replaced, is a named error, never a wait without end."""
import functools
import json
import os
import threading
import time

import pytest

from sealrl.audit import audit_run
from sealrl.config import ConfigError, build_config, check_config
from sealrl.experience import SamplingContract
from sealrl.experience.wire import GenerationRequest
from sealrl.placement.process_group import ProcessWorkerGroup
from sealrl.placement.rollout_pool import RolloutPool
from sealrl.placement.workers import WorkerError
from sealrl.roles.rollout import Rollout
from sealrl.seams import host
from sealrl.seams.host import HostLostError
from sealrl.sync.manifest import WeightSyncError, build_manifest
from sealrl.trainer import driver as driver_module
from sealrl.trainer import pipeline as pipeline_module
from sealrl.trainer import setup as trainer_setup
from tests.test_pipeline import _closing, _files, _numbers, _train

ASYNC = ["algorithm.old_log_prob=recompute", "algorithm.correction=token_is"]


class SlowRollout(Rollout):
    """Sleeps before each generate call, in the generation process only (evaluation here is fast)."""

    def __init__(self, *args, delay: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.delay = delay

    def set_delay(self, delay: float) -> None:
        self.delay = delay

    def generate(self, *args, **kwargs):
        if host.HOSTED:
            time.sleep(self.delay)
        return super().generate(*args, **kwargs)


class DyingRollout(Rollout):
    """In a generation process, exits with code 7 at its SEALRL_TEST_DIE_AT-th generate call; with
    SEALRL_TEST_DIED (a file) set, it leaves that file behind and no later process starts."""
    calls = 0

    def __init__(self, *args, **kwargs):
        marker = os.environ.get("SEALRL_TEST_DIED")
        if host.HOSTED and marker and os.path.exists(marker):
            raise RuntimeError("a generation process died before: this one refuses to start")
        super().__init__(*args, **kwargs)

    def generate(self, *args, **kwargs):
        if host.HOSTED:
            DyingRollout.calls += 1
            if DyingRollout.calls == int(os.environ["SEALRL_TEST_DIE_AT"]):
                if os.environ.get("SEALRL_TEST_DIED"):
                    open(os.environ["SEALRL_TEST_DIED"], "w").close()
                os._exit(7)
        return super().generate(*args, **kwargs)


# ---- bitwise the thread lane ----------------------------------------------------------------

@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_k1_in_its_own_process_is_bitwise_the_thread_lane(tmp_path, lora):
    """With LoRA the process pins the base once (over the weights pipe, verified there) and each
    version sends only the adapter."""
    extra = ["rollout.max_staleness=1", *ASYNC, *(["actor.lora.rank=4", "actor.lora.alpha=8"] if lora else [])]
    thread, thread_run = _train(tmp_path / "thread", "k1", *extra)
    proc, proc_run = _train(tmp_path / "process", "k1", "rollout.lane=process", *extra)
    assert proc["weights_hash"] == thread["weights_hash"]
    assert proc["optimizer_steps"] == thread["optimizer_steps"] == 4
    assert _files(proc_run) == _files(thread_run)          # the same sealed experience, iteration by iteration
    assert _numbers(proc_run) == _numbers(thread_run)
    assert proc["accuracy_after"] == thread["accuracy_after"]   # evaluated here, at the last published version
    report = audit_run(proc_run)
    assert report.ok, report.summary()
    events = json.loads((proc_run / "trace.json").read_text())["traceEvents"]
    workers = {e["args"]["worker"] for e in events if e["ph"] == "X" and e["name"] == "generate"}
    assert len(workers) == 1 and workers.pop().endswith("(generation process)")   # not this process


def test_k0_through_the_process_lane_is_bitwise_the_synchronous_run(tmp_path, monkeypatch):
    sync, sync_run = _train(tmp_path / "sync", "k0")

    def threaded(run, start, end, version, recalled=None, schedule=None):
        return _closing(pipeline_module.Pipeline(run, start, end, version, threaded=True,
                                                 recalled=recalled or {}, schedule=schedule))
    monkeypatch.setattr(driver_module, "pipeline", threaded)
    proc, proc_run = _train(tmp_path / "proc", "k0", "rollout.lane=process")
    assert proc["weights_hash"] == sync["weights_hash"]
    assert _files(proc_run) == _files(sync_run)
    assert _numbers(proc_run) == _numbers(sync_run)


# ---- failures are named ---------------------------------------------------------------------

def test_a_generation_process_that_dies_is_replaced_and_the_run_is_bitwise_the_thread_lane(tmp_path, monkeypatch):
    args = ("rollout.max_staleness=1", "run.iterations=6", *ASYNC)
    thread, thread_run = _train(tmp_path / "thread", "dies", *args)
    monkeypatch.setattr(trainer_setup, "Rollout", DyingRollout)
    monkeypatch.setenv("SEALRL_TEST_DIE_AT", "3")   # each process dies at its third generate call
    proc, proc_run = _train(tmp_path / "proc", "dies", "rollout.lane=process", *args)
    assert proc["weights_hash"] == thread["weights_hash"]
    assert _files(proc_run) == _files(thread_run)   # the same sealed experience, iteration by iteration
    replaced = sum(json.loads(x).get("rollout/replica_replacements", 0.0)
                   for x in (proc_run / "metrics.jsonl").read_text().splitlines())
    assert replaced >= 1
    assert audit_run(proc_run).ok


def test_a_generation_process_that_cannot_be_replaced_is_a_named_error_in_the_training_lane(tmp_path,
                                                                                              monkeypatch):
    monkeypatch.setattr(trainer_setup, "Rollout", DyingRollout)
    monkeypatch.setenv("SEALRL_TEST_DIE_AT", "4")   # evaluation, iterations 0 and 1 generate, iteration 2 kills it
    monkeypatch.setenv("SEALRL_TEST_DIED", str(tmp_path / "died"))   # and no replacement starts
    t0 = time.perf_counter()
    with pytest.raises(HostLostError, match=r"rollout worker 0 \(pid \d+\) could not start: RuntimeError: a "
                                            r"generation process died before") as e:
        _train(tmp_path, "dies", "rollout.max_staleness=1", "rollout.lane=process", "run.iterations=6", *ASYNC)
    assert e.value.kind == "start"   # the replacement of the process that died
    assert time.perf_counter() - t0 < 180   # raised, not waited on
    ledger = (tmp_path / "dies" / "ledger.jsonl").read_text()
    assert '"iteration": 1' in ledger and '"iteration": 2' not in ledger   # nothing of the iteration it died in


@pytest.fixture(scope="module")
def weights(tiny_model_dir):
    from sealrl.models.hf import load_causal_lm
    model, tok = load_causal_lm(tiny_model_dir)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return model, tok, state


REQ = [GenerationRequest("r/0/p", (1, 2, 3), 7, (0, 1))]
CONTRACT = SamplingContract(max_new_tokens=3)


def _pool(factory, timeout_s: float, max_replacements: int = 1) -> RolloutPool:
    return RolloutPool(ProcessWorkerGroup("rollout", factory, 1, timeout_s=timeout_s), timeout_s=timeout_s,
                       max_replacements=max_replacements)


@pytest.fixture(scope="module")
def proc(weights):
    model, tok, _ = weights
    p = _pool(functools.partial(SlowRollout, model, tok), timeout_s=60)
    p.retain(2)
    yield p
    p.close()


def test_the_process_verifies_every_checksum_and_activates_nothing_on_a_bad_tensor(weights, proc):
    model, tok, state = weights
    here = Rollout(model, tok)
    v0 = proc.load(state, build_manifest(state, "r", 0, 0, "", ""))
    assert proc.generate(REQ, CONTRACT, v0) == here.generate(REQ, CONTRACT, here.load(state, build_manifest(
        state, "r", 0, 0, "", "")))   # the same samples as in this process, bit for bit
    name = next(iter(state))
    bad = dict(state, **{name: state[name] + 1})
    with pytest.raises(WorkerError) as e:
        proc.load(bad, build_manifest(state, "r", 1, 0, "", ""))   # the manifest of the true weights
    assert isinstance(e.value.cause, WeightSyncError) and e.value.cause.tensor == name and not e.value.lost
    assert proc.version == v0 and proc.group.actors[0].lost is None   # still serving v0
    assert len(proc.generate(REQ, CONTRACT, v0)) == 2


def test_a_publication_loads_while_the_process_samples_with_the_retained_version(weights, proc):
    """Double buffering: the load of v1 returns while a generate call from v0 is still running
    in the process, and that call's samples are v0's."""
    model, tok, state = weights
    proc.retain(2)
    proc.group.call("set_delay", 3.0)
    try:
        v0 = proc.load(state, build_manifest(state, "r", 0, 0, "", ""))
        out, done = {}, {}

        def sample():
            out["samples"] = proc.generate(REQ, CONTRACT, v0)
            done["at"] = time.perf_counter()
        lane = threading.Thread(target=sample)
        lane.start()
        time.sleep(0.5)
        newer = {k: v + 0.01 for k, v in state.items()}
        v1 = proc.load(newer, build_manifest(newer, "r", 1, 0, "", ""))
        loaded = time.perf_counter()
        lane.join()
        assert loaded < done["at"]                       # the transfer never waited for the generation
        assert proc.version == v1
        assert {s.policy_version for s in out["samples"]} == {v0}
    finally:
        proc.group.call("set_delay", 0.0)


def test_a_process_past_its_deadline_is_stopped_and_named(weights):
    model, tok, state = weights
    proc = _pool(functools.partial(SlowRollout, model, tok, delay=30.0), timeout_s=6, max_replacements=0)
    try:
        v0 = proc.load(state, build_manifest(state, "r", 0, 0, "", ""))
        t0 = time.perf_counter()
        with pytest.raises(WorkerError, match=r"missed the deadline of 6 s during generate; it was killed") as e:
            proc.generate(REQ, CONTRACT, v0)
        assert e.value.lost and time.perf_counter() - t0 < 20
        with pytest.raises(WorkerError) as again:   # and every later call: the same named loss
            proc.load(state, build_manifest(state, "r", 1, 0, "", ""))
        assert again.value.cause is e.value.cause
    finally:
        proc.close()


def test_a_role_that_cannot_be_built_there_is_raised_here_and_the_process_is_gone():
    # Rollout(None, None): the engine reads model.config
    with pytest.raises(HostLostError, match=r"rollout worker 0 \(pid \d+\) could not start: AttributeError") as e:
        _pool(functools.partial(Rollout, None, None), timeout_s=60)
    assert e.value.kind == "start" and isinstance(e.value.__cause__, AttributeError)
    with pytest.raises(ProcessLookupError):   # killed and reaped
        os.kill(e.value.pid, 0)


def test_config_names_the_lane():
    with pytest.raises(ConfigError, match="rollout.lane"):
        build_config(None, ["rollout.lane=ray"])
    lane = ["rollout.lane=process", "rollout.max_staleness=1", "algorithm.correction=token_is"]
    # the process client declares every capability: the base is pinned there, finished rows stream back
    check_config(build_config(None, [*lane, "actor.lora.rank=4", "reward.stream=true", "reward.num_scorers=1"]))
    # on Ray the replicas are the generation processes already: the lane drives them (feature matrix)
    check_config(build_config(None, [*lane, "placement.backend=ray"]))
    # at max_staleness 0 there is no generation lane: the in-process engine generates, with LoRA
    check_config(build_config(None, ["rollout.lane=process", "actor.lora.rank=4"]))
