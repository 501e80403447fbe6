"""vLLM as the rollout engine (`rollout.backend=vllm`), with the native engine's interface.

`VllmEngine` is a drop-in for `RolloutEngine` (engine.py): the same stage / activate /
generate calls, the same `RolloutSample`s (ids, per-candidate seeds, behaviour log-probs, stop
reasons). vLLM is imported here only, when the backend is built; `import sealrl` never does.

Sampling. Prompts go in as token ids (`TokensPrompt`, never re-tokenized). Each candidate is
its own vLLM request (n=1) with seed `candidate_seed(request seed, candidate)`, so a retry of
one candidate alone asks vLLM for exactly the same request. The same request and seed give
the same tokens; vLLM's randomness is per request (a generator seeded from the request's
seed), but its logits are not batch-invariant bit for bit, so a candidate sampled in another
batch can in principle differ where two tokens' probabilities tie within rounding
(tests/test_rollout_vllm.py checks that a lone retry reproduces its group's candidate on the
embedded model). Behaviour log-probs: the engine runs with logprobs_mode="processed_logprobs",
log_softmax(logits / T) of the sampled token after vLLM's top-k/top-p filter: with neither
filter on, exactly the unfiltered training space the records declare. The worker computes it as
z - logsumexp(z), the training forward's formula, not with torch's log_softmax (biased high on
the CPU at large vocabularies: vllm_worker.py). With a filter on it is
the filtered space, and vLLM returns no unfiltered log-prob in the same pass, so filtered
contracts are refused (config/rollout_backend.py) rather than recorded in the wrong space. The
one exception is evaluation's greedy contract (top_k=1, T=1): vLLM's temperature 0, whose
log-probs are log_softmax(logits), the unfiltered space at T=1.
Stops: eos ids (tokenizer + generation config) and stop ids end a request with the token kept
in `response_ids` (it is an action), as in the native engine; stop strings are matched by vLLM
on its detokenized text (special tokens skipped), the completing token kept.

Weights: one set. vLLM holds a single copy of the weights, so the two phases mean:
- stage(v): copy and verify every checksum against the manifest (as the native engine does)
  and keep the verified copy in this process. The engine still serves the active version;
  nothing reached vLLM.
- activate(v): hand the copy to vLLM's engine process (a safetensors file in /dev/shm, removed
  once loaded), load it in place (the worker's own `reload_weights`, vllm_worker.py), read back
  a checksum of every tensor the engine computes with, in sealrl's names, and compare with the
  manifest; only then switch the version id and drop vLLM's prefix cache. On a mismatch the
  previous version's copy (kept while it is active) is loaded back and verified, and
  WeightSyncError names the tensor: the previous version keeps serving.
- retain(k > 1) (rollout.max_staleness >= 1): the verified copies of the last k activated
  versions are kept here, and vLLM's one weight set holds whichever a generate call asks for:
  a call for another version loads that copy first (verified after loading, as above). One
  lock serialises vLLM's generate calls and its loads, so an activation while the generation
  lane generates does not wait for it: it keeps the verified copy and the next call that asks
  for it loads it (or the activation loads it at once when vLLM is idle). Sampling does not
  depend on when a version was loaded: each request's randomness is its own seed's.
LoRA: the adapter is verified against the pinned base and merged into a copy of it, as the
native engine does (sync/adapter.py); the merged tensors are what the engine must then hold.
"""
from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from sealrl.experience.ids import PolicyVersion, sample_id
from sealrl.experience.records import SamplingContract, StopReason
from sealrl.experience.wire import GenerationRequest, RolloutSample, VersionNotHeldError
from sealrl.models.hf import check_same_tokenizer, model_config_hash, tokenizer_hash
from sealrl.rollout.engine import _eos_ids
from sealrl.rollout.sampling import candidate_seed
from sealrl.sync.adapter import AdapterManifest, merge_adapter, verify_adapter
from sealrl.sync.manifest import TensorEntry, WeightManifest, WeightSyncError, tensor_entry, verify_weights
from sealrl.sync.versions import private_copy as _stage

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
EXTENSION = "sealrl.rollout.vllm_worker.SealrlWorkerExtension"


@dataclass(frozen=True, kw_only=True)
class VllmOptions:
    """What the engine is built with (rollout.dtype and the rollout.vllm keys)."""

    dtype: str = "fp32"                    # fp32 | bf16: the weights vLLM holds and computes in
    enforce_eager: bool = True             # no CUDA graphs / torch.compile (CPU: always eager)
    gpu_memory_utilization: float = 0.5    # CUDA: share of the GPU vLLM takes (weights + KV cache)
    max_num_seqs: int = 256                # requests vLLM decodes at once; more wait in its queue
    kv_cache_gb: int = 1                   # CPU: KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)


@dataclass(frozen=True)
class _Held:
    """A version the engine can load: its manifest and the verified copy (in this process: a
    killed replica leaves no file behind)."""

    version: PolicyVersion
    manifest: WeightManifest
    weights: dict[str, Tensor]


@dataclass(frozen=True)
class _Snapshot:   # what serving() returns, as the native engine's (version, backend)
    version: PolicyVersion
    backend: str = "vllm"


class VllmEngine:
    """Sampling with vLLM from the one policy version its weights hold."""

    def __init__(self, model, tokenizer, options: VllmOptions | None = None) -> None:
        """`model` gives the architecture (its config and tensor shapes); its weights are never
        served: vLLM starts from dummy weights and serves nothing before a version is activated."""
        self.options = options or VllmOptions()
        self.tokenizer = tokenizer
        self.eos_ids = _eos_ids(model, tokenizer)
        self.tokenizer_hash = tokenizer_hash(tokenizer)
        self.model_config_hash = model_config_hash(model.config)
        self.vocab_size = model.config.vocab_size
        self._expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
        with tempfile.TemporaryDirectory(prefix="sealrl-vllm-") as folder:   # read by vLLM at start only
            model.config.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            self.llm = _start(Path(folder), self.options)
        self._active: _Held | None = None
        self._staged: _Held | None = None
        self._retained: list[_Held] = []   # the last `_keep` activated, oldest first (the active one last)
        self._keep = 1
        self._loaded: _Held | None = None   # what vLLM holds now, verified after loading (None: unknown)
        self._engine = threading.Lock()     # one vLLM call at a time: a generate, or a load
        self._base: tuple[str, dict[str, Tensor]] | None = None   # LoRA: (hash, weights) of the pinned base
        self.max_rows, self.continuous = 0, False   # the native scheduler's knobs: refused at config load

    # ---- versions -----------------------------------------------------------------------

    @property
    def active_version(self) -> PolicyVersion | None:
        return None if self._active is None else self._active.version

    @property
    def staged_version(self) -> PolicyVersion | None:
        return None if self._staged is None else self._staged.version

    @property
    def backend_name(self) -> str:
        return "none" if self._active is None else "vllm"

    @property
    def backend(self) -> tuple[str, str]:
        """("vllm", dtype of the weights it holds): what sampled, for the sealed record."""
        return ("none", "none") if self._active is None else ("vllm", DTYPES[self.options.dtype])

    def retain(self, versions: int) -> None:
        """Keep serving the last `versions` activated versions (their verified copies here)."""
        if versions < 1:
            raise ValueError(f"retain needs at least 1 version, got {versions}")
        self._keep = versions
        self._retained = self._retained[-versions:]

    def pin_base(self, state_dict: Mapping[str, Tensor], manifest: WeightManifest) -> str:
        """LoRA: keep the frozen base (verified like a full version, in this process) that every
        later adapter version is merged into; returns its hash. Nothing reaches vLLM."""
        self._base = None
        self._check_version(manifest.version)
        self._base = (manifest.version.weights_hash, self._verified(state_dict, manifest))
        return self._base[0]

    def stage(self, state_dict: Mapping[str, Tensor], manifest: WeightManifest | AdapterManifest,
              ) -> PolicyVersion:
        """ROLLOUT_LOADING(v): verify every checksum and shape of a private copy and keep it for
        activate; the engine keeps serving the active version. An adapter
        version (LoRA) is verified against the pinned base's hash and merged into a copy of it,
        as the native engine does; what vLLM must then hold is that merged copy. Raises
        WeightSyncError naming the tensor, and then holds nothing staged."""
        self.discard_staged()
        version = manifest.version
        self._check_version(version)
        if isinstance(manifest, AdapterManifest):
            adapter = _stage(state_dict)
            base_hash, base = self._base or (None, {})
            verify_adapter(adapter, manifest, base_hash, {n: tuple(t.shape) for n, t in base.items()})
            staged = merge_adapter(base, adapter, manifest.scaling)
            entries = {name: tensor_entry(t) for name, t in sorted(staged.items())}
            manifest = WeightManifest(version, entries)   # the merged tensors, checked in the engine
        else:
            staged = self._verified(state_dict, manifest)
        self._staged = _Held(version, manifest, staged)
        return version

    def _check_version(self, version: PolicyVersion) -> None:
        if version.tokenizer_hash:
            check_same_tokenizer(version.tokenizer_hash, self.tokenizer_hash, f"vLLM rollout loading {version}")
        if version.model_config_hash and version.model_config_hash != self.model_config_hash:
            raise WeightSyncError("<config>", f"version {version} is for another architecture")

    def _verified(self, state_dict: Mapping[str, Tensor], manifest: WeightManifest) -> dict[str, Tensor]:
        """A private copy of full weights, every checksum verified and every tensor fitting the model."""
        staged = _stage(state_dict)
        verify_weights(staged, manifest)
        for name, shape in self._expected.items():
            if name not in staged:
                raise WeightSyncError(name, "needed by the rollout model, absent from the manifest")
            if tuple(staged[name].shape) != shape:
                raise WeightSyncError(name, f"shape {tuple(staged[name].shape)} != model {shape}")
        for name in staged.keys() - self._expected.keys():
            raise WeightSyncError(name, "not a tensor of the rollout model")
        return staged

    def discard_staged(self) -> None:
        """Drop a staged copy that will not be activated (another replica failed to verify)."""
        self._staged = None

    def activate(self, version: PolicyVersion) -> PolicyVersion:
        """ROLLOUT_READY(v): load the staged copy into vLLM in place, verify what the engine then
        holds against the manifest, switch, and drop the prefix cache. Activating the version
        already active is a no-op. On a failed check the previous version is loaded back (and
        verified) before WeightSyncError is raised; nothing staged remains."""
        held = self._staged
        if held is None or held.version != version:
            if self.active_version == version:
                return version
            raise VersionNotHeldError(f"asked to activate {version}, this replica has "
                                      f"{'nothing' if held is None else held.version} staged")
        self._staged = None
        # one version served: load now (nothing generates meanwhile); retained ones: only if vLLM is idle,
        # else the next generate asking for it loads it
        if self._engine.acquire(blocking=self._keep == 1):
            try:
                self._hold(held)
            except WeightSyncError:
                self._loaded = None
                self._restore_active()
                raise
            finally:
                self._engine.release()
        self._active = held
        self._retained = (self._retained + [held])[-self._keep:]
        return version

    def load_weights(self, state_dict: Mapping[str, Tensor], manifest: WeightManifest) -> None:
        """Stage, verify, activate: the single-engine path. Activates nothing on failure."""
        self.activate(self.stage(state_dict, manifest))

    def _restore_active(self) -> None:
        """After a failed activation (the engine lock held): the previous version loaded back and
        verified, or, if even that fails, nothing active (generate then refuses every version)."""
        if self._active is None:
            return
        try:
            self._hold(self._active)
        except WeightSyncError:
            self._active, self._retained = None, []
            raise

    def _hold(self, held: _Held) -> None:
        """vLLM holds `held`, verified after loading, its prefix cache dropped (no cached KV of
        another version serves it); nothing is done if it holds it already. The engine lock is held."""
        if self._loaded is held:
            return
        self._loaded = None
        self._load_verified(held)
        self._reset_prefix_cache()
        self._loaded = held

    def _reset_prefix_cache(self) -> None:
        if not self.llm.reset_prefix_cache():   # refused while requests run: none may here
            raise RuntimeError("vLLM refused to drop its prefix cache (requests still running)")

    def _load_verified(self, held: _Held) -> None:
        """Load `held` into the running engine and compare the checksums it reports with the
        manifest, tensor by tensor (WeightSyncError naming the first that differs)."""
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None   # memory, not disk, where there is one
        with tempfile.TemporaryDirectory(prefix="sealrl-vllm-", dir=shm) as folder:   # the transfer, only
            path = Path(folder) / "weights.safetensors"
            _save(held.weights, path)
            self.llm.collective_rpc("sealrl_load", args=(str(path),))
        for reported in self.llm.collective_rpc("sealrl_held_entries"):   # one dict per worker
            check_held(reported, held.manifest)

    def serving(self, version: PolicyVersion | None = None) -> _Snapshot:
        """The version serving `version` (None: the active one), active or retained;
        VersionNotHeldError otherwise."""
        return _Snapshot(self._held(version).version)

    def _held(self, version: PolicyVersion | None) -> _Held:
        if self._active is not None and version in (None, self._active.version):
            return self._active
        for held in self._retained:
            if held.version == version:
                return held
        raise VersionNotHeldError(f"asked to generate with {version}, this replica holds "
                                  f"{[str(h.version) for h in self._retained] or 'nothing'}")

    # ---- generation ---------------------------------------------------------------------

    def check_requests(self, requests: list[GenerationRequest]) -> None:
        """ValueError on a (group_id, candidate) pair asked twice or a prompt token outside the
        vocabulary, as the native engine."""
        keys = [(r.group_id, c) for r in requests for c in r.candidates]
        if len(set(keys)) != len(keys):
            raise ValueError("generate: a (group_id, candidate) pair is requested twice")
        for r in requests:
            if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= self.vocab_size:
                raise ValueError(f"request {r.group_id}: prompt token outside the vocabulary [0, {self.vocab_size})")

    def generate(self, requests: list[GenerationRequest], contract: SamplingContract,
                 version: PolicyVersion, kv=None, stream=None) -> list[RolloutSample]:
        """Sample every requested candidate; samples come back in request, then candidate order.
        `kv` (an episode's turn cache) is not used: vLLM's own prefix cache reuses a turn's
        prefix, and it is dropped at every activation. `stream(samples)`: called once, with all
        samples, when vLLM returns them (vLLM's blocking call hands nothing on earlier)."""
        from vllm.inputs import TokensPrompt
        started = time.perf_counter()
        held = self._held(version)   # read once: this call uses this version to the end
        self.check_requests(requests)
        greedy = contract.top_k == 1 and contract.temperature == 1.0   # evaluation's greedy contract
        if contract.filtered and not greedy:
            raise ValueError("rollout.backend=vllm records log-probs without top-k/top-p only "
                             "(vLLM returns the filtered space); set rollout.top_k=0 and rollout.top_p=1")
        rows = [(req, cand) for req in requests for cand in req.candidates]
        if not rows:
            return []
        seeds = [candidate_seed(req.seed, cand) for req, cand in rows]
        prompts = [TokensPrompt(prompt_token_ids=list(req.prompt_ids)) for req, _ in rows]
        params = [self._params(contract, seed, greedy) for seed in seeds]
        with self._engine:   # vLLM holds `held` for the whole call
            self._hold(held)
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        finished = time.perf_counter() - started
        samples = [self._sample(req, cand, seed, out, held.version, finished, greedy)
                   for (req, cand), seed, out in zip(rows, seeds, outs)]
        if stream is not None:
            stream(samples)
        return samples

    def _params(self, contract: SamplingContract, seed: int, greedy: bool):
        """One candidate's request. Greedy (top_k=1 at T=1) is vLLM's temperature 0, whose
        processed log-probs are log_softmax(logits): the unfiltered space at T=1."""
        from vllm import SamplingParams
        return SamplingParams(
            n=1, seed=seed, temperature=0.0 if greedy else contract.temperature, top_k=0, top_p=1.0,
            max_tokens=contract.max_new_tokens, logprobs=0,
            ignore_eos=True,   # eos ids are given as stop ids: the tokenizer's and the generation config's
            stop_token_ids=sorted(self.eos_ids | set(contract.stop_token_ids)),
            stop=list(s for s in contract.stop if s) or None, detokenize=bool(contract.stop),
            skip_special_tokens=True, spaces_between_special_tokens=False)

    def _sample(self, req: GenerationRequest, cand: int, seed: int, out, version: PolicyVersion,
                finish_s: float, greedy: bool) -> RolloutSample:
        c = out.outputs[0]
        tokens = tuple(int(t) for t in c.token_ids)
        if c.finish_reason not in ("stop", "length") or c.logprobs is None or len(c.logprobs) != len(tokens):
            raise RuntimeError(f"vLLM returned {req.group_id}/{cand} unfinished ({c.finish_reason}) "
                               f"or without a log-prob per token")
        log_probs = tuple(float(lp[t].logprob) for t, lp in zip(tokens, c.logprobs))
        if tokens and tokens[-1] in self.eos_ids:
            reason = StopReason.EOS
        elif c.finish_reason == "stop":
            reason = StopReason.STOP
        else:
            reason = StopReason.LENGTH
        return RolloutSample(sample_id(req.group_id, cand), req.group_id, cand, req.prompt_ids, tokens,
                             log_probs, (0.0,) * len(tokens) if greedy else None, reason, version, seed, finish_s)

    def close(self) -> None:
        """Stop vLLM's engine process."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()


def check_held(reported: Mapping[str, list], manifest: WeightManifest) -> None:
    """WeightSyncError naming the first tensor (in name order) whose checksum, shape or dtype as
    the engine reports it differs from the manifest, or that one side lacks."""
    held = {n: TensorEntry(tuple(s), d, h) for n, (s, d, h) in reported.items()}
    for name in sorted(manifest.entries.keys() - held.keys()):
        raise WeightSyncError(name, "in the manifest, not held by the vLLM engine after loading")
    for name in sorted(held.keys() - manifest.entries.keys()):
        raise WeightSyncError(name, "held by the vLLM engine, not in the manifest")
    for name in sorted(held):
        if held[name] != manifest.entries[name]:
            got, want = held[name], manifest.entries[name]
            raise WeightSyncError(name, f"the vLLM engine holds {got.dtype}{list(got.shape)} {got.sha256[:12]} after "
                                        f"loading, the manifest {want.dtype}{list(want.shape)} {want.sha256[:12]}")


def _save(staged: Mapping[str, Tensor], path: Path) -> None:
    """safetensors refuses tensors that share memory (tied embeddings): each name its own copy."""
    from safetensors.torch import save_file
    seen: set[int] = set()
    out = {}
    for name, t in staged.items():
        t = t.contiguous()
        out[name] = t.clone() if t.data_ptr() in seen else t
        seen.add(t.data_ptr())
    save_file(out, str(path))


def _start(folder: Path, options: VllmOptions):
    """vLLM's LLM on `folder` (config + tokenizer, dummy weights) in its own engine process.
    The engine process matters on CPU: vLLM's CPU worker replaces torch.set_num_threads with a
    no-op in the process it runs in, which would freeze the trainer's thread settings."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(options.kv_cache_gb)   # read by the engine process it starts
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")   # share the cores with the trainer
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM
    from vllm.platforms import current_platform
    # vLLM's CPU worker rewinds a seeded request's generator when it drops the token sampled after
    # a chunk of a prompt, and CPU generators have no offset: the engine dies ("CPU Generator does
    # not use offset") once a step's prompts exceed its token budget (seen: arith_tools, iteration
    # 5). Whole prompts only, on the CPU; GPUs keep chunked prefill.
    cpu = {"enable_chunked_prefill": False} if current_platform.is_cpu() else {}
    started = time.perf_counter()
    llm = LLM(model=str(folder), tokenizer=str(folder), dtype=DTYPES[options.dtype], load_format="dummy",
              enforce_eager=options.enforce_eager, logprobs_mode="processed_logprobs", generation_config="vllm",
              gpu_memory_utilization=options.gpu_memory_utilization, max_num_seqs=options.max_num_seqs,
              worker_extension_cls=EXTENSION, seed=0, **cpu)
    llm.collective_rpc("sealrl_logsumexp_log_probs")
    print(f"sealrl: vLLM engine up in {time.perf_counter() - started:.1f} s ({DTYPES[options.dtype]})",
          file=sys.stderr, flush=True)
    return llm
