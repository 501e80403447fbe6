"""The rollout engine: sample groups of responses from one verified policy version.

What it consumes: weights + a WeightManifest (stage, then activate; load_weights does both),
then generation requests for the version it holds. What it guarantees:

- it serves exactly one version at a time (or the last k with retain(k)); weights are staged as
  a private copy, verified tensor by tensor against the manifest, and only then swapped in with
  one assignment, so a failed load leaves the previous version serving (the mechanism is
  sync/versions.py, shared by every rollout client). Staging and activation are separate calls
  so that a pool of replicas activates only once every replica has verified (two phases,
  placement/rollout_pool.RolloutPool.load). KV caches live inside one generate call
  and are bound to the version that call started with: nothing cached survives a swap (an
  episode's turn cache, turns.py, spans the turns of one episode call and is refused by any
  other version or backend);
- a prompt is prefilled once and its cache fanned out to the group's candidates; candidates
  share a cache row while their tokens coincide; finished rows leave the batch (the cache is
  compacted) and decoding stops when all finished (loop.py);
- the randomness of candidate c at step t is a function of (candidate seed, t) only, so a
  retry of one candidate alone, or in another batch, reproduces the same response;
- `rollout_log_probs` are log_softmax(logits / T) without filtering, the space the actor
  trains in; the eos/stop token is part of `response_ids` (it is an action).

Seeds: a candidate's seed is derived from (GenerationRequest.seed, candidate) only; the
engine does not read SamplingContract.seed or n (the driver derives request seeds and picks
candidates). Threads: generation uses torch's intra-op threads as set by the caller; on a few
shared CPU cores, OMP_WAIT_POLICY=PASSIVE (set before torch is imported) and one thread are
often faster for small models, because every multi-threaded op waits for a busy core.
"""
from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Mapping

import torch
from torch import Tensor

from sealrl.experience.ids import PolicyVersion, sample_id
from sealrl.experience.records import SamplingContract
from sealrl.experience.wire import GenerationRequest, RolloutSample
from sealrl.models.hf import check_same_tokenizer, model_config_hash, tokenizer_hash
from sealrl.rollout.backends import HFBackend, LeanBackend, make_backend, weightless_template
from sealrl.rollout.lean import lean_unsupported_reason
from sealrl.rollout.loop import decode_loop
from sealrl.rollout.sampling import candidate_seed
from sealrl.rollout.scheduler import continuous, run_waves
from sealrl.rollout.stops import StopChecker
from sealrl.rollout.turns import TurnCache
from sealrl.sync.adapter import AdapterManifest
from sealrl.sync.manifest import WeightManifest, WeightSyncError
from sealrl.sync.versions import Snapshot, VersionSlots, verified_adapter, verified_copy


def _eos_ids(model, tokenizer) -> frozenset[int]:
    """The tokenizer's eos plus the generation config's (chat models often list several)."""
    ids = set() if tokenizer.eos_token_id is None else {int(tokenizer.eos_token_id)}
    gen = getattr(model, "generation_config", None)  # absent on models that never generate
    if gen is not None and gen.eos_token_id is not None:
        extra = gen.eos_token_id
        ids |= {int(t) for t in (extra if isinstance(extra, (list, tuple)) else [extra])}
    return frozenset(ids)


class RolloutEngine:
    """Batched sampling with a KV cache from the one policy version it holds."""

    def __init__(self, model, tokenizer, device: str | torch.device = "cpu",
                 prefer_lean: bool = True) -> None:
        """`model` gives the architecture; its weights are never served (nothing is served
        before load_weights). `prefer_lean=False` forces the HF forward (parity tests)."""
        self.device = torch.device(device)
        self.tokenizer = tokenizer
        self.eos_ids = _eos_ids(model, tokenizer)
        self.tokenizer_hash = tokenizer_hash(tokenizer)
        self.model_config_hash = model_config_hash(model.config)
        self._template = weightless_template(model)  # the engine's own copy, no weight memory
        self._expected = {n: tuple(t.shape) for n, t in self._template.state_dict().items()}
        self._prefer_lean = prefer_lean
        if prefer_lean and (reason := lean_unsupported_reason(model.config)) is not None:
            print(f"sealrl: rollout runs {type(model).__name__} on the HF forward, not the lean one "
                  f"({reason}); same numbers, slower decoding", file=sys.stderr, flush=True)
        self.versions: VersionSlots[LeanBackend | HFBackend] = VersionSlots()   # active, staged, retained
        self._base: tuple[str, dict[str, Tensor]] | None = None   # LoRA: (hash, weights) of the pinned base
        self.max_rows, self.continuous = 0, False   # rollout.max_rows / continuous_batching (scheduler.py)

    def retain(self, versions: int) -> None:
        """Keep serving the last `versions` activated versions (1 = only the active one): an
        asynchronous pipeline generates with a version up to rollout.max_staleness activations
        behind the newest. Each retained version holds its own weight copy."""
        self.versions.retain(versions)

    @property
    def active_version(self) -> PolicyVersion | None:
        return self.versions.active_version

    @property
    def backend_name(self) -> str:
        snap = self.versions.active
        return "none" if snap is None else type(snap.held).__name__

    @property
    def backend(self) -> tuple[str, str]:
        """(backend_name, dtype of its weights), e.g. ("LeanBackend", "float32"): what sampled."""
        snap = self.versions.active
        return ("none", "none") if snap is None else \
            (type(snap.held).__name__, str(snap.held.dtype).removeprefix("torch."))

    @property
    def staged_version(self) -> PolicyVersion | None:
        return self.versions.staged_version

    def pin_base(self, state_dict: Mapping[str, Tensor], manifest: WeightManifest) -> str:
        """LoRA: keep the frozen base, verified like a full version, that every later adapter
        version (AdapterManifest) is merged into; returns its hash. Activates nothing."""
        self._base = None
        self._check_version(manifest.version)
        self._base = (manifest.version.weights_hash, verified_copy(state_dict, manifest, self._expected))
        return self._base[0]

    def stage(self, state_dict: Mapping[str, Tensor], manifest: WeightManifest | AdapterManifest,
              ) -> PolicyVersion:
        """ROLLOUT_LOADING(v): copy the weights, verify every checksum and shape, build the
        backend, and keep it staged; the active version is unchanged. A later stage replaces
        an earlier staged copy. Raises WeightSyncError (or TokenizerMismatchError) naming the
        tensor, and then holds nothing staged."""
        def build() -> LeanBackend | HFBackend:
            self._check_version(manifest.version)
            if isinstance(manifest, AdapterManifest):   # LoRA: merged into a copy of the pinned base
                staged = verified_adapter(state_dict, manifest, self._base)
            else:
                staged = verified_copy(state_dict, manifest, self._expected)
            return make_backend(staged, self._template, self.device, self._prefer_lean)
        return self.versions.stage(manifest.version, build)

    def _check_version(self, version: PolicyVersion) -> None:
        if version.tokenizer_hash:
            check_same_tokenizer(version.tokenizer_hash, self.tokenizer_hash,
                                 f"rollout engine loading {version}")
        if version.model_config_hash and version.model_config_hash != self.model_config_hash:
            raise WeightSyncError("<config>", f"version {version} is for another architecture")

    def activate(self, version: PolicyVersion) -> PolicyVersion:
        """ROLLOUT_READY(v): switch to the staged `version` with one reference assignment (a
        generate call already running keeps the snapshot it started with). Activating the
        version already active is a no-op, so a repeated activation is harmless."""
        return self.versions.activate(version)

    def discard_staged(self) -> None:
        """Drop a staged copy that will not be activated (another replica failed to verify)."""
        self.versions.discard_staged()

    def load_weights(self, state_dict: Mapping[str, Tensor], manifest: WeightManifest) -> None:
        """Stage, verify, activate: the single-engine path. Activates nothing on failure."""
        self.activate(self.stage(state_dict, manifest))

    def serving(self, version: PolicyVersion | None = None) -> Snapshot:
        """The snapshot (version, backend) serving `version` (None: the active one), retained or
        active; VersionNotHeldError when this replica does not hold it."""
        return self.versions.serving(version)

    def check_requests(self, requests: list[GenerationRequest]) -> None:
        """ValueError on a (group_id, candidate) pair asked twice or a prompt token outside the
        vocabulary: every generate path checks its requests here."""
        keys = [(r.group_id, c) for r in requests for c in r.candidates]
        if len(set(keys)) != len(keys):
            raise ValueError("generate: a (group_id, candidate) pair is requested twice")
        vocab = self._template.config.vocab_size
        for r in requests:
            if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= vocab:
                raise ValueError(f"request {r.group_id}: prompt token outside the vocabulary "
                                 f"[0, {vocab})")

    def generate(self, requests: list[GenerationRequest], contract: SamplingContract,
                 version: PolicyVersion, kv: TurnCache | None = None, stream=None) -> list[RolloutSample]:
        """Sample every requested candidate; samples come back in request, then candidate order.
        `kv`: an episode call's turn cache (turns.py): each row continues from the block its
        previous turn kept, and keeps its own; bound to `version` (the lean backend only).
        `stream(samples)`: called after every decode step with the samples that finished at it
        (often none), equal to those returned (reward.stream scores them meanwhile)."""
        started = time.perf_counter()  # finish_s is measured from here
        snap = self.serving(version)  # read once: this call uses this version to the end
        self.check_requests(requests)
        if not requests:
            return []
        prompts = list(dict.fromkeys(r.prompt_ids for r in requests))  # identical prompts: one
        prompt_index = {p: i for i, p in enumerate(prompts)}
        rows = [(req, cand) for req in requests for cand in req.candidates]
        seeds = [candidate_seed(req.seed, cand) for req, cand in rows]
        if kv is not None:
            kv.bind(snap.version, snap.held)
        filtered = contract.filtered

        def sample(out, i: int) -> RolloutSample:
            req, cand = rows[i]
            return RolloutSample(sample_id(req.group_id, cand), req.group_id, cand, req.prompt_ids,
                                 tuple(out.tokens[i]), tuple(out.log_probs[i]),
                                 tuple(out.filtered_log_probs[i]) if filtered else None,
                                 out.reasons[i], snap.version, seeds[i], out.finish_s[i])
        # rows that stopped at a step are final (loop.py): handed on while the others decode
        hook = None if stream is None else (lambda stopped, out: stream([sample(out, i) for i in stopped]))
        with torch.inference_mode():
            if kv is not None and isinstance(snap.held, LeanBackend):
                out = kv.decode(snap.held, [(req.group_id, cand) for req, cand in rows],
                                [req.prompt_ids for req, _ in rows], seeds, contract, self.device, self.eos_ids,
                                StopChecker(self.tokenizer, contract.stop), started, on_step=hook)
            elif self.max_rows and len(rows) > self.max_rows:   # bounded rows: waves or continuous
                args = (snap.held, prompts, [prompt_index[req.prompt_ids] for req, _ in rows], seeds, contract,
                        self.device, self.eos_ids, StopChecker(self.tokenizer, contract.stop), started)
                per_request = [list(range(i, i + len(r.candidates)))
                               for i, r in zip(itertools.accumulate([0] + [len(r.candidates) for r in requests]),
                                               requests)]
                lean = self.continuous and isinstance(snap.held, LeanBackend)
                out = (continuous if lean else run_waves)(*args, per_request, self.max_rows, on_step=hook)
            else:
                out = decode_loop(snap.held, prompts, [prompt_index[req.prompt_ids] for req, _ in rows],
                                  seeds, contract, self.device, self.eos_ids,
                                  StopChecker(self.tokenizer, contract.stop), started, on_step=hook)
        return [sample(out, i) for i in range(len(rows))]
