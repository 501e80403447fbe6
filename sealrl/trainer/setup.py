"""Everything the driver needs before its loop: the run folder, data, reward function, roles,
and the one context object (`Run`) the iteration's stages share. Kept apart from the loop so
that the loop reads like the state machine."""
from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml

from sealrl.config import Config, ConfigError
from sealrl.config.rollout_backend import check_rollout_backend, resolve_rollout_backend
from sealrl.config.sections import ray_resources
from sealrl.data.dataset import PromptSet, load_prompts, prompts_from_rows
from sealrl.data.sampler import PromptSampler
from sealrl.data.tasks import EMBEDDED_TASK, make_task
from sealrl.experience import SamplingContract, digest
from sealrl.models.hf import load_causal_lm, model_config_hash, padding_id, tokenizer_hash
from sealrl.obs.timeline import StageTimer
from sealrl.roles.actor import Actor
from sealrl.roles.common import EXACT_MICRO, teacher_forcing
from sealrl.roles.critic import Critic
from sealrl.roles.reference import Reference
from sealrl.roles.reward import Reward
from sealrl.roles.rollout import Rollout
from sealrl.rollout.vllm_engine import VllmOptions
from sealrl.seams.rollout import RolloutClient
from sealrl.sync.manifest import build_manifest
from sealrl.trainer import adapters
from sealrl.trainer.state import Phase, StateMachine
from sealrl.trainer.variants import Variants
from sealrl.trainer.variants import select as select_variants
from sealrl.trainer.watchdog import Watchdog

# ---- run folder ---------------------------------------------------------------------------

def open_run_dir(cfg: Config) -> Path:
    """runs/<name>, refusing names or links that would escape the output folder."""
    base = Path(cfg.run.output_dir).resolve()
    run_dir = base / cfg.run.name
    if run_dir.is_symlink():
        raise ConfigError(f"run folder {run_dir} is a symbolic link; refusing to write through it")
    if run_dir.resolve().parent != base:
        raise ConfigError(f"run.name {cfg.run.name!r} escapes the output folder {base}")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def lock_run_dir(run_dir: Path):
    """An exclusive lock held for the whole run, so two processes never interleave their
    iterations in one folder. Released by the OS however the process ends."""
    import fcntl
    handle = open(run_dir / ".lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        raise ConfigError(f"run folder {run_dir} is in use by another process "
                          f"(pid {handle.read().strip() or '?'}): wait for it to end (or stop it: SIGTERM "
                          "commits a checkpoint), then resume=auto continues this run; or choose another "
                          "run.name for a new one") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def write_placement(run_dir: Path) -> None:
    """placement.json: the node, host, pid, torch and sealrl of the driver and of every Ray worker
    of the run, by role and worker index, as placed at start and after each iteration (a replaced
    worker's entry is where its replacement runs). Not written without Ray."""
    from sealrl.placement.workers import HOSTS, host_info
    if HOSTS:
        text = json.dumps({"driver": host_info(), "workers": [HOSTS[k] for k in sorted(HOSTS)]}, indent=1)
        path = run_dir / "placement.json"
        if not path.exists() or path.read_text() != text:   # a replaced worker: where it is now
            path.write_text(text)


def write_run_files(run_dir: Path, cfg: Config, seeds: dict, extra: dict) -> None:
    """config.yaml (effective config + hash) and run.json (reproducibility metadata)."""
    (run_dir / "config.yaml").write_text(
        f"# config hash: {cfg.hash()}\n" + yaml.safe_dump(cfg.to_dict(), sort_keys=True))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    import transformers
    meta = {"config_hash": cfg.hash(), "code_commit": commit or "unknown",
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "platform": platform.platform(),
            "torch_threads": torch.get_num_threads(), "placement": cfg.to_dict()["placement"],
            "seeds": seeds, "packages": installed_packages(), **extra}
    (run_dir / "run.json").write_text(json.dumps(meta, indent=1, sort_keys=True))


def installed_packages() -> dict[str, str]:
    """name -> version of every distribution installed in this interpreter's environment."""
    found = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:   # a broken install can leave a dist-info folder without metadata
            found.setdefault(name, dist.version)   # the first on sys.path is the one imported
    return dict(sorted(found.items(), key=lambda kv: kv[0].lower()))


def make_deterministic(cfg: Config) -> None:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # deterministic cuBLAS (no effect on CPU)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    torch.manual_seed(cfg.run.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


# ---- data ---------------------------------------------------------------------------------

@dataclass
class Data:
    train: PromptSet
    eval: PromptSet
    hash: str   # identity of the training prompts, checked on resume


def build_data(cfg: Config, tokenizer) -> Data:
    d = cfg.data
    kw = dict(max_prompt_tokens=d.max_prompt_tokens, use_chat_template=d.use_chat_template,
              on_bad_row=d.on_bad_row)
    if d.task == "file":
        train = load_prompts(d.train_file, tokenizer, **kw)
        evals = load_prompts(d.eval_file, tokenizer, **kw) if d.eval_file else PromptSet([], "none")
    elif d.task == "arith":
        train = prompts_from_rows(EMBEDDED_TASK.train_rows(d.num_train, cfg.run.seed), tokenizer,
                                  source="arith-train", **kw)
        evals = prompts_from_rows(EMBEDDED_TASK.eval_rows(), tokenizer, source="arith-test", **kw)
    else:
        train = prompts_from_rows(make_task(d.task, "train", d.num_train, cfg.run.seed), tokenizer,
                                  source=f"{d.task}-train", **kw)
        evals = prompts_from_rows(make_task(d.task, "test", cfg.eval.num, 1234), tokenizer,
                                  source=f"{d.task}-test", **kw)
    if not len(train):
        raise ConfigError(f"no usable training prompts in {train.source}")
    if d.task == "file" and d.eval_file and not len(evals):
        raise ConfigError(f"no usable eval prompts in {evals.source}")
    data_hash = digest([(p.prompt_id, p.token_ids) for p in train.prompts])
    return Data(train, evals, data_hash)


def build_sampler(cfg: Config, data: Data) -> PromptSampler:
    return PromptSampler(len(data.train), cfg.data.prompts_per_iter, seed=cfg.run.seed, shuffle=True)


# ---- rewards ------------------------------------------------------------------------------

def build_reward_fn(cfg: Config):
    """The scorer of the `reward` section (sealrl/rewards/from_config.py, docs/rewards.md);
    reward.fn=auto picks the verifier of the task (math-verify for dataset files)."""
    from sealrl.rewards.from_config import build_reward
    return build_reward(cfg.reward, cfg.data.task)


# ---- roles --------------------------------------------------------------------------------

@dataclass
class Roles:
    actor: Actor
    rollout: RolloutClient   # seams/rollout.py: the in-process role, a Ray pool, the generation process
    reward: Reward
    reference: Reference | None
    critic: Critic | None
    tokenizer: object

    closers: list = field(default_factory=list)   # placement resources, closed last
    rollout_base: str | None = None  # LoRA: the hash of the base the rollout pinned (in rollout.dtype)

    def workers(self) -> dict[str, str]:
        """Who does each role's stages, for the trace and failure messages: this process
        (`pid N`), its reward worker processes, or Ray actors."""
        here = f"pid {os.getpid()}"
        scorers = self.reward.num_scorers
        out = {"driver": here, "reference": here,
               "reward": f"{here} + {scorers} scorer processes" if scorers else f"{here} (inline scorer)"}
        if getattr(self.reward, "group", None) is not None:   # placement.scorers=ray
            out["reward"] = f"1 Ray actor (reward 0) + {scorers} scorer processes on its node"
        for name in ("actor", "critic", "rollout"):
            role = getattr(self, name)
            n = getattr(role, "num_workers", None) or getattr(getattr(role, "group", None), "num_workers", None)
            out[name] = f"{n} Ray actors ({name} 0..{n - 1})" if n else here
        pids = getattr(getattr(self.rollout, "group", None), "pids", None)
        if pids:   # rollout.lane=process
            out["rollout"] = f"pid {pids[0]} (generation process)"
        return out

    def close(self) -> None:
        self.reward.close()
        for close in reversed(self.closers):
            close()


def total_optimizer_steps(cfg: Config) -> int:
    per_iter = cfg.data.prompts_per_iter * cfg.rollout.n
    mini = cfg.actor.mini_batch_size or per_iter
    return cfg.run.iterations * cfg.actor.ppo_epochs * -(-per_iter // mini)


def passes(cfg: Config, model):
    """The teacher-forced passes of the run (roles/common.teacher_forcing): the fast path for
    `model`, or with run.exact the HF reference path; said once on stderr."""
    tf = teacher_forcing(cfg.actor, model, cfg.run.exact, cfg.rollout.n)
    print(f"sealrl: teacher-forced passes: {tf.describe()}; AdamW {'default loop' if cfg.run.exact else 'fused'}"
          f"{' (run.exact=true)' if cfg.run.exact else ''}", file=sys.stderr)
    return tf


def build_roles(cfg: Config, run_id: str) -> Roles:
    from sealrl.placement.workers import HOSTS
    HOSTS.clear()   # where this run's Ray workers land (placement.json)
    model, tokenizer = load_causal_lm(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    template, critic_model = model, None   # the rollout's structure; the critic when LoRA made it
    if cfg.actor.lora.rank:
        model, template, critic_model = adapters.wrap_models(cfg, model)
    tok_hash = tokenizer_hash(tokenizer)
    temperature, pad = cfg.rollout.temperature, padding_id(tokenizer, cfg.model.path)
    horizon = cfg.rollout.max_new_tokens
    tf = passes(cfg, model)   # the teacher-forced passes of every role, chosen once
    make_actor = functools.partial(Actor, model, cfg.actor, cfg.algorithm, run_id, tok_hash, temperature,
                                   pad, total_optimizer_steps(cfg), horizon, tf=tf, exact=cfg.run.exact)
    actor = make_actor()
    base = actor.base   # LoRA: the frozen base's manifest (else None)
    closers: list = []
    try:   # a role that cannot start (e.g. a pool no node can hold) releases what was placed before it
        shared = shared_pool(cfg, closers)  # colocated actor ranks and rollout replicas, or None
        if cfg.placement.actor_ranks > 1:
            actor = data_parallel_role(cfg, "actor", make_actor, actor, closers, shared)
        episodes = episode_spec(cfg)
        rows = (cfg.rollout.max_rows, True)   # rollout/scheduler.py: rows admitted as others finish
        vllm = vllm_options(cfg)   # None: the native engine
        if cfg.placement.backend == "ray":
            rollout = ray_rollout_pool(cfg, template, tokenizer, closers, shared, episodes, vllm)
        elif cfg.rollout.lane == "process":   # the role in its own process for the whole run (a pool of one)
            rollout = process_rollout_pool(cfg, template, tokenizer, episodes, rows, vllm)
        else:
            rollout = Rollout(template, tokenizer, cfg.rollout.device, episodes=episodes, rows=rows, vllm=vllm)
        if cfg.placement.backend == "local":   # its tool worker, vLLM's engine process, or its process
            closers.append(rollout.close)
        rollout_base = None
        if base is not None:   # LoRA: each version is an adapter on this base, in rollout.dtype (pinned everywhere)
            rollout_base = rollout.pin_base(*adapters.pinned_base(model, base, cfg.rollout.dtype))
        reference = None
        if cfg.algorithm.kl_coef > 0 and base is not None:   # LoRA: the base with the adapter off, no copy
            ref_version = dataclasses.replace(base.version, run_id="reference:base-adapter-off")
            make_reference = functools.partial(Reference, model, ref_version, temperature, pad,
                                               cfg.actor.micro_batch_size or EXACT_MICRO, adapter_off=True)
        elif cfg.algorithm.kl_coef > 0:  # no reference model is loaded when the KL coefficient is 0
            state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            ref_version = build_manifest(state, "reference", 0, 0, tok_hash, model_config_hash(model.config)).version
            make_reference = functools.partial(Reference, model, ref_version, temperature, pad, tf.micro_batch_size,
                                               tf=tf, dtype=cfg.actor.dtype, device=cfg.reference.device)
        if cfg.algorithm.kl_coef > 0 and cfg.placement.reference == "ray":
            # its own Ray actor: the frozen copy off the driver (with LoRA, a copy of the base and
            # adapter, used with the adapter off as here)
            from sealrl.placement import train_ray
            from sealrl.placement.remote_reference import ray_reference
            train_ray.start_ray(cfg.placement, closers)
            reference = ray_reference(make_reference, ref_version, cfg.placement, cfg.reference.device == "cuda",
                                      closers)
        elif cfg.algorithm.kl_coef > 0:
            reference = make_reference()
        critic = None
        if cfg.algorithm.name == "ppo":
            from sealrl.models.critic import CriticModel
            if critic_model is None:
                torch.manual_seed(cfg.run.seed + 1)
                critic_model = CriticModel.from_causal_lm(model)   # backbone copied from the policy, new head
            c, a = cfg.critic, cfg.actor   # the critic's own batches; the actor's where unset
            micro = c.micro_batch_size or tf.micro_batch_size
            mini = a.mini_batch_size if c.mini_batch_size < 0 else c.mini_batch_size
            make_critic = functools.partial(Critic, critic_model, c, pad, micro, a.loss_agg, horizon,
                                            tf=dataclasses.replace(tf, micro_batch_size=micro),
                                            epochs=c.ppo_epochs or a.ppo_epochs, mini_batch_size=mini,
                                            warmup_steps=a.warmup_steps, checkpointing=a.gradient_checkpointing,
                                            fused=not cfg.run.exact, dtype=a.dtype, device=a.device,
                                            adam_eps=a.adam_eps, weight_decay=a.weight_decay)
            critic = make_critic()
            if cfg.placement.critic_ranks > 1:
                critic = data_parallel_role(cfg, "critic", make_critic, critic, closers)
        reward = reward_role(cfg, closers)
        return Roles(actor, rollout, reward, reference, critic, tokenizer, closers, rollout_base)
    except BaseException:
        for close in reversed(closers):
            close()
        raise


def reward_role(cfg: Config, closers: list):
    """The reward role in this process, or with placement.scorers=ray in a Ray actor of its own
    (placement/remote_reward.py), its scorer processes on that actor's node."""
    if cfg.placement.scorers != "ray":
        return Reward(build_reward_fn(cfg), cfg.reward.num_scorers, cfg.reward.timeout_s, cfg.reward.scorer_memory_mb)
    from sealrl.placement import train_ray
    from sealrl.placement.remote_reward import ray_reward
    train_ray.start_ray(cfg.placement, closers)
    return ray_reward(build_reward_fn(cfg), cfg.reward, cfg.placement, closers)


def vllm_options(cfg: Config) -> VllmOptions | None:
    """rollout.backend resolved (auto said once on stderr): the vLLM engine's options, or None for
    the native engine (config/rollout_backend.py)."""
    if resolve_rollout_backend(cfg) != "vllm":
        return None
    check_rollout_backend(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, backend="vllm")))
    v = cfg.rollout.vllm
    return VllmOptions(dtype=cfg.rollout.dtype, enforce_eager=v.enforce_eager, max_num_seqs=cfg.rollout.max_rows or 256,
                       gpu_memory_utilization=v.gpu_memory_utilization, kv_cache_gb=v.kv_cache_gb)


def shared_pool(cfg: Config, closers: list):
    """With `placement.rollout_pool=colocated` and data-parallel actor ranks: the one Ray pool
    whose bundle k holds actor rank k and rollout replica k (rollout_pool_spec). None otherwise:
    each group then makes its own."""
    p = cfg.placement
    if p.backend != "ray" or p.rollout_pool != "colocated" or p.actor_ranks == 1:
        return None
    from sealrl.placement import train_ray
    from sealrl.placement.workers import RayPool
    train_ray.start_ray(p, closers)
    pool = RayPool(rollout_pool_spec(p), timeout_s=p.timeout_s)
    closers.append(pool.close)
    return pool


def data_parallel_role(cfg: Config, role: str, make_worker, local, closers: list, pool=None):
    """placement.<role>_ranks > 1: the actor or critic as that many data-parallel Ray actors
    in one process group, behind a facade with the worker's interface (placement/train_group.py).
    `local`, built from the same factory, stays here as the mirror of the ranks, its weights on the
    meta device until read.
    `placement.dp_strategy`: fsdp2 shards each rank's model (FSDP2), allreduce replicates it."""
    from sealrl.placement import train_group, train_ray
    train_ray.start_ray(cfg.placement, closers)
    rank, facade = {"actor": (train_group.ActorRank, train_group.ActorGroup),
                    "critic": (train_group.CriticRank, train_group.CriticGroup)}[role]
    deferred = train_ray.sharded_from_rank0(make_worker, cfg.placement.dp_strategy)
    if deferred is None:   # every rank receives the whole model and makes its worker from it
        factory = functools.partial(rank, make_worker, cfg.run.seed, cfg.placement.dp_strategy)
    else:   # a weightless template; rank 0 alone reads the weights and fills every rank's shards
        import ray
        weights = [ray.put(local.model.state_dict())]
        factory = functools.partial(rank, deferred[0], cfg.run.seed, "fsdp2", deferred[1], weights)
    p = cfg.placement
    bundle = {"num_cpus_per_worker": p.cpus_per_rank, "strategy": p.strategy.upper(),
              "resources": ray_resources(p.rank_resources, "placement.rank_resources")}
    group = train_ray.ray_train_group(role, factory, getattr(p, f"{role}_ranks"), local.model,
                                        p.timeout_s, closers, pool if role == "actor" else None, bundle)
    if deferred is not None:   # rank 0 has read it: the object store's copy goes (a lost rank stops the run)
        weights.clear()
    return facade(group, local, cfg.placement.timeout_s)   # its mirror keeps no weights (train_group.Replicas)


def rollout_pool_spec(p):
    """The Ray resource pool of the rollout replicas: `placement.rollout_pool=standalone` gives
    them their own bundles; `colocated` puts replica k on bundle k of the trainer's pool
    ("train": actor + rollout), each role asking for half of the bundle's CPUs. Placement
    never changes the numbers: both give the same experience with the same seeds."""
    from sealrl.placement.workers import pools_from_config
    name, roles = ("rollout", ["rollout"]) if p.rollout_pool == "standalone" else ("train", ["actor", "rollout"])
    resources = ray_resources(p.replica_resources, "placement.replica_resources")
    if p.rollout_pool == "colocated":   # the shared bundle holds a rank too: it asks for both
        for name_, amount in ray_resources(p.rank_resources, "placement.rank_resources").items():
            resources[name_] = resources.get(name_, 0.0) + amount
    return pools_from_config({name: {"roles": roles, "num_workers": p.rollout_replicas,
                                     "num_cpus_per_worker": p.cpus_per_replica,
                                     "num_gpus_per_worker": p.gpus_per_replica, "resources": resources,
                                     "strategy": p.strategy.upper()}})["rollout"]


def episode_spec(cfg: Config):
    """env.name != none: multi-turn episodes against that environment (rollout/episodes.py)."""
    from sealrl.envs import EnvLoadError
    from sealrl.envs.load import env_class, env_source, resolved_name
    from sealrl.rollout.episodes import EpisodeSpec
    e = cfg.env
    if e.name != "none":
        try:
            env_class(e.name)
        except EnvLoadError as err:
            raise ConfigError(str(err), "env.name") from None
    if e.name == "none":
        return None
    name = resolved_name(e.name)   # a file env's code travels in the spec: no node needs the file
    return EpisodeSpec(name, e.max_turns, e.max_tokens, e.max_observation_tokens, e.tool_timeout_s, env_source(name))


def ray_rollout_pool(cfg: Config, template, tokenizer, closers: list, shared=None, episodes=None, vllm=None):
    """placement.backend=ray: `rollout_replicas` RolloutWorkers as Ray actors (standalone or
    colocated: rollout_pool_spec) behind a RolloutPool with the rollout role's interface, so
    the driver loop does not change. Weights reach them only through the two-phase,
    manifest-verified sync; requests are dispatched and joined by sample id; a replica whose
    process dies is replaced and synced to the active version before it serves."""
    from sealrl.placement import train_ray
    from sealrl.placement.rollout_pool import RolloutPool
    from sealrl.placement.workers import RayPool, RayWorkerGroup
    from sealrl.rollout.backends import weightless_template
    p = cfg.placement
    train_ray.start_ray(p, closers)
    spec = rollout_pool_spec(p)
    pool = shared
    if pool is None:
        pool = RayPool(spec, timeout_s=p.timeout_s)
        closers.append(pool.close)
    threads = max(1, int(p.cpus_per_replica / len(spec.roles)))
    # the structure only (weights arrive by sync): nothing of the actor's device is pickled; with
    # LoRA `template` is the plain policy's (the replicas merge each adapter into their pinned base)
    make = functools.partial(Rollout, weightless_template(template), tokenizer, cfg.rollout.device, episodes=episodes,
                             rows=(cfg.rollout.max_rows, True), vllm=vllm)
    group = RayWorkerGroup("rollout", make, pool, timeout_s=p.timeout_s, threads=threads,
                           concurrency=2)   # stage a version while generating (rollout_pool.py)
    rollout = RolloutPool(group, timeout_s=p.timeout_s)
    closers.append(rollout.close)
    return rollout


def process_rollout_pool(cfg: Config, template, tokenizer, episodes=None, rows=None, vllm=None):
    """rollout.lane=process: the rollout role in a process of its own for the whole run, a
    RolloutPool of one worker on a process host (placement/process_group.py), run.threads torch
    threads there; trainer/variants/process_lane.py says how the lane uses it. As for a Ray
    replica, the factory holds the structure only (weights arrive by the verified sync), never
    the actor's live model: a replacement started mid-run pickles it again."""
    from sealrl.placement.process_group import ProcessWorkerGroup
    from sealrl.placement.rollout_pool import RolloutPool
    from sealrl.rollout.backends import weightless_template
    timeout_s = cfg.placement.timeout_s
    make = functools.partial(Rollout, weightless_template(template), tokenizer, cfg.rollout.device, episodes=episodes,
                             rows=rows, vllm=vllm)
    group = ProcessWorkerGroup("rollout", make, 1, timeout_s, threads=torch.get_num_threads(),
                               concurrency=2)   # stage a version while generating, as a Ray replica does
    return RolloutPool(group, timeout_s=timeout_s)


# ---- the context of one run ---------------------------------------------------------------

@dataclass
class Run:
    """What every stage of an iteration reads: the config, the run folder, the roles, the data
    and sampler, the KL controller, the sampling contract, and the state machine with its stage
    timer and watchdog."""
    cfg: Config
    dir: Path
    roles: Roles
    data: Data
    sampler: PromptSampler
    kl_ctl: object
    contract: SamplingContract
    sm: StateMachine
    timer: StageTimer
    watchdog: Watchdog
    variants: Variants = field(default_factory=Variants)   # the iteration's hooks, chosen once (trainer/variants)
    sync_bytes: int = 0   # bytes the last weight sync moved (sync/bytes)
    sync_driver_bytes: int = 0   # of them, what the driver process held (sync/driver_bytes)
    last_weights: dict | None = None   # what the last weight sync published, kept if max_staleness > 0

    @contextmanager
    def stage(self, name: str, role: str):
        """A timed stage (trace.json, time/<name>_s) under the stage deadline."""
        t = self.timer
        with t.stage(name, role), self.watchdog.guard(name, role, t.worker(role), t.iteration, t.version):
            yield

    def to(self, phase: Phase, version: str) -> None:
        """A checked transition of the state machine, marked in the trace."""
        self.sm.to(phase, version)
        self.timer.mark(phase.value, self.sm.active if phase is Phase.CHECKPOINT_DURABLE else version)


def build_run(cfg: Config, run_dir: Path, roles: Roles, data: Data) -> Run:
    from sealrl import algos
    a = cfg.algorithm
    kl_ctl = (algos.AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon) if a.kl_target > 0
              else algos.FixedKLController(a.kl_coef))
    r = cfg.rollout
    contract = SamplingContract(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                max_new_tokens=r.max_new_tokens, stop_token_ids=(roles.tokenizer.eos_token_id,),
                                n=r.n, seed=cfg.run.seed)
    return Run(cfg, run_dir, roles, data, build_sampler(cfg, data), kl_ctl, contract,
               StateMachine(max_staleness=r.max_staleness),
               StageTimer(run_dir / "trace.json", roles.workers()), Watchdog(cfg.run.stage_timeout_s, run_dir),
               select_variants(cfg))
