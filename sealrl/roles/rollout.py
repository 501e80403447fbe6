"""Rollout role: samples responses from one committed snapshot and records behaviour
log-probs and stop reasons. It owns inference weights and never holds an optimizer.

Weights arrive in two phases so that a pool of replicas switches together (DESIGN section 5):
`stage` verifies every checksum and keeps the copy aside, `activate` switches to it; `load`
does both for a single replica. The role is the in-process client of the rollout seam
(seams/rollout.py: RolloutReplica) and declares all its capabilities."""
from __future__ import annotations

import torch

from sealrl.experience import PolicyVersion, SamplingContract
from sealrl.experience.wire import GenerationRequest, RolloutSample
from sealrl.models.precision import resolve_device
from sealrl.rollout import kv_meter, switching
from sealrl.rollout.engine import RolloutEngine
from sealrl.rollout.episodes import EpisodeRunner, EpisodeSpec
from sealrl.rollout.vllm_engine import VllmEngine, VllmOptions
from sealrl.seams.rollout import CLIENTS, VLLM, narrowed
from sealrl.sync.manifest import WeightManifest


class Rollout:
    capabilities = CLIENTS["engine"].capabilities

    def __init__(self, model, tokenizer, device: str = "cpu", episodes: EpisodeSpec | None = None,
                 rows: tuple[int, bool] = (0, True), vllm: VllmOptions | None = None):
        """`device`: auto | cpu | cuda, where the engine's weights live and it samples (resolved
        here, in the process hosting the role); the weights are verified on their CPU copy in
        the rollout's dtype, which the device then receives bit for bit. `episodes`: multi-turn
        rollouts against that environment (rollout/episodes.py). `rows`: (rollout.max_rows,
        continuous), how many rows decode at once and how (rollout/scheduler.py; runs admit rows
        continuously, waves remain for tests and benchmarks).
        `vllm`: generate with vLLM instead of the native engine (rollout.backend=vllm,
        rollout/vllm_engine.py; vLLM places itself, `device` is not used)."""
        if vllm is not None:
            self.engine = VllmEngine(model, tokenizer, vllm)
            self.capabilities = narrowed(self.capabilities, VLLM.capabilities)   # one weight set (seams/rollout.py)
        else:
            self.engine = RolloutEngine(model, tokenizer, device=resolve_device(device, "rollout.device"))
            self.engine.max_rows, self.engine.continuous = rows
        self.episodes = None if episodes is None else EpisodeRunner(episodes, tokenizer)

    @property
    def version(self) -> PolicyVersion | None:
        return self.engine.active_version

    @property
    def backend(self) -> tuple[str, str]:
        """(forward backend, dtype of its weights) the active version samples with."""
        return self.engine.backend

    @property
    def staged_version(self) -> PolicyVersion | None:
        return self.engine.staged_version

    def pin_base(self, state: dict[str, torch.Tensor], manifest: WeightManifest) -> str:
        """LoRA: the frozen base every adapter version is merged into (verified; activates nothing)."""
        return self.engine.pin_base(state, manifest)

    def stage(self, state: dict[str, torch.Tensor], manifest: WeightManifest) -> PolicyVersion:
        """ROLLOUT_LOADING(v): copy and verify every checksum; the active version is unchanged."""
        return self.engine.stage(state, manifest)

    def activate(self, version: PolicyVersion) -> PolicyVersion:
        """ROLLOUT_READY(v): switch to the staged version atomically."""
        return self.engine.activate(version)

    def retain(self, versions: int) -> None:
        """Serve the last `versions` activated versions (asynchronous pipeline, max_staleness + 1)."""
        self.engine.retain(versions)

    def discard_staged(self) -> None:
        self.engine.discard_staged()

    def load(self, state: dict[str, torch.Tensor], manifest: WeightManifest) -> PolicyVersion:
        """ROLLOUT_LOADING(v) -> ROLLOUT_READY(v): stage, verify every checksum, switch."""
        return self.engine.activate(self.engine.stage(state, manifest))

    def generate(self, requests: list[GenerationRequest], contract: SamplingContract,
                 version: PolicyVersion, stream=None) -> list[RolloutSample]:
        """GENERATING(v): refuses any version other than the active one. `stream(samples)`: the
        samples finished so far, handed on while the others generate (reward.stream)."""
        if self.episodes is not None:
            return self.episodes.generate(self.engine.generate, requests, contract, version, stream)
        return self.engine.generate(requests, contract, version, stream=stream)

    def generate_switching(self, requests: list[GenerationRequest], contract: SamplingContract,
                           version: PolicyVersion, plan: dict | None = None, resolve=None,
                           stream=None) -> list[RolloutSample]:
        """rollout.partial=switch: GENERATING(version), the running rows moving to a version
        activated meanwhile (plan None), or at a replay's recorded tokens (plan: first token ->
        key; `resolve(key)` the version, else the key is the version, waited for until it is
        loaded here): rollout/switching.py."""
        if plan is None:
            switch = switching.live_switch(self.engine)
        else:
            switch = switching.planned(plan, resolve or (lambda v: switching.wait_held(self.engine, v)))
        return switching.generate_switching(self.engine, requests, contract, version, switch, stream)

    def take_recoveries(self) -> list[float]:
        """Seconds of each replica replacement (a replica pool's record): none in one process."""
        return []

    def take_served(self) -> list[dict]:
        """Who served which sample id (a replica pool's record): here, always this process."""
        return []

    def take_engine_stats(self) -> dict[str, float]:
        """The native engine's KV-cache peak and use since the last take (rollout/kv_meter.py);
        {} with vLLM (its own gauge is not read yet)."""
        return {} if isinstance(self.engine, VllmEngine) else kv_meter.METER.take()

    def close(self) -> None:
        """Stop the episodes' tool worker and vLLM's engine process, if any."""
        if self.episodes is not None:
            self.episodes.close()
        if isinstance(self.engine, VllmEngine):
            self.engine.close()
