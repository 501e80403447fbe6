"""The rollout seam's conformance suite (seams/rollout.py, DESIGN section 11): every rollout
client runs the same cases.

- the same requests and seeds give the same records as the in-process engine (tokens, stop
  reasons, seeds, versions exactly; log-probs within 1e-5, since a remote host may run another
  number of torch threads);
- a corrupted version (one checksum wrong) activates nothing, the previous version keeps
  serving, and the error names the tensor;
- a declared capability works, and one not declared is refused by MissingCapability; a test
  checks that every capability has a case here;
- a lost host (a process or replica killed) is named by a clear error (a pool first replaces
  it and serves the same records).

A client plugs in with one Factory in FACTORIES (a future vLLM backend: one more entry; its
capabilities are its CLIENTS row). The Ray pool (2 replicas, one Ray session for the module)
is marked slow; the generation process takes a few seconds to start.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from sealrl.experience.records import SamplingContract
from sealrl.experience.wire import RolloutSample
from sealrl.models.lora import adapter_scaling, adapter_state, apply_lora, base_state
from sealrl.roles.rollout import Rollout
from sealrl.rollout import RolloutEngine, kv_meter
from sealrl.rollout.episodes import EpisodeSpec
from sealrl.seams.host import HostLostError
from sealrl.seams.rollout import CLIENTS, Capabilities, MissingCapability, missing_members
from sealrl.sync.adapter import build_adapter_manifest
from sealrl.sync.manifest import WeightSyncError, build_manifest
from tests.harness import local_ray
from tests.test_lora import LORA
from tests.test_placement_ray import setup_objects

CONTRACT = SamplingContract(temperature=1.0, max_new_tokens=6, n=3)
TENSOR = "model.layers.1.mlp.down_proj.weight"


@dataclass(frozen=True)
class Factory:
    """How the suite makes and loses one kind of client."""

    kind: str                                    # its CLIENTS row
    make: Callable                               # (request, model, tokenizer, **Rollout kwargs) -> client
    kill: Callable | None = None                 # (client) -> None: its host dies; None: no host to lose
    lost: Callable | None = None                 # (client, requests, version, want) -> None: the named error


def _engine(request, model, tok, **kw):
    return Rollout(model, tok, **kw)


def _process(request, model, tok, **kw):
    from sealrl.placement.process_group import ProcessWorkerGroup
    from sealrl.placement.rollout_pool import RolloutPool
    group = ProcessWorkerGroup("rollout", functools.partial(Rollout, model, tok, **kw), 1, timeout_s=120)
    return RolloutPool(group, timeout_s=120)   # as trainer/variants/process_lane.py builds it


def _kill_process(client) -> None:
    host = client.group.actors[0]
    os.kill(host.pid, signal.SIGKILL)
    host.exitcode(wait_s=30)


def _process_lost(client, requests, version, want) -> None:
    from sealrl.placement.workers import WorkerError
    pid = client.group.pids[0]
    client.max_replacements = 0
    died = rf"rollout worker 0 \(pid {pid}\) exited with code -9 (before|during) generate"
    with pytest.raises(WorkerError, match=died) as e:
        client.generate(requests, CONTRACT, version)
    assert e.value.lost and isinstance(e.value.cause, HostLostError)
    client.max_replacements = 1   # the pool replaces it: a fresh process, the active version verified
    assert_same_records(client.generate(requests, CONTRACT, version), want)
    assert len(client.take_recoveries()) == 1 and client.group.pids[0] != pid


def _ray_pool(request, model, tok, **kw):
    from sealrl.placement.rollout_pool import RolloutPool
    from sealrl.placement.workers import RayWorkerGroup
    pool = request.getfixturevalue("ray_session")
    group = RayWorkerGroup("rollout", functools.partial(Rollout, model, tok, **kw), pool, timeout_s=120,
                           concurrency=2)   # as trainer/setup.py builds it: stage while generating
    return RolloutPool(group, timeout_s=120)


def _kill_replica(client) -> None:
    import ray
    ray.kill(client.group.actors[0], no_restart=True)


def _pool_lost(client, requests, version, want) -> None:
    from sealrl.placement.workers import WorkerError
    client.max_replacements = 0
    with pytest.raises(WorkerError, match="role rollout worker 0: generate") as e:
        client.generate(requests, CONTRACT, version)
    assert e.value.lost
    client.max_replacements = 1   # a pool replaces a lost replica: a fresh one, the active version verified
    assert_same_records(client.generate(requests, CONTRACT, version), want)
    assert len(client.take_recoveries()) == 1 and ("replace 0", version.id) in client.history


FACTORIES = [
    pytest.param(Factory("engine", _engine), id="engine"),
    pytest.param(Factory("process", _process, _kill_process, _process_lost), id="process"),
    pytest.param(Factory("ray_pool", _ray_pool, _kill_replica, _pool_lost), id="ray_pool", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def ray_session():
    """The process's shared local Ray (tests/harness.py) and a resource pool for 2 replicas, for
    the module; each bundle holds two replicas (the roles of a colocated pool split it), the
    module's client and one more."""
    from sealrl.placement.workers import RayPool, pools_from_config
    local_ray()
    pool = RayPool(pools_from_config({"train": {"roles": ["actor", "rollout"], "num_workers": 2,
                                                "num_cpus_per_worker": 0.5}})["rollout"])
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def objects():
    return setup_objects()   # tiny model, tokenizer, (state, manifest) of v0 and v1, 6 requests of 3


def reference(model, tok, state, manifest, requests, contract=CONTRACT, **kw) -> list[RolloutSample]:
    """The in-process engine's records: what every client must give."""
    engine = RolloutEngine(model, tok)
    engine.max_rows, engine.continuous = kw.get("rows", (0, False))
    engine.load_weights(state, manifest)
    return engine.generate(requests, contract, manifest.version)


def assert_same_records(got: list[RolloutSample], want: list[RolloutSample]) -> None:
    assert [s.sample_id for s in got] == [s.sample_id for s in want]
    for a, b in zip(got, want):
        plain = dict(rollout_log_probs=(), filtered_log_probs=None)
        assert dataclasses.replace(a, **plain) == dataclasses.replace(b, **plain), a.sample_id
        assert torch.allclose(torch.tensor(a.rollout_log_probs), torch.tensor(b.rollout_log_probs),
                              atol=1e-5, rtol=0), a.sample_id


@pytest.fixture(scope="module", params=FACTORIES)
def factory(request):
    return request.param


@pytest.fixture(scope="module")
def client(request, factory, objects):
    """One client of each kind for the non-destructive cases (each loads what it needs)."""
    made = factory.make(request, objects[0], objects[1])
    yield made
    made.close()


@pytest.fixture()
def fresh(request, factory, objects):
    """Clients made for one case (other construction, or a host to kill), closed after it."""
    made = []

    def make(**kw):
        made.append(factory.make(request, objects[0], objects[1], **kw))
        return made[-1]
    yield make
    for c in made:
        c.close()


# ---- the protocol --------------------------------------------------------------------------

def test_the_client_meets_the_protocol_and_declares_its_row(client, factory):
    assert missing_members(client) == []
    assert client.capabilities == CLIENTS[factory.kind].capabilities


def test_same_requests_and_seeds_give_the_same_records(client, objects):
    model, tok, (state, v0), _, requests = objects
    assert client.load(state, v0) == v0.version and client.version == v0.version
    assert client.backend == ("LeanBackend", "float32")
    assert_same_records(client.generate(requests, CONTRACT, v0.version), reference(model, tok, state, v0, requests))
    assert_same_records(client.generate(requests[::-1], CONTRACT, v0.version),   # another order, same records
                        reference(model, tok, state, v0, requests[::-1]))


def test_the_kv_cache_take_is_the_calls_since_the_last(client, factory, objects):
    """take_engine_stats (rollout/kv_meter.py) after a generate call: a process host reports what
    the same call gives in this one; a pool of 2 its larger replica's, no more; the peak lies
    between one prompt's cache and every prompt's plus two copies of every row's (a fan-out or a
    compaction holds old and new at once), the filled share between the prompts' and all."""
    model, tok, (state, v0), _, requests = objects
    kv_meter.METER.take()
    reference(model, tok, state, v0, requests)
    want = kv_meter.METER.take()   # the in-process engine's, for the same call
    client.load(state, v0)
    client.take_engine_stats()     # forget the calls before
    client.generate(requests, CONTRACT, v0.version)
    got = client.take_engine_stats()
    cfg = model.config
    column = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    widths = [len(r.prompt_ids) for r in requests]
    rows, prompts = sum(len(r.candidates) for r in requests), len({r.prompt_ids for r in requests})
    t_max = max(widths) + CONTRACT.max_new_tokens - 1
    assert column * (min(widths) + CONTRACT.max_new_tokens - 1) <= got["kv_peak_gb"] * 2**30 \
        <= column * t_max * (prompts + 2 * rows)
    assert min(widths) / t_max <= got["kv_use"] <= 1
    if factory.kind == "ray_pool":
        assert got["kv_peak_gb"] <= want["kv_peak_gb"]   # each replica decodes a share of the rows
    else:
        assert got == want
    assert client.take_engine_stats() == {}   # nothing since


def test_a_corrupted_version_activates_nothing_and_the_previous_keeps_serving(client, objects):
    model, tok, (state, v0), (state1, v1), requests = objects
    client.load(state, v0)
    bad = dict(state1)
    bad[TENSOR] = state1[TENSOR].clone()
    bad[TENSOR][0, 0] += 1e-3   # one tensor changed after its manifest was built
    with pytest.raises(Exception, match=TENSOR) as e:
        client.load(bad, v1)
    cause = getattr(e.value, "cause", None) or e.value   # a pool's WorkerError carries the replica's error
    assert type(cause) is WeightSyncError and cause.tensor == TENSOR
    assert client.version == v0.version
    assert_same_records(client.generate(requests[:2], CONTRACT, v0.version),
                        reference(model, tok, state, v0, requests[:2]))
    assert client.load(state1, v1) == v1.version   # the intact version loads


def test_a_lost_host_is_named(factory, fresh, objects):
    if factory.kill is None:
        assert factory.kind == "engine"   # the in-process engine's host is this process
        return
    model, tok, (state, v0), _, requests = objects
    client = fresh()
    client.load(state, v0)
    factory.kill(client)
    factory.lost(client, requests[:3], v0.version, reference(model, tok, state, v0, requests[:3]))


@pytest.mark.slow
def test_a_replaced_replica_serves_the_retained_versions(request, objects):
    """Ray pool, retain(2): replica 0 dies; its replacement retains 2 and loads v0 then v1,
    verified, so a call under the retained v0 is served with the same records."""
    model, tok, (state, v0), (state1, v1), requests = objects
    client = _ray_pool(request, model, tok)
    try:
        client.retain(2)
        client.load(state, v0)
        client.load(state1, v1)
        _kill_replica(client)
        assert_same_records(client.generate(requests, CONTRACT, v0.version), reference(model, tok, state, v0, requests))
        assert len(client.take_recoveries()) == 1 and client.group.attr("version") == [v1.version, v1.version]
        assert_same_records(client.generate(requests, CONTRACT, v1.version),
                            reference(model, tok, state1, v1, requests))
    finally:
        client.close()


# ---- one case per capability: exercised where declared, refused where not -------------------

def _streams(client, fresh, objects) -> None:
    model, tok, (state, v0), _, requests = objects
    client.load(state, v0)
    streamed = []
    got = client.generate(requests, CONTRACT, v0.version, stream=streamed.extend)
    assert sorted(s.sample_id for s in streamed) == sorted(s.sample_id for s in got)   # each once
    assert {s.sample_id: s for s in streamed} == {s.sample_id: s for s in got}


def _switches(client, fresh, objects) -> None:
    """A replay's plan: token 2 on, the rows still running are sampled by v1 (both held)."""
    model, tok, (state, v0), (state1, v1), requests = objects
    client.retain(2)
    client.load(state, v0)
    client.load(state1, v1)
    try:
        got = client.generate_switching(requests, CONTRACT, v0.version, {2: v1.version})
    finally:
        client.retain(1)
    before = reference(model, tok, state, v0, requests)
    ran_on = [s for s in got if len(s.response_ids) > 2]
    assert ran_on and all(s.segments == ((0, v0.version), (2, v1.version)) for s in ran_on)
    for s, b in zip(got, before):   # the first two tokens are v0's own
        assert s.response_ids[:2] == b.response_ids[:2]


def _multi_turn(client, fresh, objects) -> None:
    model, tok, (state, v0), _, requests = objects
    spec = EpisodeSpec("guess", max_turns=3, max_tokens=12)
    c = fresh(episodes=spec)
    row = {"prompt_id": "p0", "text": "guess", "ground_truth": "7", "data_source": "guess"}
    reqs = [dataclasses.replace(r, env_input=json.dumps(row, sort_keys=True)) for r in requests[:2]]
    c.load(state, v0)
    got = c.generate(reqs, CONTRACT, v0.version)
    local = Rollout(model, tok, episodes=spec)
    local.load(state, v0)
    try:
        assert_same_records(got, local.generate(reqs, CONTRACT, v0.version))
    finally:
        local.close()
    assert all(s.episode is not None and s.episode.env.startswith("guess") for s in got)


def _bounded_rows(client, fresh, objects) -> None:
    """At most 4 rows at once (18 asked): the records of the unbounded engine, in waves."""
    model, tok, (state, v0), _, requests = objects
    c = fresh(rows=(4, False))
    c.load(state, v0)
    assert_same_records(c.generate(requests, CONTRACT, v0.version), reference(model, tok, state, v0, requests))


def _retained(client, fresh, objects) -> None:
    model, tok, (state, v0), (state1, v1), requests = objects
    client.retain(2)
    try:
        client.load(state, v0)
        client.load(state1, v1)   # v1 active, v0 retained: both serve
        assert client.version == v1.version
        assert_same_records(client.generate(requests[:2], CONTRACT, v0.version),
                            reference(model, tok, state, v0, requests[:2]))
        assert_same_records(client.generate(requests[:2], CONTRACT, v1.version),
                            reference(model, tok, state1, v1, requests[:2]))
    finally:
        client.retain(1)


def _loads_while_generating(client, fresh, objects) -> None:
    """The training lane publishes v1 while the generation lane samples under v0 (retained):
    both calls finish, the samples are v0's own records, v1 is then active."""
    import threading
    model, tok, (state, v0), (state1, v1), requests = objects
    client.retain(2)
    client.load(state, v0)
    out: dict = {}
    big = [dataclasses.replace(r, candidates=tuple(range(8))) for r in requests]   # a longer call
    lane = threading.Thread(target=lambda: out.update(got=client.generate(big, CONTRACT, v0.version)))
    try:
        lane.start()
        assert client.load(state1, v1) == v1.version
        lane.join(timeout=120)
        assert not lane.is_alive()
    finally:
        client.retain(1)
    assert_same_records(out["got"], reference(model, tok, state, v0, big))
    assert client.version == v1.version


def _lora(client, fresh, objects) -> None:
    """Pin the frozen base, then load a version that is only an adapter: it serves base + B A."""
    model, tok, (state, v0), _, requests = objects
    peft = apply_lora(setup_objects()[0], LORA, "actor.lora", seed=1)
    with torch.no_grad():
        for name, t in adapter_state(peft).items():
            if name.endswith("lora_B"):
                t.normal_(0, 0.2, generator=torch.Generator().manual_seed(2))
    base = build_manifest({k: v.detach().clone() for k, v in base_state(peft).items()}, "base", 0, 0,
                          v0.version.tokenizer_hash, v0.version.model_config_hash)
    adapter = {k: v.detach().clone() for k, v in adapter_state(peft).items()}
    manifest = build_adapter_manifest(adapter, adapter_scaling(peft), base.version.weights_hash, "run", 1, 0,
                                      v0.version.tokenizer_hash, v0.version.model_config_hash)
    c = fresh()
    assert c.pin_base(base_state(peft), base) == base.version.weights_hash
    assert c.load(adapter, manifest) == manifest.version
    merged = peft.merge_and_unload()
    full = {k: v.detach().clone() for k, v in merged.state_dict().items()}
    got = c.generate(requests[:2], CONTRACT, manifest.version)
    want = reference(model, tok, full, build_manifest(full, "run", 1, 0, v0.version.tokenizer_hash,
                                                      v0.version.model_config_hash), requests[:2])
    assert [s.response_ids for s in got] == [s.response_ids for s in want]


CASES = {   # capability -> (exercise it, the call that is refused where it is not declared)
    "streams_finished_rows": (_streams, lambda c, o: c.generate(o[4], CONTRACT, o[2][1].version, stream=print)),
    "switches_versions": (_switches, lambda c, o: c.generate_switching(o[4], CONTRACT, o[2][1].version, {})),
    "multi_turn": (_multi_turn, None),          # chosen at construction (EpisodeSpec): no call to refuse
    "bounded_rows": (_bounded_rows, None),      # chosen at construction (rows)
    "retained_versions": (_retained, lambda c, o: c.retain(2)),
    "loads_while_generating": (_loads_while_generating, None),   # a way of calling: the config refuses it
    "lora_adapters": (_lora, lambda c, o: c.pin_base(o[2][0], o[2][1])),
}


def test_every_capability_has_a_case():
    assert set(CASES) == {f.name for f in dataclasses.fields(Capabilities)}


ASYNC = ["rollout.max_staleness=1", "algorithm.correction=token_is"]
FEATURES = {   # capability -> the config that asks for it
    "retained_versions": ASYNC, "loads_while_generating": ASYNC,
    "switches_versions": [*ASYNC, "rollout.partial=switch"],
    "streams_finished_rows": ["reward.stream=true", "reward.num_scorers=1"], "bounded_rows": ["rollout.max_rows=4"],
    "multi_turn": ["env.name=guess"], "lora_adapters": ["actor.lora.rank=4"]}
SELECTORS = {"engine": [], "process": [*ASYNC, "rollout.lane=process"], "ray_pool": ["placement.backend=ray"]}


@pytest.mark.parametrize("capability", list(CASES))
def test_a_declared_capability_works_and_an_undeclared_one_is_refused(capability, client, factory, fresh, objects):
    """Declared: exercised. Not declared: the call is refused by MissingCapability, and a config
    that asks for the feature with this client is refused at load naming the capability."""
    exercise, refused_call = CASES[capability]
    if getattr(client.capabilities, capability):
        exercise(client, fresh, objects)
        return
    if refused_call is not None:
        with pytest.raises(MissingCapability, match=capability):
            refused_call(client, objects)
    from sealrl.config import ConfigError, build_config, check_config
    from sealrl.seams.rollout import requires
    cfg = build_config(None, [*SELECTORS[factory.kind], *FEATURES[capability]])
    first = next(c for _, _, c in requires(cfg) if not getattr(client.capabilities, c))   # async before switch
    with pytest.raises(ConfigError, match=rf"\({first}\); .*{re.escape(CLIENTS[factory.kind].name)}"):
        check_config(cfg)


# ---- the wrappers and the config ----------------------------------------------------------

def test_the_wrappers_pass_the_protocol_and_their_capabilities_through(objects):
    from sealrl.seams.rollout import switching
    from sealrl.trainer.drills import _Clock, _Rollout
    from sealrl.trainer.variants.partial import SwitchingRollout
    model, tok, (state, v0), _, requests = objects
    inner = Rollout(model, tok)
    wrapped = SwitchingRollout(_Rollout(inner, _Clock(0)), None, None)
    assert missing_members(wrapped) == [] and missing_members(wrapped._rollout) == []
    assert wrapped.capabilities == switching(inner.capabilities)
    assert not wrapped.capabilities.multi_turn and wrapped.capabilities.switches_versions
    assert wrapped.load(state, v0) == v0.version == inner.version
    got = wrapped.generate(requests[:2], CONTRACT, v0.version)   # no publication meanwhile: no switch
    want = reference(model, tok, state, v0, requests[:2])
    assert_same_records([dataclasses.replace(s, segments=()) for s in got], want)
    assert all(s.segments == ((0, v0.version),) for s in got)
    streamed = []   # finished rows handed on in any segment: the samples returned
    again = wrapped.generate(requests[:2], CONTRACT, v0.version, stream=streamed.extend)
    assert sorted(streamed, key=lambda s: s.sample_id) == sorted(again, key=lambda s: s.sample_id) == \
        sorted(got, key=lambda s: s.sample_id)


def test_config_refusals_follow_the_selected_clients_capabilities():
    from sealrl.config import ConfigError, build_config, check_config
    from sealrl.seams.rollout import requires, selected_client
    assert set(FEATURES) == set(CASES)
    for kind, select in SELECTORS.items():
        caps = CLIENTS[kind].capabilities
        for cap, asks in FEATURES.items():
            cfg = build_config(None, [*select, *asks])
            assert selected_client(cfg)[0] == kind and cap in [c for _, _, c in requires(cfg)]
            lacking = [c for _, _, c in requires(cfg) if not getattr(caps, c)]
            if not lacking:
                check_config(cfg)   # accepted: the client serves every feature asked for
                continue
            with pytest.raises(ConfigError) as e:
                check_config(cfg)
            assert "\n" not in str(e.value) and f"({lacking[0]})" in str(e.value), str(e.value)
            assert CLIENTS[kind].name in str(e.value) and e.value.key == requires(cfg)[
                [c for _, _, c in requires(cfg)].index(lacking[0])][0]
    # switching generation on a client that plays episodes: refused by the switching generation's row
    cfg = build_config(None, [*FEATURES["switches_versions"], *FEATURES["multi_turn"]])
    with pytest.raises(ConfigError, match=r"^env.name=guess needs .*\(multi_turn\); "
                                          r"rollout.partial=switch selects the switching generation"):
        check_config(cfg)
