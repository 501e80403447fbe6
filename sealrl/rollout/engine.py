"""The rollout engine: sample groups of responses from one verified policy version.

What it consumes: weights + a WeightManifest (load_weights), then generation requests for the
version it holds. What it guarantees:

- it serves exactly one version at a time; weights are staged as a private copy, verified
  tensor by tensor against the manifest, and only then swapped in with one assignment, so a
  failed load leaves the previous version serving. KV caches live inside one generate call
  and are bound to the version that call started with: nothing cached survives a swap;
- a group's prompt is prefilled once and its cache fanned out to the group's candidates;
  finished rows leave the batch (the cache is compacted) and decoding stops when all finished;
- the randomness of candidate c at step t is a function of (candidate seed, t) only, so a
  retry of one candidate alone, or in another batch, reproduces the same response;
- `rollout_log_probs` are log_softmax(logits / T) without filtering, the space the actor
  trains in; the eos/stop token is part of `response_ids` (it is an action).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from sealrl.experience.ids import PolicyVersion, sample_id
from sealrl.experience.records import SamplingContract, StopReason
from sealrl.models.hf import check_same_tokenizer, model_config_hash, tokenizer_hash
from sealrl.rollout.backends import HFBackend, LeanBackend, make_backend, weightless_template
from sealrl.rollout.sampling import candidate_seed, sample_step, uniform_noise
from sealrl.rollout.stops import StopChecker
from sealrl.sync.manifest import WeightManifest, WeightSyncError, verify_weights


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt's group, or the subset of its candidates a retry regenerates."""

    group_id: str                 # run/iter/prompt
    prompt_ids: tuple[int, ...]
    seed: int                     # per-request seed
    candidates: tuple[int, ...]   # which candidates of the group to sample

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "candidates", tuple(int(c) for c in self.candidates))
        if not self.prompt_ids:
            raise ValueError(f"request {self.group_id}: prompt_ids is empty")
        if not self.candidates or len(set(self.candidates)) != len(self.candidates):
            raise ValueError(f"request {self.group_id}: candidates must be non-empty and unique, "
                             f"got {self.candidates}")
        if min(self.candidates) < 0:
            raise ValueError(f"request {self.group_id}: negative candidate in {self.candidates}")


@dataclass(frozen=True)
class RolloutSample:
    """One sampled response with the facts the rollout role owns (DESIGN section 3)."""

    sample_id: str
    group_id: str
    candidate: int
    prompt_ids: tuple[int, ...]
    response_ids: tuple[int, ...]
    rollout_log_probs: tuple[float, ...]          # log_softmax(logits / T), unfiltered
    filtered_log_probs: tuple[float, ...] | None  # under the top-k/top-p distribution sampled
    stop_reason: StopReason
    policy_version: PolicyVersion
    seed: int                                     # the per-candidate seed actually used


class VersionNotHeldError(RuntimeError):
    """generate() was asked for a version this replica does not serve."""


@dataclass(frozen=True)
class _Snapshot:
    version: PolicyVersion
    backend: LeanBackend | HFBackend


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
        self._active: _Snapshot | None = None

    @property
    def active_version(self) -> PolicyVersion | None:
        snap = self._active
        return None if snap is None else snap.version

    @property
    def backend_name(self) -> str:
        snap = self._active
        return "none" if snap is None else type(snap.backend).__name__

    def load_weights(self, state_dict: Mapping[str, Tensor], manifest: WeightManifest) -> None:
        """Stage a private copy, verify it against the manifest, then swap it in atomically.

        Raises WeightSyncError (or TokenizerMismatchError) and activates nothing on failure.
        """
        version = manifest.version
        if version.tokenizer_hash:
            check_same_tokenizer(version.tokenizer_hash, self.tokenizer_hash,
                                 f"rollout engine loading {version}")
        if version.model_config_hash and version.model_config_hash != self.model_config_hash:
            raise WeightSyncError("<config>", f"version {version} is for another architecture")
        staged = _stage(state_dict)
        verify_weights(staged, manifest)
        for name, shape in self._expected.items():  # the manifest must fit this architecture
            if name not in staged:
                raise WeightSyncError(name, "needed by the rollout model, absent from the manifest")
            if tuple(staged[name].shape) != shape:
                raise WeightSyncError(name, f"shape {tuple(staged[name].shape)} != model {shape}")
        for name in staged.keys() - self._expected.keys():
            raise WeightSyncError(name, "not a tensor of the rollout model")
        backend = make_backend(staged, self._template, self.device, self._prefer_lean)
        self._active = _Snapshot(version, backend)  # the swap: one reference assignment

    def generate(self, requests: list[GenerationRequest], contract: SamplingContract,
                 version: PolicyVersion) -> list[RolloutSample]:
        """Sample every requested candidate; samples come back in request, then candidate order."""
        snap = self._active  # read once: this call uses this version to the end
        if snap is None or snap.version != version:
            held = "nothing" if snap is None else str(snap.version)
            raise VersionNotHeldError(f"asked to generate with {version}, this replica holds {held}")
        keys = [(r.group_id, c) for r in requests for c in r.candidates]
        if len(set(keys)) != len(keys):
            raise ValueError("generate: a (group_id, candidate) pair is requested twice")
        if not requests:
            return []
        vocab = self._template.config.vocab_size
        for r in requests:
            if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= vocab:
                raise ValueError(f"request {r.group_id}: prompt token outside the vocabulary "
                                 f"[0, {vocab})")
        with torch.inference_mode():
            rows = _decode_loop(snap.backend, requests, contract, self.device, self.eos_ids,
                                StopChecker(self.tokenizer, contract.stop))
        samples, i = [], 0
        for req in requests:
            for cand in req.candidates:
                tokens, lps, flps, reason, seed = rows[i]
                i += 1
                samples.append(RolloutSample(
                    sample_id(req.group_id, cand), req.group_id, cand, req.prompt_ids,
                    tuple(tokens), tuple(lps), tuple(flps) if contract.filtered else None,
                    reason, snap.version, seed))
        return samples


def _stage(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A private CPU copy of every tensor; aliases (tied embeddings) stay aliases."""
    staged, copies = {}, {}
    for name, t in state_dict.items():
        t = t.detach()
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
        if key not in copies:
            copies[key] = t.to("cpu", copy=True)
        staged[name] = copies[key]
    return staged


def _left_pad(prompts: list[tuple[int, ...]], device: torch.device) -> tuple[Tensor, Tensor]:
    """ids (G, P) left-padded with 0 and valid (G, P) bool."""
    P = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), P), dtype=torch.long)
    valid = torch.zeros((len(prompts), P), dtype=torch.bool)
    for g, p in enumerate(prompts):
        ids[g, P - len(p):] = torch.tensor(p, dtype=torch.long)
        valid[g, P - len(p):] = True
    return ids.to(device), valid.to(device)


def _decode_loop(backend, requests: list[GenerationRequest], contract: SamplingContract,
                 device: torch.device, eos_ids: frozenset[int], stops: StopChecker) -> list:
    """Prefill each prompt once, fan out, sample until every row stopped.

    Returns one (tokens, log_probs, filtered_log_probs, stop_reason, seed) per row, rows in
    request/candidate order. Row state is kept for the active rows only; `alive` maps batch
    position -> row index and every per-row tensor is compacted with it.
    """
    ids, valid = _left_pad([r.prompt_ids for r in requests], device)  # (G, P)
    P = ids.shape[1]
    max_new, stop_ids = contract.max_new_tokens, frozenset(contract.stop_token_ids)
    max_len = P + max_new - 1  # the last sampled token is never fed back
    group_of = [g for g, r in enumerate(requests) for _ in r.candidates]
    seeds = [candidate_seed(r.seed, c) for r in requests for c in r.candidates]
    N = len(seeds)
    out_tokens: list[list[int]] = [[] for _ in range(N)]
    out_lps: list[list[float]] = [[] for _ in range(N)]
    out_flps: list[list[float]] = [[] for _ in range(N)]
    reasons: list[StopReason | None] = [None] * N

    positions = (valid.long().cumsum(1) - 1).clamp(min=0)  # (G, P)
    logits, cache = backend.prefill(ids, positions, valid, max_len)  # (G, V)
    fan = torch.tensor(group_of, device=device)
    cache, logits = backend.select(cache, fan), logits.index_select(0, fan)  # (N, V)
    key_valid = None  # only needed when some prompt is padded
    if not bool(valid.all()):
        key_valid = torch.ones((N, max_len), dtype=torch.bool, device=device)
        key_valid[:, :P] = valid.index_select(0, fan)
    pad_len = P - valid.long().sum(1).index_select(0, fan)  # (N,)
    seed_t = torch.tensor(seeds, dtype=torch.int64, device=device)
    # every row's uniform for every step, up front: (N, max_new), a function of (seed, step)
    noise = uniform_noise(seed_t, torch.arange(max_new, device=device))
    alive = list(range(N))

    for step in range(max_new):
        tokens, lps, flps = sample_step(logits, noise[:, step], contract.temperature,
                                        contract.top_k, contract.top_p)
        token_list, lp_list = tokens.tolist(), lps.tolist()
        flp_list = flps.tolist() if flps is not None else None
        keep = []
        for i, row in enumerate(alive):
            tok = token_list[i]
            out_tokens[row].append(tok)
            out_lps[row].append(lp_list[i])
            if flp_list is not None:
                out_flps[row].append(flp_list[i])
            if tok in eos_ids:
                reasons[row] = StopReason.EOS
            elif tok in stop_ids or stops.hit(out_tokens[row]):
                reasons[row] = StopReason.STOP
            elif step == max_new - 1:
                reasons[row] = StopReason.LENGTH
            else:
                keep.append(i)
        if not keep:
            break
        if len(keep) < len(alive):  # finished rows leave the batch
            idx = torch.tensor(keep, device=device)
            cache = backend.select(cache, idx)
            tokens, noise = tokens[idx], noise.index_select(0, idx)
            pad_len = pad_len[idx]
            key_valid = None if key_valid is None else key_valid.index_select(0, idx)
            alive = [alive[i] for i in keep]
        col = P + step  # cache column of the token being fed
        step_valid = None if key_valid is None else key_valid[:, :col + 1]
        logits = backend.decode(cache, tokens, col - pad_len, step_valid)
    return [(out_tokens[r], out_lps[r], out_flps[r], reasons[r], seeds[r]) for r in range(N)]
