"""`sealrl recompute RUN_DIR --set algorithm.kl_coef=0.1`: re-derive shaped rewards, advantages
and returns of every sealed iteration under new hyper-parameters, without generating again.

Each stored iteration is rebuilt from its facts only (tokens, masks, rewards, rollout/old/ref
log-probs, values); the rebuilt facts must match the stored seal digest. `derive` (the function
the driver uses) then runs on them with the new `AlgorithmConfig`. Results go beside the
originals:

    runs/<name>/recompute/<tag>/iter_NNNNNN.parquet   facts + re-derived fields
    runs/<name>/recompute/<tag>/recompute.json        overrides, betas, summary of differences

`tag` is --name, or a hash of the overrides. With no override the files hold the originals'
derived tensors bit for bit (tests/test_recompute.py).

Only `algorithm.*` keys and `rollout.max_new_tokens` (the soft overlong penalty) may change;
keys that would need new facts are refused: `algorithm.old_log_prob` and
`algorithm.reward_error` decided which log-probs and samples exist, a KL coefficient needs
stored reference log-probs, and PPO needs stored critic values.

beta per iteration: the driver derives iteration t with the KL controller's beta *before* its
update at t. A fixed controller gives `algorithm.kl_coef`; an adaptive one (kl_target > 0) is
replayed from the facts: beta_0 = kl_coef, then after each iteration
beta <- beta * (1 + clip(KL_t / target - 1, +-0.2) * B_t / horizon), with KL_t the batch's k3
of old vs reference log-probs (what the driver logs as `kl/ref_kl`). Replaying, rather than
reading the logged `kl/beta`, also serves changed kl_coef / kl_target / kl_horizon. The run's
logged `kl/beta` (the beta iteration t used) is kept in the summary next to the replayed value.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from sealrl import algos
from sealrl.config import Config, ConfigError, MissingInputError, config_diff, load_config
from sealrl.experience import ExperienceBatch
from sealrl.experience.fields import FIELDS, Kind
from sealrl.experience.store import CONSUMED, read_iteration, read_table, write_iteration
from sealrl.trainer.derive import derive
from sealrl.trainer.iteration_metrics import ref_kl  # the driver's own function: same numbers by construction

# Keys whose change would need facts the run never produced (another sample set, other log-probs).
_NEEDS_NEW_FACTS = {"algorithm.old_log_prob": "the proximal log-probs are a fact of the run",
                    "algorithm.reward_error": "it decided which samples and groups were kept",
                    "algorithm.dynamic_sampling": "it decided which groups were kept",
                    "algorithm.max_sampling_rounds": "it decided which groups were kept"}
_DERIVED_TENSORS = ("scores", "token_rewards", "advantages", "returns")


def recompute_run(run_dir: str | Path, overrides: list[str], out_name: str | None = None) -> Path:
    """Re-derive every iteration of `run_dir` under `overrides`; returns the output folder."""
    run_dir = Path(run_dir)
    old_cfg = load_config(str(run_dir / "config.yaml"), check_run=False)
    new_cfg = _checked_config(run_dir, overrides)
    files = sorted((run_dir / "experience").glob("iter_*.parquet"))
    if not files:
        raise MissingInputError(f"{run_dir / 'experience'} holds no iteration files")
    tag = out_name or hashlib.sha256("\n".join(sorted(overrides)).encode()).hexdigest()[:12]
    if not tag or "/" in tag or tag.startswith("."):
        raise ConfigError(f"--name must be a plain folder name, got {tag!r}")
    out = run_dir / "recompute" / tag
    logged_beta = _logged_betas(run_dir)
    per_iter = []
    for path, original, batch, beta in rederived(files, new_cfg):
        table, _ = read_table(path)
        extra = {n[len("extra."):]: table.column(n).to_pylist() for n in table.column_names
                 if n.startswith("extra.")}
        extra["recompute_tag"] = [tag] * len(batch)
        write_iteration(out, batch, extra=extra)
        per_iter.append({"iteration": original.iteration, "beta": beta,
                         "beta_logged": logged_beta.get(original.iteration),
                         **_differences(original, batch)})
    consumed = run_dir / "experience" / CONSUMED   # which step consumed each batch: unchanged
    if consumed.is_file():
        shutil.copyfile(consumed, out / CONSUMED)
    summary = {"run_dir": str(run_dir), "tag": tag, "overrides": list(overrides),
               "changed": config_diff(old_cfg.to_dict(), new_cfg.to_dict()),
               "num_iterations": len(files), "max_abs_diff": _max_over(per_iter), "iterations": per_iter}
    (out / "recompute.json").write_text(json.dumps(summary, indent=1))
    return out


def rederived(files: list[Path], cfg: Config):
    """(path, stored batch, its facts re-derived under `cfg`, beta) per iteration file, in
    order; the files must be iterations 0, 1, ... (the adaptive beta is a running product)."""
    kl_ctl = _kl_controller(cfg)
    for expected, path in enumerate(files):
        original = read_iteration(path)
        if original.iteration != expected:
            raise MissingInputError(f"{path.parent}: iteration {expected} is missing (found {path.name})")
        _check_facts(original, cfg)
        batch = facts_only(original)
        beta = kl_ctl.beta
        derive(batch, cfg.algorithm, beta, cfg.rollout.max_new_tokens, f"{cfg.algorithm.name}@{original.iteration}")
        if cfg.algorithm.kl_target > 0:
            kl_ctl.update(ref_kl(batch), len(batch))
        yield path, original, batch, beta


def facts_only(batch: ExperienceBatch) -> ExperienceBatch:
    """A fresh, sealed batch holding only the facts of `batch` (same provenance, same order),
    ready for `derive`. Raises if the copy's digest differs from the stored seal."""
    fresh = ExperienceBatch(batch.run_id, batch.iteration, batch.samples, batch.contract,
                            list(batch.versions.values()))
    fresh.num_response_tokens = batch.num_response_tokens
    facts = [n for n in batch.field_names() if FIELDS[n].kind is Kind.FACT]
    for name in facts:
        producer, version = batch.provenance(name)
        fresh.put(name, batch.get(name), producer, version)
    if fresh.seal(required=facts) != batch.seal_digest:
        raise ValueError(f"iteration {batch.iteration}: facts do not reproduce the stored seal digest")
    return fresh


def _checked_config(run_dir: Path, overrides: list[str]) -> Config:
    for item in overrides:
        key = item.partition("=")[0]
        if not (key.startswith("algorithm.") or key == "rollout.max_new_tokens"):
            raise ConfigError(f"recompute can change only algorithm.* and rollout.max_new_tokens, not {key} "
                              "(other keys would need a new rollout or training run)")
        if key in _NEEDS_NEW_FACTS:
            raise ConfigError(f"recompute cannot change {key}: {_NEEDS_NEW_FACTS[key]}")
    return load_config(str(run_dir / "config.yaml"), overrides, check_run=False)


def _check_facts(batch: ExperienceBatch, cfg: Config) -> None:
    """Refuse hyper-parameters whose derivation needs a fact this run did not record."""
    if cfg.algorithm.kl_coef > 0 and cfg.algorithm.kl_in == "reward" and not batch.has("ref_log_probs"):
        raise ConfigError("algorithm.kl_coef > 0 with kl_in=reward needs reference log-probs, and this run "
                          "loaded no reference model (its kl_coef was 0)")
    if cfg.algorithm.name == "ppo" and not batch.has("values"):
        raise ConfigError("algorithm.name=ppo needs critic values, and this run had no critic")
    for name, fact, what in (("remax", "baseline_scores", "greedy baselines"),
                             ("optimal_token_baseline", "sum_pi_squared", "per-token sums of squared probabilities")):
        if cfg.algorithm.name == name and not batch.has(fact):
            raise ConfigError(f"algorithm.name={name} needs {what} ({fact}), and this run did not record them")


def _kl_controller(cfg: Config):
    a = cfg.algorithm
    return (algos.AdaptiveKLController(a.kl_coef, a.kl_target, a.kl_horizon) if a.kl_target > 0
            else algos.FixedKLController(a.kl_coef))




def _logged_betas(run_dir: Path) -> dict[int, float]:
    from sealrl.obs.metrics import read_metrics
    return {r["iteration"]: r["kl/beta"] for r in read_metrics(run_dir) if "kl/beta" in r}


def _differences(old: ExperienceBatch, new: ExperienceBatch) -> dict:
    """Per iteration: max |new - old| of each derived tensor, advantage sign flips, and how many
    samples sit in zero-variance groups before and after."""
    out: dict = {"max_abs_diff": {}}
    for name in _DERIVED_TENSORS:
        if old.has(name) and new.has(name):
            out["max_abs_diff"][name] = float((new.get(name) - old.get(name)).abs().max()) if len(new) else 0.0
    mask = new.get("response_mask")
    flips = (torch.sign(new.get("advantages")) != torch.sign(old.get("advantages"))) & mask
    out["advantage_sign_flips"] = int(flips.sum())
    out["zero_variance"] = [int(old.get("zero_variance").sum()), int(new.get("zero_variance").sum())]
    return out


def _max_over(rows: list[dict]) -> dict[str, float]:
    keys = {k for r in rows for k in r["max_abs_diff"]}
    return {k: max(r["max_abs_diff"].get(k, 0.0) for r in rows) for k in sorted(keys)}


def add_parser(subparsers) -> None:
    """Register `sealrl recompute RUN_DIR --set key=value ... [--name TAG]`."""
    p = subparsers.add_parser(
        "recompute", help="re-derive rewards, advantages and returns under new hyper-parameters",
        description="Re-derive shaped token rewards, advantages and returns of every stored iteration "
                    "under changed algorithm.* keys (or rollout.max_new_tokens), without generating "
                    "again; writes RUN_DIR/recompute/<tag>/ beside the originals.")
    p.add_argument("run_dir", help="runs/<name>")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="algorithm.* or rollout.max_new_tokens override (repeatable)")
    p.add_argument("--name", default=None, help="output tag (default: a hash of the overrides)")
    p.set_defaults(fn=_run)


def _run(args) -> int:
    out = recompute_run(args.run_dir, args.overrides, args.name)
    summary = json.loads((out / "recompute.json").read_text())
    print(json.dumps({"out": str(out), "changed": summary["changed"], "max_abs_diff": summary["max_abs_diff"]}))
    return 0
