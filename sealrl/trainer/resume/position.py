"""Saving and restoring the training position (DESIGN section 6) through checkpoint.py:
actor (+critic) weights, optimizers, RNG, version counters, sampler cursor, KL controller,
reference/tokenizer/config/data hashes and, with rollout.max_staleness >= 1, the versions the
generation lane still samples from (retained.py). Experience is never carried across a
checkpoint: checkpoints are taken at iteration boundaries, after the iteration's batch was
consumed, and what the lane had generated ahead is generated again, bitwise, on resume."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from safetensors.torch import load_file

from sealrl import faults
from sealrl.config import Config, config_diff, resumable_keys
from sealrl.experience.store import read_consumed, read_iteration
from sealrl.models.hf import model_config_hash, tokenizer_hash
from sealrl.models.lora import checkpoint_exports, has_lora, load_trainable_state, save_policy, trainable_state
from sealrl.rewards.base import reward_identity
from sealrl.roles.common import optimizer_from_flat, optimizer_to_flat, structure
from sealrl.trainer.adapters import base_hash
from sealrl.trainer.resume.checkpoint import (
    CheckpointError,
    StreamedPart,
    fsync_file,
    load_checkpoint,
    prune_checkpoints,
    resume_checkpoint,
    rng_from_flat,
    rng_to_flat,
    save_checkpoint,
)
from sealrl.trainer.resume.retained import lane_position

# Keys that may change between a run and its resumption: those the config declares resumable.
RESUMABLE_KEYS = resumable_keys()
# The run folder's append-only logs: one JSON row per line, each with its iteration.
LOGS = ("metrics.jsonl", "ledger.jsonl", "served.jsonl", "experience/consumed.jsonl")


def save_position(run_dir: Path, iteration: int, cfg: Config, roles, sampler, kl_ctl, data_hash: str,
                  extra: dict, retained: dict | None = None) -> Path:
    """`retained`: Pipeline.retained(iteration), the lane's versions older than the actor's."""
    actor = roles.actor
    lane_parts, lane = lane_position(retained or {}, actor)
    optim_t, optim_meta = streamed_part(actor, "optim")
    tensors = {"actor_model": streamed_part(actor, "model")[0], "actor_optim": optim_t, "rng": rng_to_flat()}
    state = {
        "iteration": iteration, "actor_step": actor.step, "actor_attempt": actor.attempt,
        "actor_skipped": actor.skipped_steps, "actor_optim": optim_meta,
        "sampler": sampler.state_dict(), "kl_controller": kl_ctl.state_dict(),
        "config": cfg.to_dict(), "config_hash": cfg.hash(), "data_hash": data_hash,
        "tokenizer_hash": tokenizer_hash(roles.tokenizer),
        "model_config_hash": model_config_hash(structure(actor).config),
        "reference_version": roles.reference.version.to_json() if roles.reference else None,
        "reward_fn": reward_identity(roles.reward.fn),
        **_base_hashes(roles),
        "experience": "none pending: checkpoint taken after the iteration's batch was consumed",
        "sealed": _consumed_digests(run_dir, iteration),
        "layout": _layout(cfg),   # the tensors are full (logical) tensors: any layout can load them
        **({"lane": lane} if lane["versions"] else {}),
        **extra,
    }
    tensors.update(lane_parts)
    if roles.critic is not None:
        c_t, c_meta = streamed_part(roles.critic, "optim")
        tensors["critic_model"] = streamed_part(roles.critic, "model")[0]
        tensors["critic_optim"] = c_t
        state.update(critic_step=roles.critic.step, critic_skipped=roles.critic.skipped_steps, critic_optim=c_meta)
    # The policy also as a Hugging Face folder (`checkpoints/step_N/model`), loadable by
    # transformers and vLLM as it is (with LoRA: the peft adapter folder, `adapter`, the base
    # never copied); resuming reads actor_model.safetensors.
    sync_logs(run_dir)   # every line this checkpoint covers is durable before it commits
    folder = save_checkpoint(run_dir / "checkpoints", iteration, tensors, state, exports(actor, roles.tokenizer))
    faults.point("after_checkpoint", iteration)
    prune_checkpoints(run_dir / "checkpoints", cfg.run.keep_checkpoints)
    return folder


def streamed_part(role, part: str) -> tuple:
    """(tensors, JSON) of a role's `part` for a checkpoint: "model", its weights (with LoRA the
    adapter only, trainable_state: the frozen base is named by hash), or "optim", its optimizer
    state. A data-parallel group without LoRA streams them from its ranks (the groups' `streamed`),
    so the driver never holds the whole of either; a role in this process flattens its own."""
    if hasattr(role, "streamed") and (part == "optim" or _streams_weights(role)):
        chunks, meta = role.streamed(part)
        return StreamedPart(chunks), meta
    if part == "model":
        return dict(trainable_state(role.model)), None
    return optimizer_to_flat(role.optimizer)


def _streams_weights(role) -> bool:
    """A data-parallel group whose mirror holds no weights (without LoRA: placement/train_group.Replicas)."""
    return hasattr(role, "streamed") and not has_lora(structure(role))


def exports(actor, tokenizer) -> dict:
    """The checkpoint's Hugging Face folder: a group's written from its ranks, a bucket at a time."""
    if _streams_weights(actor):
        return {"model": lambda path: actor.save_pretrained(tokenizer, path)}
    return checkpoint_exports(actor.model, tokenizer)


def save_final_policy(roles, run_dir: Path) -> None:
    """The run's `model/` folder (with LoRA merged, and `adapter/`); a group's from its ranks."""
    if _streams_weights(roles.actor):
        roles.actor.save_pretrained(roles.tokenizer, run_dir / "model")
    else:
        save_policy(roles.actor.model, roles.tokenizer, run_dir)


def _layout(cfg: Config) -> dict:
    """The data-parallel layout a checkpoint was written under (informational: it loads in any)."""
    p = cfg.placement
    return {"actor_ranks": p.actor_ranks, "critic_ranks": p.critic_ranks,
            "dp_strategy": p.dp_strategy if max(p.actor_ranks, p.critic_ranks) > 1 else "none"}


def _consumed_digests(run_dir: Path, iteration: int) -> dict[str, str]:
    """Iteration -> seal digest of every batch consumed before `iteration` (the chain a
    checkpoint commits: a file sealed again afterwards no longer matches it)."""
    lines, _ = read_consumed(run_dir / "experience")
    return {str(it): rows[-1]["seal_digest"] for it, rows in sorted(lines.items())
            if it < iteration and rows[-1].get("seal_digest")}


def restore_position(run_dir: Path, cfg: Config, roles, sampler, kl_ctl, data_hash: str) -> dict | None:
    """Load the latest committed checkpoint into the roles; None when there is none.
    Refuses (CheckpointError with a diff) a checkpoint of another model, tokenizer, dataset or
    an incompatible config."""
    folder = resume_checkpoint(run_dir / "checkpoints")   # falls back to the newest intact one, said
    if folder is None:
        return None
    parts = ["actor_model", "actor_optim", "rng"] + (["critic_model", "critic_optim"] if roles.critic else [])
    tensors, state = load_checkpoint(folder, parts)
    changes = resume_changes(state, cfg, roles, data_hash)
    if changes:
        raise CheckpointError(f"cannot resume from {folder}: " + "; ".join(changes))
    if state.get("layout", _layout(cfg)) != _layout(cfg):
        print(f"sealrl: resuming {folder.name}, written with {state['layout']}, under {_layout(cfg)}: the full "
              "tensors are cut for the new layout; the weights then follow the uninterrupted run within the "
              "ranks' rounding, not bitwise", file=sys.stderr, flush=True)
    actor = roles.actor
    load_trainable_state(actor.model, tensors["actor_model"])
    optimizer_from_flat(actor.optimizer, tensors["actor_optim"], state["actor_optim"])
    actor.set_counters(step=state["actor_step"], attempt=state["actor_attempt"], skipped_steps=state["actor_skipped"])
    if roles.critic is not None:
        load_trainable_state(roles.critic.model, tensors["critic_model"])
        optimizer_from_flat(roles.critic.optimizer, tensors["critic_optim"], state["critic_optim"])
        roles.critic.set_counters(step=state["critic_step"], skipped_steps=state.get("critic_skipped", 0))
    sampler.load_state_dict(state["sampler"])
    kl_ctl.load_state_dict(state["kl_controller"])
    rng_from_flat(tensors["rng"])
    return {**state, "folder": str(folder)}


def resume_changes(state: dict, cfg: Config, roles, data_hash: str) -> list[str]:
    """What differs between a checkpoint's run and this one, as `key: old -> new` lines: the
    config (except its resumable keys), the tokenizer, architecture, training data, reference
    model version and reward function identity. Empty when the resume may go ahead."""
    changes = [line for line in config_diff(state["config"], cfg.to_dict())
               if tuple(line.split(":")[0].split(".", 1)) not in RESUMABLE_KEYS]
    for key, now in (("tokenizer_hash", tokenizer_hash(roles.tokenizer)),
                     ("model_config_hash", model_config_hash(structure(roles.actor).config)),
                     ("data_hash", data_hash)):
        if state[key] != now:
            changes.append(f"{key}: {state[key]} -> {now}")
    ref = roles.reference.version.to_json() if roles.reference else None
    changes += _nested_diff("reference_version", _json(state["reference_version"]), _json(ref))
    changes += _nested_diff("reward_fn", state.get("reward_fn"), reward_identity(roles.reward.fn))
    for key, now in _base_hashes(roles).items():   # LoRA: the adapter was trained on this base
        if state.get(key) != now:
            changes.append(f"{key}: {state.get(key)} -> {now}")
    return changes


def _base_hashes(roles) -> dict[str, str]:
    """LoRA: {actor_base_hash, critic_base_hash} of the models with an adapter (empty without)."""
    models = {"actor_base_hash": structure(roles.actor),
              "critic_base_hash": structure(roles.critic) if roles.critic else None}
    return {k: h for k, m in models.items() if m is not None and (h := base_hash(m)) is not None}


def _json(text: str | None):
    return None if text is None else json.loads(text)


def _nested_diff(prefix: str, old, new) -> list[str]:
    """`prefix.key.sub: old -> new` for every leaf that differs (a missing record is a change)."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [line for key in sorted(set(old) | set(new))
                for line in _nested_diff(f"{prefix}.{key}", old.get(key), new.get(key))]
    return [] if old == new else [f"{prefix}: {old!r} -> {new!r}"]


def forget_after(run_dir: Path, iteration: int) -> None:
    """On resume from the checkpoint at `iteration`: drop the lines later iterations wrote
    before the crash (metrics, ledger, served and consumed lines). They were never committed by a
    checkpoint and the resumed run writes them again. Their sealed experience files stay: the
    resumed run seals the same facts and does not write them twice (prepare.seal).

    A torn last line (a crash or a full disk mid-append) is one of those: the lines a checkpoint
    commits are fsynced before it (sync_logs), so only what came after can be torn. It is
    dropped and said on stderr; a line that cannot be read anywhere else is damage, refused
    naming the file and line."""
    for name in LOGS:
        path = run_dir / name
        if path.is_file():
            keep = [line for line in _readable_lines(path) if json.loads(line)["iteration"] < iteration]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in keep))
            fsync_file(tmp)
            os.replace(tmp, path)


def _readable_lines(path: Path) -> list[str]:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("iteration"), int):
                raise ValueError("no iteration number")
        except ValueError as e:
            if i == len(lines) - 1:
                print(f"sealrl: {path}: its last line is torn ({len(line)} characters, written after the "
                      "last checkpoint); dropped", file=sys.stderr, flush=True)
                return lines[:-1]
            raise CheckpointError(f"{path}: line {i + 1} is not a JSON row with an iteration ({e}); "
                                  "this file was damaged, not torn by a crash: restore it or remove the "
                                  "line") from None
    return lines


def sync_logs(run_dir: Path) -> None:
    """Make the append-only logs durable: called before a checkpoint commits, so that the lines
    it covers can never be lost or torn by a crash after it."""
    for name in (*LOGS, "trace.json"):
        if (run_dir / name).is_file():
            fsync_file(run_dir / name)


def forget_sealed_after(run_dir: Path, iteration: int) -> None:
    """At the end of a run that stopped before `iteration`: the experience files of later
    iterations were sealed before a resume and never consumed by this run; they go."""
    for f in [*(run_dir / "experience").glob("iter_*.parquet"), *(run_dir / "quarantine").glob("iter_*.jsonl")]:
        if int(f.stem.split("_")[1]) >= iteration:
            f.unlink()


def sealed_before(path: Path, batch) -> bool:
    """True when `path` already holds `batch`'s sealed facts: an iteration sealed before a crash
    and re-derived by the resumed run, which then does not write it again. A file that differs
    (a resume that is not exact) or cannot be read is replaced, and said on stderr."""
    if not path.is_file():
        return False
    try:
        if read_iteration(path).seal_digest == batch.seal_digest:
            return True
        why = "holds other facts than the resumed run's"
    except Exception as e:  # noqa: BLE001 - any unreadable file is replaced, named
        why = f"cannot be read ({type(e).__name__}: {e})"
    print(f"sealrl: {path} (sealed before the resume) {why}; replaced", file=sys.stderr, flush=True)
    return False


def checkpoint_model_state(folder: Path) -> dict:
    """Actor weights of a committed checkpoint (for `sealrl eval` on a checkpoint)."""
    load_checkpoint(folder, [])
    return load_file(str(folder / "actor_model.safetensors"))

