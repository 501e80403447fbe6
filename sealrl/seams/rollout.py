"""The rollout seam: what the driver may call on "the rollout", and what each kind of rollout
client can do, as data (DESIGN section 11; docs/architecture.md, "The rollout seam").

Clients: the in-process engine (`roles/rollout.Rollout`), the generation process
(rollout.lane=process: a `placement/rollout_pool.RolloutPool` of one worker on a process host,
`placement/process_group.py`) and the Ray replica pool (the same RolloutPool over Ray actors,
placement.backend=ray). Two wrappers pass the protocol
through: `trainer/variants/partial.SwitchingRollout` (rollout.partial=switch) and the fault-drill
wrapper (`trainer/drills.py`). The wire they speak is `experience/wire.py`.

The config selects a client kind (`selected_client`); check_config (config/loading.py) refuses
at load every key whose capability that kind lacks (`requires`), so an iteration never asks a
client for what it cannot do. A client asked anyway raises MissingCapability naming it.
`tests/test_rollout_conformance.py` runs every client through the same cases, including one
per declared capability. A new client (another engine) adds a row to CLIENTS and a factory
there.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from sealrl.experience.ids import PolicyVersion
    from sealrl.experience.records import SamplingContract
    from sealrl.experience.wire import GenerationRequest, RolloutSample


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a client does beyond loading verified versions and generating under one of them."""

    streams_finished_rows: bool  # generate(..., stream=f): each finished row handed on while the others decode
    switches_versions: bool      # generate_switching: running rows move to a version activated meanwhile
    multi_turn: bool             # plays multi-turn episodes (env.name); the lean backend keeps each turn's cache
    bounded_rows: bool           # at most rollout.max_rows rows decode at once (waves or continuous batching)
    retained_versions: bool      # retain(k): the last k activated versions keep serving (async generation)
    loads_while_generating: bool  # load() from another thread while a generate call runs (async publication)
    lora_adapters: bool          # pin_base, then versions that are adapters merged into that base


WHAT = {   # a capability, as the messages say it
    "streams_finished_rows": "stream finished rows",
    "switches_versions": "switch versions mid-generation",
    "multi_turn": "play multi-turn episodes",
    "bounded_rows": "bound the rows decoding at once",
    "retained_versions": "retain earlier versions",
    "loads_while_generating": "load a version while generating",
    "lora_adapters": "load LoRA adapters on a pinned base",
}


@dataclass(frozen=True, slots=True)
class ClientKind:
    name: str                    # what it is, in messages
    capabilities: Capabilities


CLIENTS = {
    "engine": ClientKind("the in-process engine (roles/rollout.py)", Capabilities(
        streams_finished_rows=True, switches_versions=True, multi_turn=True, bounded_rows=True,
        retained_versions=True, loads_while_generating=True, lora_adapters=True)),
    # the replica pool below with one worker on a process host (placement/process_group.py)
    "process": ClientKind("the generation process (a pool of one: placement/process_group.py)", Capabilities(
        streams_finished_rows=True, switches_versions=True, multi_turn=True, bounded_rows=True,
        retained_versions=True, loads_while_generating=True, lora_adapters=True)),
    # replicas activate each version together (and retain the last k); each replica stages a
    # version beside a running generate (two calls at once); every replica pins the LoRA base;
    # a streamed generate hands on each replica's shard as it arrives, while the others generate;
    # a switching generate moves each replica's rows when the version is activated there
    "ray_pool": ClientKind("the Ray replica pool (placement/rollout_pool.py)", Capabilities(
        streams_finished_rows=True, switches_versions=True, multi_turn=True, bounded_rows=True,
        retained_versions=True, loads_while_generating=True, lora_adapters=True)),
}

# rollout.partial=switch: generate goes through rollout/switching.py, a decode loop (a wave of at
# most rollout.max_rows rows at a time) that hands finished rows on but does not play episodes
SWITCHING = ClientKind("the switching generation (rollout/switching.py)", Capabilities(
    streams_finished_rows=True, switches_versions=True, multi_turn=False, bounded_rows=True,
    retained_versions=True, loads_while_generating=True, lora_adapters=True))


# rollout.backend=vllm: the engine inside the client is vLLM (rollout/vllm_engine.py). It holds one
# weight set: retained versions are verified copies loaded into it when a generate call asks for one
# (an activation beside a running generate waits for nothing); no switch mid-generation; its blocking
# generate hands rows on only at the end, and it bounds rows by rollout.max_rows (its max_num_seqs);
# episodes go in turn by turn as token ids, LoRA adapters are merged into the pinned base here
VLLM = ClientKind("the vLLM engine (rollout/vllm_engine.py)", Capabilities(
    streams_finished_rows=False, switches_versions=False, multi_turn=True, bounded_rows=True,
    retained_versions=True, loads_while_generating=True, lora_adapters=True))


def narrowed(caps: Capabilities, by: Capabilities) -> Capabilities:
    """What a client can still do once `by` (switching generation, a vLLM engine) narrows it."""
    return Capabilities(**{f.name: getattr(caps, f.name) and getattr(by, f.name)
                           for f in dataclasses.fields(Capabilities)})


def switching(caps: Capabilities) -> Capabilities:
    """A client's capabilities once its generate calls switch versions (SwitchingRollout)."""
    return narrowed(caps, SWITCHING.capabilities)


def selected_client(cfg) -> tuple[str, str]:
    """(CLIENTS key, the setting that selects it) for a run's config: the run's rollout client
    (every generate call, evaluations included, and every version loaded go to it)."""
    if cfg.placement.backend == "ray":
        return "ray_pool", "placement.backend=ray"
    if cfg.rollout.lane == "process":
        return "process", "rollout.lane=process"
    return "engine", f"placement.backend={cfg.placement.backend}"


def requires(cfg) -> list[tuple[str, Any, str]]:
    """(config key, its value, the capability it needs) for every rollout feature `cfg` asks for."""
    r, out = cfg.rollout, []
    if r.max_staleness:   # the lane samples from older versions while the training lane publishes
        out.append(("rollout.max_staleness", r.max_staleness, "retained_versions"))
        out.append(("rollout.max_staleness", r.max_staleness, "loads_while_generating"))
    if r.partial == "switch":
        out.append(("rollout.partial", r.partial, "switches_versions"))
    if cfg.reward.stream:
        out.append(("reward.stream", "true", "streams_finished_rows"))
    if r.max_rows:
        out.append(("rollout.max_rows", r.max_rows, "bounded_rows"))
    if cfg.env.name != "none":
        out.append(("env.name", cfg.env.name, "multi_turn"))
    if cfg.actor.lora.rank:
        out.append(("actor.lora.rank", cfg.actor.lora.rank, "lora_adapters"))
    return out


def narrowing(cfg, backend: str | None = None) -> list[tuple[ClientKind, str]]:
    """What narrows the selected client's capabilities: switching generation, a vLLM engine
    (`backend`: the resolved rollout.backend when known, else the config's). In the Ray pool a
    vLLM engine does not narrow streaming: the pool streams each replica's whole shard as it
    arrives, whatever engine generated it."""
    out = [(SWITCHING, "rollout.partial=switch")] if cfg.rollout.partial == "switch" else []
    if (backend or cfg.rollout.backend) == "vllm":
        engine = VLLM
        if selected_client(cfg)[0] == "ray_pool":
            engine = ClientKind(VLLM.name, dataclasses.replace(VLLM.capabilities, streams_finished_rows=True))
        out.append((engine, "rollout.backend=vllm"))
    return out


def refusals(cfg, backend: str | None = None) -> list[tuple[str, str]]:
    """(key, one-line reason) for each feature of `cfg` that its selected client cannot serve."""
    kind, by = selected_client(cfg)
    client = CLIENTS[kind]
    out = []
    for key, value, cap in requires(cfg):
        lacking = [(client, by)] if not getattr(client.capabilities, cap) else []
        lacking += [(who, why) for who, why in narrowing(cfg, backend) if not getattr(who.capabilities, cap)]
        if lacking:
            who, why = lacking[0]
            out.append((key, f"{key}={value} needs a rollout that can {WHAT[cap]} ({cap}); {why} selects "
                             f"{who.name}, which cannot"))
    return out


class MissingCapability(NotImplementedError):
    """A client was asked for what its capabilities say it does not do (check_config refuses
    such a run at load; reaching this is a bug in the caller)."""

    def __init__(self, client: object, capability: str) -> None:
        super().__init__(f"{type(client).__name__} cannot {WHAT[capability]} (capability {capability} is not "
                         "declared; check_config refuses this at load)")
        self.capability = capability


class RolloutClient(Protocol):
    """What the driver may call on "the rollout". Members gated by a capability say which."""

    capabilities: Capabilities

    @property
    def version(self) -> PolicyVersion | None:
        """The active version (None before the first load)."""

    @property
    def backend(self) -> tuple[str, str]:
        """(forward backend, dtype of its weights) the active version samples with."""

    def load(self, state: dict, manifest) -> PolicyVersion:
        """ROLLOUT_LOADING -> ROLLOUT_READY: verify every checksum, then switch; a failed load
        activates nothing and the previous version keeps serving (the error names the tensor)."""

    def generate(self, requests: list[GenerationRequest], contract: SamplingContract, version: PolicyVersion,
                 stream: Callable | None = None) -> list[RolloutSample]:
        """Every requested candidate under `version` (VersionNotHeldError if not held). `stream`
        needs streams_finished_rows."""

    def generate_switching(self, requests: list[GenerationRequest], contract: SamplingContract,
                           version: PolicyVersion, plan: dict | None = None,
                           resolve: Callable | None = None, stream: Callable | None = None) -> list[RolloutSample]:
        """switches_versions: rows move to a version activated meanwhile (plan None) or at a
        replay's recorded tokens (plan: first token -> key; resolve(key) -> the version, in this
        process; without resolve the keys are versions, waited for where the client runs).
        `stream` as for generate."""

    def retain(self, versions: int) -> None:
        """retained_versions (for versions > 1): keep serving the last `versions` activations."""

    def pin_base(self, state: dict, manifest) -> str:
        """lora_adapters: the verified frozen base later adapter versions merge into; its hash."""

    def take_served(self) -> list[dict]:
        """Who served which sample id per generate call since the last take (a pool's record)."""

    def take_recoveries(self) -> list[float]:
        """Seconds of each replacement of a lost host since the last take."""

    def take_engine_stats(self) -> dict[str, float]:
        """The engine's KV-cache facts since the last take (rollout/kv_meter.py: `kv_peak_gb`,
        `kv_use`; a pool's largest peak and mean use over its replicas); {} where not metered."""

    def close(self) -> None:
        """Release the client's processes and workers."""


class RolloutReplica(RolloutClient, Protocol):
    """What a pool asks of each of its members: a load in two phases, so that the replicas
    activate only once every one of them verified (placement/dispatch.py)."""

    @property
    def staged_version(self) -> PolicyVersion | None:
        """The verified, not yet active version."""

    def stage(self, state: dict, manifest) -> PolicyVersion:
        """Copy and verify; the active version is unchanged."""

    def activate(self, version: PolicyVersion) -> PolicyVersion:
        """Switch to the staged `version` with one assignment."""

    def discard_staged(self) -> None:
        """Drop a staged copy that will not be activated."""


def missing_members(obj: object, protocol: type = RolloutClient) -> list[str]:
    """The members of `protocol` that `obj` lacks, looked up without calling anything (a
    pool's `version` is a remote call)."""
    names = [n for n in dir(protocol) if not n.startswith("_")]
    names += [n for cls in protocol.__mro__ for n in getattr(cls, "__annotations__", {}) if not n.startswith("_")]
    out = []
    for name in dict.fromkeys(names):
        try:
            inspect.getattr_static(obj, name)
        except AttributeError:
            out.append(name)
    return out
