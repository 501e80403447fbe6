"""The iteration's variants, each chosen once at setup from the config (`select`), so the loop
(trainer/pipeline.py, trainer/prepare.py) calls the same hooks whatever the algorithm:

- `resample` (dynamic sampling, variants/dynamic.py): groups without signal filtered out and
  more rounds sampled before the iteration commits; otherwise the scored groups as they are;
- `baselines` (ReMax, variants/remax.py): a greedy response per prompt, its reward the group's
  baseline (a sealed fact); otherwise none;
- `extra_facts` (the optimal-token baseline): each token's sum of squared probabilities under
  the old policy, a sealed fact its advantages read; otherwise nothing;
- `before_seal` (algorithm.mismatch_action=drop_group, variants/mismatch.py): the groups whose
  train-vs-rollout gap passes algorithm.mismatch_tol dropped; otherwise the batch as prepared.

Streamed scoring (variants/streaming.py), partial rollouts (variants/partial.py), multi-turn
episodes (variants/episodes.py) and the generation process (variants/process_lane.py) change
how the rollout is driven, not the iteration's steps: each is chosen by its own key where the
rollout or the lane is built.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def _as_scored(run, it, version, ledger, groups, records, kept, prompt_map, texts, served):
    return kept


def _no_baselines(run, it, version, ledger, kept, prompt_map, served):
    return kept, None


def _no_facts(run, batch, version) -> None:
    return None


def _as_prepared(run, batch, version, produced, it, metrics):
    return batch


def _sum_pi_squared(run, batch, version) -> None:
    from sealrl.experience import Role
    from sealrl.roles.common import batch_sum_pi_squared
    roles = run.roles
    with run.stage("sum_pi_squared", "actor"):
        sq = batch_sum_pi_squared(roles.actor.model, batch, run.cfg.rollout.temperature,
                                  roles.tokenizer.pad_token_id, roles.actor.tf)
        batch.put("sum_pi_squared", sq, Role.ACTOR, version.id)


@dataclass(frozen=True)
class Variants:
    # (run, it, version, ledger, groups, records, kept, prompts, texts, served) -> kept
    resample: Callable = _as_scored
    # (run, it, version, ledger, kept, prompts, served) -> (kept, baselines | None)
    baselines: Callable = _no_baselines
    # (run, batch, version): sealed facts beyond the old log-probs
    extra_facts: Callable = _no_facts
    # (run, batch, version, produced, it, metrics) -> the batch to seal
    before_seal: Callable = _as_prepared


def select(cfg) -> Variants:
    """The hooks `cfg` asks for (module docstring)."""
    hooks = {}
    if cfg.algorithm.dynamic_sampling:
        from sealrl.trainer.variants.dynamic import oversample
        hooks["resample"] = oversample
    if cfg.algorithm.name == "remax":
        from sealrl.trainer.variants.remax import greedy_baselines
        hooks["baselines"] = greedy_baselines
    if cfg.algorithm.name == "optimal_token_baseline":
        hooks["extra_facts"] = _sum_pi_squared
    if cfg.algorithm.mismatch_action == "drop_group":
        from sealrl.trainer.variants.mismatch import drop_mismatched
        hooks["before_seal"] = drop_mismatched
    return Variants(**hooks)
