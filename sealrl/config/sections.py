"""The sections of a run's configuration, one dataclass each (`Config` holds them): every field
with its default and a one-line doc, checked at construction with errors that name the field,
the rule and the bad value. Fields declared with `resumable(default)` do not change the numbers
and may differ when a run is resumed; a change to any other field refuses the resume. Reading a
YAML file and dotted overrides into a Config is loading.py's.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

EMBEDDED_MODEL = str(Path(__file__).resolve().parent.parent / "assets" / "arith-tiny")
TASK_NAMES = ("arith", "countdown", "mul3", "guess", "file")   # mul3: the tool task; guess: the guessing game
DEVICES = ("auto", "cpu", "cuda")   # a role's device; auto: cuda when torch sees one, else cpu (models/precision.py)


class UserError(Exception):
    """Something the user gave is wrong: a config value, a data file, a model or run folder.
    The message is one line naming it; the CLI prints only that line and exits 2. Any other
    exception is a bug and keeps its traceback (exit 1)."""


class StoppedRun(UserError):
    """Not the user's input but a failure that ends the run as a named state (a data-parallel
    rank lost with its node): one line, exit 2, and the driver records `failure` (stage, role,
    worker, where) in failures.jsonl; resume=auto continues from the last committed checkpoint."""

    def __init__(self, message: str, failure: dict) -> None:
        super().__init__(message)
        self.failure = failure

    def __reduce__(self):
        return type(self), (str(self), self.failure)


class ConfigError(UserError, ValueError):
    """A config value, key or file is wrong; the message is one line that says which.
    `key` (`section.field`, or a section) lets load_config say where the value came from."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


class MissingInputError(UserError, FileNotFoundError):
    """A file or folder the user named does not exist, or is not the kind that was expected."""


def relative_note(path: str | Path) -> str:
    """The hint added to a missing-path error: relative paths mean the working directory."""
    if Path(path).is_absolute():
        return ""
    return f" (relative paths are resolved against the working directory {Path.cwd()})"


def _check(ok: bool, key: str, rule: str, value: Any) -> None:
    if not ok:
        raise ConfigError(f"{key} must be {rule}, got {value!r}", key)


def _check_one_of(value: str, table: str, key: str) -> None:
    """`table`: the name of the algorithm layer's own table of options (defined once, in
    sealrl.algos; imported here, not at the top, so that `import sealrl.config` stays light)."""
    from sealrl import algos
    options = getattr(algos, table)
    _check(value in options, key, " | ".join(options), value)


LOGGERS = ("tensorboard", "wandb", "mlflow")


def resumable(default: Any) -> Any:
    """A field that may change between a run and its resumption: it does not change the
    numbers (a cadence, a deadline, a worker count). Every other field is checked on resume."""
    return field(default=default, metadata={"resumable": True})


@dataclass(kw_only=True, slots=True)
class RunConfig:
    name: str = "arith_grpo"               # run folder name under output_dir
    output_dir: str = resumable("runs")    # parent of run folders
    seed: int = 0                          # root of every derived seed
    iterations: int = resumable(60)        # RL iterations (one optimizer phase each)
    resume: str = resumable("never")       # never | auto (continue from the latest committed checkpoint)
    checkpoint_every: int = resumable(50)  # iterations between checkpoints (and one at the end); 0 = only at the end
    keep_checkpoints: int = resumable(0)   # newest committed checkpoints kept, older ones deleted (0 = keep all)
    eval_every: int = resumable(0)         # iterations between held-out evaluations; 0 = before/after only
    max_wall_s: float = resumable(0.0)     # training seconds, then a clean stop: checkpoint, exit 0 (0 = none)
    threads: int = 0                       # torch threads (0 = leave torch's default)
    exact: bool = False                    # every pass by the bitwise Hugging Face reference path, torch's default
                                           # AdamW loop, no fusion (debugging, parity tests); false = the fast path
    hold_freed_memory: bool = resumable(True)  # malloc keeps freed memory for the next pass (trainer/memory.py)
    update_retries: int = 1                # a failed update is rolled back and tried again this often
    stage_timeout_s: float = resumable(3600.0)  # deadline of each driver stage; expiry exits 4 naming it (0 = none)
    loggers: str = resumable("tensorboard")  # comma list beyond metrics.jsonl: tensorboard, wandb, mlflow ("" = none)

    def __post_init__(self):
        _check(self.resume in ("never", "auto"), "run.resume", "never or auto", self.resume)
        _check(self.iterations >= 1, "run.iterations", ">= 1", self.iterations)
        _check(self.checkpoint_every >= 0, "run.checkpoint_every", ">= 0", self.checkpoint_every)
        _check(self.keep_checkpoints >= 0, "run.keep_checkpoints", ">= 0 (0 = keep all)", self.keep_checkpoints)
        _check(self.stage_timeout_s >= 0, "run.stage_timeout_s", ">= 0 (0 = no deadline)", self.stage_timeout_s)
        unknown = [x for x in self.loggers.split(",") if x.strip() and x.strip() not in LOGGERS]
        _check(not unknown, "run.loggers", f"a comma list of {' | '.join(LOGGERS)}", self.loggers)
        _check(bool(self.name) and "/" not in self.name and ".." not in self.name and
               not self.name.startswith("."), "run.name", "a plain folder name", self.name)


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    path: str = EMBEDDED_MODEL             # local Hugging Face causal-LM folder
    trust_remote_code: bool = False        # only for folders you trust


@dataclass(kw_only=True, slots=True)
class DataConfig:
    task: str = "arith"                    # arith | countdown | mul3 | guess | file (train_file/eval_file, verl layout)
    train_file: str = ""                   # Parquet or JSONL in the verl layout (task=file)
    eval_file: str = ""                    # held-out Parquet or JSONL (task=file)
    num_train: int = 4000                  # synthetic training prompts
    prompts_per_iter: int = 32             # prompts per iteration (each becomes a group of rollout.n)
    max_prompt_tokens: int = 64            # longer prompts are an error (or dropped, see on_bad_row)
    on_bad_row: str = "error"              # error | drop (counted)
    use_chat_template: bool = True         # apply the tokenizer's chat template to `prompt`

    def __post_init__(self):
        _check(self.task in TASK_NAMES, "data.task", " | ".join(TASK_NAMES), self.task)
        _check(self.prompts_per_iter >= 1, "data.prompts_per_iter", ">= 1", self.prompts_per_iter)
        _check(self.on_bad_row in ("error", "drop"), "data.on_bad_row", "error or drop", self.on_bad_row)
        if self.task == "file":
            _check(bool(self.train_file), "data.train_file", "set when data.task=file", self.train_file)


ROLLOUT_BACKENDS = ("auto", "native", "vllm")   # config/rollout_backend.py


@dataclass(kw_only=True, slots=True)
class VllmConfig:  # rollout.vllm (rollout/vllm_engine.py); check keys start with "." (loading adds rollout.vllm)
    enforce_eager: bool = True             # no CUDA graphs / torch.compile: fast start, slower decode on GPU
    gpu_memory_utilization: float = 0.5    # CUDA: share of the GPU vLLM takes for weights and KV cache
    kv_cache_gb: int = 1                   # CPU: KV cache size in GiB (vLLM's VLLM_CPU_KVCACHE_SPACE)

    def __post_init__(self):
        _check(0 < self.gpu_memory_utilization <= 1, ".gpu_memory_utilization", "in (0, 1]",
               self.gpu_memory_utilization)
        _check(self.kv_cache_gb >= 1, ".kv_cache_gb", ">= 1", self.kv_cache_gb)


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    n: int = 8                             # candidates per prompt (group size)
    temperature: float = 1.0               # sampling temperature (training log-probs use the same)
    top_p: float = 1.0                     # nucleus filter (1 = off)
    top_k: int = 0                         # top-k filter (0 = off)
    max_new_tokens: int = 8                # response budget; hitting it is a truncation
    max_retries: int = 1                   # regenerations of a failed sample before its group is dropped
    dtype: str = "fp32"                    # fp32 | bf16: the weights the actor exports to the rollout (checksummed)
    max_staleness: int = 0                 # publications generation may lag the actor (0 = synchronous)
    device: str = "auto"                   # auto | cpu | cuda: where the rollout samples (auto: cuda when available)
    lane: str = resumable("thread")        # thread | process: the rollout role in its own process (docs/async.md)
    partial: str = "finish"                # k >= 1, a publication mid-generation: finish (old version) | switch (new)
    max_rows: int = 0                      # rows decoding at once (0 = all of a call; vLLM: 256); more wait, admitted
                                           # as rows finish (rollout/scheduler.py; vLLM's max_num_seqs)
    backend: str = "auto"                  # auto | native | vllm: the sampling engine (auto: vllm on cuda if installed)
    vllm: VllmConfig = field(default_factory=VllmConfig)   # rollout.backend=vllm: vLLM's engine settings

    def __post_init__(self):
        _check(self.n >= 1, "rollout.n", ">= 1", self.n)
        _check(self.temperature > 0, "rollout.temperature", "> 0", self.temperature)
        _check(0 < self.top_p <= 1, "rollout.top_p", "in (0, 1]", self.top_p)
        _check(self.top_k >= 0, "rollout.top_k", ">= 0", self.top_k)
        _check(self.max_new_tokens >= 1, "rollout.max_new_tokens", ">= 1", self.max_new_tokens)
        _check(self.dtype in ("fp32", "bf16"), "rollout.dtype", "fp32 | bf16", self.dtype)
        _check(self.device in DEVICES, "rollout.device", " | ".join(DEVICES), self.device)
        _check(self.max_staleness >= 0, "rollout.max_staleness", ">= 0 (0 = synchronous)", self.max_staleness)
        _check(self.lane in ("thread", "process"), "rollout.lane", "thread or process", self.lane)
        _check(self.partial in ("finish", "switch"), "rollout.partial", "finish or switch", self.partial)
        _check(self.max_rows >= 0, "rollout.max_rows", ">= 0 (0 = every row of a call at once)", self.max_rows)
        _check(self.backend in ROLLOUT_BACKENDS, "rollout.backend", " | ".join(ROLLOUT_BACKENDS), self.backend)


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    name: str = "grpo"                     # one of algos.ADVANTAGE_ESTIMATORS (grpo, ppo, opo, ...; docs/from-verl.md)
    gamma: float = 1.0                     # discount (PPO/GAE, REINFORCE++)
    lam: float = 0.95                      # GAE lambda (PPO)
    kl_coef: float = 0.0                   # KL coefficient; 0 loads no reference model
    kl_in: str = "loss"                    # loss | reward (shaped token rewards)
    kl_estimator: str = "k3"               # k1 | abs | k2 | k3 | k1+ | k3+ | abs+ (+: straight-through)
    kl_target: float = 0.0                 # > 0: adaptive KL controller towards this KL (Ziegler et al.)
    kl_horizon: int = 10000                # adaptive controller horizon (samples; each step moves beta by <= 20%)
    whiten_advantages: bool = False        # whiten advantages over the batch (explicit option)
    old_log_prob: str = "recompute"        # recompute (actor forward before any update) | bypass (= rollout)
    correction: str = "none"               # none | token_is | seq_is | token_reject | seq_reject (recompute only)
    correction_threshold: float = 2.0      # IS cap, or rejection threshold
    mismatch_tol: float = 0.0              # max |current - rollout| log-prob per token at the first step, else stop
    mismatch_action: str = "stop"          # past mismatch_tol: stop the run | drop_group (before the seal)
    reward_error: str = "drop_group"       # drop_group | retry | penalty
    reward_error_penalty: float = 0.0      # score given to an errored sample when reward_error=penalty
    overlong: str = "none"                 # none | mask (truncated responses get no loss) | soft
    overlong_buffer: int = 4               # soft penalty ramps over the last this-many tokens
    overlong_penalty: float = 1.0          # maximal soft penalty
    dynamic_sampling: bool = False         # DAPO: filter zero-variance groups, over-sample prompts to refill
    max_sampling_rounds: int = 3           # dynamic sampling: generation rounds per iteration, the first included

    def __post_init__(self):
        _check_one_of(self.name, "ADVANTAGE_ESTIMATORS", "algorithm.name")
        _check(0 <= self.gamma <= 1, "algorithm.gamma", "in [0, 1]", self.gamma)
        _check(0 <= self.lam <= 1, "algorithm.lam", "in [0, 1]", self.lam)
        _check(self.kl_coef >= 0, "algorithm.kl_coef", ">= 0", self.kl_coef)
        _check(self.kl_in in ("loss", "reward"), "algorithm.kl_in", "loss or reward", self.kl_in)
        _check_one_of(self.kl_estimator, "KL_ESTIMATORS", "algorithm.kl_estimator")
        _check(self.old_log_prob in ("recompute", "bypass"), "algorithm.old_log_prob",
               "recompute or bypass", self.old_log_prob)
        _check_one_of(self.correction, "CORRECTIONS", "algorithm.correction")
        _check(self.kl_target >= 0, "algorithm.kl_target", ">= 0 (0 = fixed kl_coef)", self.kl_target)
        _check(self.mismatch_tol >= 0, "algorithm.mismatch_tol", ">= 0 (0 = no tolerance)", self.mismatch_tol)
        _check(self.mismatch_action in ("stop", "drop_group"), "algorithm.mismatch_action", "stop | drop_group",
               self.mismatch_action)
        if self.mismatch_action == "drop_group" and not self.mismatch_tol:
            raise ConfigError("algorithm.mismatch_action=drop_group needs algorithm.mismatch_tol > 0 (the per-token "
                              "gap past which a group is dropped)", "algorithm.mismatch_tol")
        _check(self.kl_horizon >= 1, "algorithm.kl_horizon", ">= 1", self.kl_horizon)
        if self.kl_target > 0 and self.kl_coef == 0:  # beta 0 stays 0, and no reference is loaded
            raise ConfigError("algorithm.kl_target > 0 needs algorithm.kl_coef > 0 (the controller's initial beta)")
        # Refused rather than given a meaning: bypass makes old = rollout, so the weights would
        # be exactly 1 and nothing rejected. The PPO ratio pi/pi_rollout (clipped) is already
        # the correction towards the behaviour policy there (docs/metrics.md, correction).
        if self.old_log_prob == "bypass" and self.correction != "none":
            raise ConfigError(f"algorithm.correction={self.correction} needs algorithm.old_log_prob=recompute: "
                              "with bypass the old log-probs are the rollout log-probs, so it would correct nothing")
        _check(self.reward_error in ("drop_group", "retry", "penalty"), "algorithm.reward_error",
               "drop_group | retry | penalty", self.reward_error)
        _check(self.overlong in ("none", "mask", "soft"), "algorithm.overlong", "none | mask | soft", self.overlong)
        _check(self.max_sampling_rounds >= 1, "algorithm.max_sampling_rounds", ">= 1", self.max_sampling_rounds)


@dataclass(kw_only=True, slots=True)
class LoraConfig:  # actor.lora, the critic's too (models/lora.py): a peft LoRA adapter on a frozen base
    rank: int = 0                          # LoRA rank r (0 = off: every weight is trained)
    alpha: float = 32.0                    # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0                   # dropout on the adapter's input (training only)
    target_modules: str = "all-linear"     # comma list (or YAML list) of module names | all-linear (not lm_head)

    def __post_init__(self):
        _check(self.rank >= 0 and self.alpha > 0 and 0 <= self.dropout < 1, "lora", "rank >= 0, alpha > 0, "
               "dropout in [0, 1)", f"rank={self.rank} alpha={self.alpha} dropout={self.dropout}")


@dataclass(kw_only=True, slots=True)
class ActorConfig:
    lr: float = 1e-4                       # AdamW learning rate
    weight_decay: float = 0.0              # AdamW weight decay
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    adam_eps: float = 1e-8                 # AdamW epsilon
    warmup_steps: int = 0                  # linear warm-up (optimizer steps; the critic's too)
    lr_schedule: str = "constant"          # constant | cosine | linear (decay after warm-up)
    min_lr_ratio: float = 0.0              # floor of the decay, as a fraction of lr
    ppo_epochs: int = 1                    # passes over the iteration's experience
    mini_batch_size: int = 0               # samples per optimizer step (0 = the whole batch)
    micro_batch_size: int = 0              # samples per forward/backward (gradient accumulation); 0 = whole
                                           # groups up to 8192 tokens (run.exact: 64 samples); roles/common.py
    grad_clip: float = 1.0                 # max global grad norm (0 = off)
    loss: str = "clip"                     # clip (PPO/GRPO/DAPO) | gspo | pg | sapo | cispo | gmpo | clip_cov | kl_cov
    loss_agg: str = "token-mean"           # one of algos.AGG_MODES (token-mean, seq-mean-token-mean, ...)
    clip_low: float = 0.2                  # PPO ratio lower clip (1 - clip_low)
    clip_high: float = 0.2                 # PPO ratio upper clip (1 + clip_high); > clip_low = clip-higher
    dual_clip: float = 0.0                 # dual-clip constant c > 1 (0 = off)
    entropy_coef: float = 0.0              # entropy bonus
    sapo_tau_pos: float = 1.0              # loss=sapo: gate temperature where A > 0 (sapo_tau_neg: A < 0)
    sapo_tau_neg: float = 1.05
    cov_ratio: float = 2e-4                # loss=clip_cov | kl_cov: share of tokens selected by covariance
    clip_cov_bounds: tuple[float, float] = (1.0, 5.0)  # loss=clip_cov: covariance window (lb, ub) of candidates
    kl_cov_coef: float = 1.0               # loss=kl_cov: coefficient of |log ratio| on the selected tokens
    lora: LoraConfig = field(default_factory=LoraConfig)  # actor.lora.rank > 0: train a LoRA adapter only
    max_tokens_per_micro_batch: int = 0    # token budget per micro-batch, balanced (0 = by count); models/packing.py
    logit_chunk_tokens: int = 0            # LM head this many tokens at a time, logits recomputed in the backward
                                           # (less memory, one matmul more; 0 = the run's path: roles/common.py)
    gradient_checkpointing: bool = False   # recompute layer activations in the backward (less memory; the critic's too)
    dtype: str = "fp32"                    # fp32 | bf16: autocast compute, fp32 master weights + AdamW; bf16 reference
    device: str = "auto"                   # auto | cpu | cuda: the actor's model and passes (auto: cuda when available)

    def __post_init__(self):
        _check(self.lr > 0, "actor.lr", "> 0", self.lr)
        for key in ("max_tokens_per_micro_batch", "logit_chunk_tokens"):
            _check(getattr(self, key) >= 0, f"actor.{key}", ">= 0 (0 = off)", getattr(self, key))
        _check(self.dtype in ("fp32", "bf16"), "actor.dtype", "fp32 | bf16", self.dtype)
        _check(self.device in DEVICES, "actor.device", " | ".join(DEVICES), self.device)
        _check(self.lr_schedule in ("constant", "cosine", "linear"), "actor.lr_schedule",
               "constant | cosine | linear", self.lr_schedule)
        _check(self.ppo_epochs >= 1, "actor.ppo_epochs", ">= 1", self.ppo_epochs)
        _check(self.micro_batch_size >= 0, "actor.micro_batch_size", ">= 0 (0 = by tokens)", self.micro_batch_size)
        _check(self.mini_batch_size >= 0, "actor.mini_batch_size", ">= 0", self.mini_batch_size)
        _check_one_of(self.loss, "POLICY_LOSSES", "actor.loss")
        _check_one_of(self.loss_agg, "AGG_MODES", "actor.loss_agg")
        _check(self.dual_clip == 0 or self.dual_clip > 1, "actor.dual_clip", "0 or > 1", self.dual_clip)
        _check(0 <= self.clip_low < 1, "actor.clip_low", "in [0, 1)", self.clip_low)
        _check(self.clip_high >= 0, "actor.clip_high", ">= 0", self.clip_high)
        # A ratio clipped to [1, 1] has zero gradient once it leaves 1: no update moves the policy.
        _check(self.loss == "pg" or self.clip_low > 0 or self.clip_high > 0, "actor.clip_high",
               "> 0 when actor.clip_low=0 (a [1, 1] clip range lets no update move the policy)",
               self.clip_high)
        _check(min(self.sapo_tau_pos, self.sapo_tau_neg) > 0, "actor.sapo_tau_pos/neg", "> 0", self.sapo_tau_neg)
        _check(0 < self.cov_ratio <= 1 and self.kl_cov_coef >= 0 and self.clip_cov_bounds[0] < self.clip_cov_bounds[1],
               "actor.cov_ratio/kl_cov_coef/clip_cov_bounds", "in (0, 1], >= 0, (lb < ub)", self.clip_cov_bounds)
        self.betas, self.clip_cov_bounds = tuple(self.betas), tuple(self.clip_cov_bounds)


@dataclass(kw_only=True, slots=True)
class CriticConfig:  # AdamW weight decay/eps, warm-up, LoRA, dtype, device, checkpointing: the actor's keys
    lr: float = 1e-4                       # critic AdamW learning rate (PPO only)
    value_clip: float = 0.0                # value-loss clip (0 = off)
    grad_clip: float = 1.0                 # critic max grad norm (0 = off)
    ppo_epochs: int = 0                    # passes over the iteration's experience (0 = actor.ppo_epochs)
    mini_batch_size: int = -1              # samples per optimizer step (0 = whole batch; -1 = actor.mini_batch_size)
    micro_batch_size: int = 0              # samples per forward/backward (0 = actor.micro_batch_size)

    def __post_init__(self):
        _check(self.lr > 0, "critic.lr", "> 0", self.lr)
        _check(self.ppo_epochs >= 0, "critic.ppo_epochs", ">= 0 (0 = actor.ppo_epochs)", self.ppo_epochs)
        _check(self.mini_batch_size >= -1, "critic.mini_batch_size", ">= -1 (-1 = actor.mini_batch_size)",
               self.mini_batch_size)
        _check(self.micro_batch_size >= 0, "critic.micro_batch_size", ">= 0 (0 = actor.micro_batch_size)",
               self.micro_batch_size)


@dataclass(kw_only=True, slots=True)
class ReferenceConfig:   # the frozen KL anchor (algorithm.kl_coef > 0); its weights' dtype is actor.dtype
    device: str = "auto"                   # auto | cpu | cuda (auto: cuda when available); with LoRA the actor's

    def __post_init__(self):
        _check(self.device in DEVICES, "reference.device", " | ".join(DEVICES), self.device)


REWARD_BUILTINS = ("auto", "arith", "countdown", "math", "format", "code_exec", "reward_model", "tool_answer", "guess")


@dataclass(kw_only=True, slots=True)
class RewardConfig:  # docs/rewards.md; components and route are checked by sealrl.rewards.from_config
    fn: str = "auto"                       # REWARD_BUILTINS | pkg.module:function | path/file.py:function (from CWD)
    components: list = field(default_factory=list)  # [{fn, weight, name?}]: total = sum weight * value (not with fn)
    route: dict = field(default_factory=dict)  # {data_source: fn}: that source's samples scored by that fn alone
    num_scorers: int = resumable(0)        # scorer processes (0 = in-process, no deadline)
    timeout_s: float = resumable(10.0)     # per-call deadline in worker processes
    scorer_memory_mb: int = resumable(0)   # address-space limit of each scorer process (0 = none)
    stream: bool = resumable(False)        # score each sample as it finishes, while others generate (num_scorers >= 1)
    format_pattern: str = ""               # fn=format: regex the whole answer must match (1.0, else 0.0)
    model_path: str = ""                   # fn=reward_model: HF sequence classifier folder, num_labels=1
    sandbox_wall_s: float = 5.0            # fn=code_exec: wall-clock seconds per test run
    sandbox_cpu_s: int = 2                 # fn=code_exec: CPU seconds per test run
    sandbox_memory_mb: int = 256           # fn=code_exec: address-space limit per test run
    sandbox_max_processes: int = 8         # fn=code_exec: processes per test run

    def __post_init__(self):
        _check(self.fn in REWARD_BUILTINS or ":" in self.fn, "reward.fn", f"{' | '.join(REWARD_BUILTINS)}, "
               "package.module:function or path/file.py:function", self.fn)
        _check(self.timeout_s > 0, "reward.timeout_s", "> 0", self.timeout_s)
        _check(self.scorer_memory_mb >= 0, "reward.scorer_memory_mb", ">= 0 (0 = no limit)", self.scorer_memory_mb)


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    num: int = resumable(500)              # held-out problems evaluated (a generated task makes this many)
    pass_k: int = resumable(1)             # k of pass@k (k > 1 samples at rollout.temperature; 1 = greedy)


def ray_resources(text: str, key: str) -> dict[str, float]:
    """`name=amount,...` (placement.replica_resources / rank_resources) as Ray's custom
    resources of one bundle; CPUs and GPUs have keys of their own."""
    out: dict[str, float] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, amount = item.partition("=")
        try:
            value = float(amount) if eq else -1.0
        except ValueError:
            value = -1.0
        _check(bool(name.strip()) and value > 0, key, "name=amount,... with amounts > 0 (e.g. rollout_node=1)", text)
        _check(name.strip() not in ("CPU", "GPU", "memory", "object_store_memory"), key,
               "custom resources only (CPUs and GPUs: placement.cpus_per_* / gpus_per_replica)", text)
        out[name.strip()] = value
    return out


@dataclass(kw_only=True, slots=True)
class PlacementConfig:
    # Placement may change on resume (DESIGN section 2: it does not change the samples; the
    # ranks' sums round differently, so weights match the uninterrupted run within rounding)
    backend: str = resumable("local")      # local (in-process) | ray (rollout replicas as Ray actors)
    address: str = resumable("")           # "" = sealrl starts a local Ray; "auto" or host:port = a running cluster
    num_cpus: int = resumable(0)           # CPUs of a local Ray (0 = all of this machine)
    rollout_replicas: int = resumable(1)   # standalone rollout replicas (placement.backend=ray)
    cpus_per_replica: float = resumable(1.0)  # CPUs reserved per rollout replica
    rollout_pool: str = resumable("standalone")  # standalone (own Ray bundles) | colocated (replica k on bundle k)
    timeout_s: float = resumable(300.0)    # deadline of every remote call
    actor_ranks: int = resumable(1)        # data-parallel actor ranks (> 1: Ray actors in one gloo/nccl group)
    critic_ranks: int = resumable(1)       # data-parallel critic ranks (PPO; > 1 as for the actor)
    dp_strategy: str = resumable("fsdp2")  # data-parallel ranks: fsdp2 (sharded; allreduce without FSDP2) | allreduce
    strategy: str = resumable("pack")      # Ray placement-group strategy of every pool: pack | spread
    cpus_per_rank: float = resumable(1.0)  # CPUs reserved per data-parallel rank (actor and critic)
    gpus_per_replica: float = resumable(0.0)  # GPUs per rollout replica (> 0 allows rollout.device=cuda on Ray)
    replica_resources: str = resumable("")  # custom Ray resources per replica, "name=amount,...", e.g. rollout_node=1
    rank_resources: str = resumable("")    # the same per data-parallel rank: where the ranks may go
    head_grace_s: float = resumable(30.0)  # the Ray head unreachable this long: a named stop (exit 2)
    reference: str = resumable("driver")   # where the KL reference runs: driver | ray (its own Ray actor)
    scorers: str = resumable("driver")     # where the reward scorers run: driver | ray (a Ray actor and its node)

    def __post_init__(self):
        _check(self.backend in ("local", "ray"), "placement.backend", "local or ray", self.backend)
        _check(self.strategy in ("pack", "spread"), "placement.strategy", "pack or spread", self.strategy)
        _check(self.cpus_per_rank > 0, "placement.cpus_per_rank", "> 0", self.cpus_per_rank)
        _check(self.reference in ("driver", "ray"), "placement.reference", "driver or ray", self.reference)
        _check(self.reference == "driver" or self.backend == "ray", "placement.reference",
               "driver unless placement.backend=ray", self.reference)
        _check(self.scorers in ("driver", "ray"), "placement.scorers", "driver or ray", self.scorers)
        _check(self.scorers == "driver" or self.backend == "ray", "placement.scorers",
               "driver unless placement.backend=ray", self.scorers)
        _check(self.gpus_per_replica >= 0, "placement.gpus_per_replica", ">= 0", self.gpus_per_replica)
        _check(0 < self.head_grace_s < 60, "placement.head_grace_s", "> 0 and < 60 (Ray's own client aborts at 60 s)",
               self.head_grace_s)
        for key in ("replica_resources", "rank_resources"):
            ray_resources(getattr(self, key), f"placement.{key}")
        for key in ("actor_ranks", "critic_ranks"):
            n = getattr(self, key)
            _check(n >= 1, f"placement.{key}", ">= 1", n)
            _check(n == 1 or self.backend == "ray", f"placement.{key}", "1 unless placement.backend=ray", n)
        _check(self.dp_strategy in ("fsdp2", "allreduce"), "placement.dp_strategy", "fsdp2 or allreduce",
               self.dp_strategy)
        _check(self.rollout_replicas >= 1, "placement.rollout_replicas", ">= 1", self.rollout_replicas)
        _check(self.rollout_pool in ("standalone", "colocated"), "placement.rollout_pool",
               "standalone or colocated", self.rollout_pool)
        _check(self.timeout_s > 0, "placement.timeout_s", "> 0", self.timeout_s)
        # colocated: actor rank k and rollout replica k share bundle k of one pool
        _check(self.rollout_pool == "standalone" or self.actor_ranks in (1, self.rollout_replicas),
               "placement.actor_ranks", "1 or placement.rollout_replicas when placement.rollout_pool="
               "colocated", self.actor_ranks)


@dataclass(kw_only=True, slots=True)
class EnvConfig:   # multi-turn episodes (sealrl/rollout/episodes.py); name=none: single-turn
    name: str = "none"                     # none | calc | guess | package.module:Class | file.py:Class
    max_turns: int = 4                     # policy turns per episode (then stop reason max_turns)
    max_tokens: int = 96                   # response tokens per episode, policy + observation (then length)
    max_observation_tokens: int = 32       # an observation is cut to this and marked in its turn
    tool_timeout_s: float = 2.0            # deadline of one tool call (then status timeout)
    def __post_init__(self):
        for key, lo in (("max_turns", 1), ("max_tokens", 1), ("max_observation_tokens", 0), ("tool_timeout_s", 0.001)):
            _check(getattr(self, key) >= lo, f"env.{key}", f">= {lo}", getattr(self, key))


@dataclass(kw_only=True, slots=True)
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reference: ReferenceConfig = field(default_factory=ReferenceConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    def to_dict(self) -> dict:
        return {f.name: {g.name: _plain(getattr(getattr(self, f.name), g.name))
                         for g in fields(getattr(self, f.name))} for f in fields(self)}

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def _plain(v):
    if dataclasses.is_dataclass(v):  # a nested section (actor.lora)
        return {f.name: _plain(getattr(v, f.name)) for f in fields(v)}
    return list(v) if isinstance(v, tuple) else v
