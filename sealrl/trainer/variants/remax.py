"""ReMax's baseline (Li et al. 2023, arXiv:2310.10505): for every prompt that reaches the loss,
one greedy (top-k 1) response from the same policy version, scored by the same reward role. Its
reward total is the baseline of every candidate of the group, recorded in two places: the sealed
fact `baseline_scores` (one value per sample) and the group's ledger row (`baseline`: the greedy
response's text, token count, score and scorer). A group whose greedy response cannot be
generated after the retry limit, or whose reward errors, has no baseline and is dropped with
that reason: never trained against a made-up one.
"""
from __future__ import annotations

import dataclasses

import torch

from sealrl.experience import ExperienceBatch, Role, StopReason
from sealrl.experience.wire import GenerationRequest, RolloutSample, env_input
from sealrl.trainer.collect import reward_item
from sealrl.trainer.ledger import IterationLedger, request_seed


def _greedy(run, it: int, version, kept: dict[str, list[RolloutSample]], prompts: dict, ledger: IterationLedger
            ) -> dict[str, RolloutSample]:
    """group id -> its prompt's greedy response; failed calls are retried up to rollout.max_retries."""
    cfg = run.cfg
    contract = dataclasses.replace(run.contract, top_k=1, top_p=1.0, n=1)
    got: dict[str, RolloutSample] = {}
    for attempt in range(cfg.rollout.max_retries + 1):
        wanted = [g for g in kept if g not in got]
        if not wanted:
            break
        reqs = [GenerationRequest(f"{g}/greedy", tuple(prompts[g].token_ids),
                                  request_seed(cfg.run.seed, it, prompts[g].prompt_id), (0,), env_input(prompts[g]))
                for g in wanted]
        try:
            samples = run.roles.rollout.generate(reqs, contract, version)
        except Exception as e:  # noqa: BLE001 - recorded and retried; the group is dropped in the end
            ledger.failures.append(f"remax greedy: attempt {attempt}: {type(e).__name__}: {e}")
            continue
        for s in samples:
            g = s.group_id.removesuffix("/greedy")
            if g in wanted and s.stop_reason is not StopReason.ERROR:
                got[g] = s
    return got


def greedy_baselines(run, it: int, version, ledger: IterationLedger, kept: dict[str, list[RolloutSample]],
                     prompts: dict, served: list) -> tuple[dict[str, list[RolloutSample]], dict[str, float]]:
    """(the groups that keep a baseline, group id -> baseline score). Writes each baseline into
    its group's ledger row; drops the groups left without one."""
    roles = run.roles
    with run.stage("remax_baseline", "rollout"):
        greedy = _greedy(run, it, version, kept, prompts, ledger)
    served += roles.rollout.take_served()
    texts = {g: roles.tokenizer.decode(list(s.response_ids), skip_special_tokens=True) for g, s in greedy.items()}
    with run.stage("remax_reward", "reward"):
        try:
            pairs = dict(roles.reward.score([reward_item(s, prompts[g], texts[g]) for g, s in greedy.items()]))
        except Exception as e:  # noqa: BLE001 - no baseline: the groups are dropped, naming why
            ledger.failures.append(f"remax greedy reward: {type(e).__name__}: {e}")
            pairs = {}
    out, baselines = {}, {}
    for g, samples in kept.items():
        record = pairs.get(greedy[g].sample_id) if g in greedy else None
        if g not in greedy:
            ledger.drop(g, f"remax: no greedy response after {run.cfg.rollout.max_retries} retries")
        elif record is None or not record.ok:
            why = "no record" if record is None else f"{record.status.value}: {record.message}"
            ledger.drop(g, f"remax: the greedy response's reward failed ({why})")
        else:
            out[g], baselines[g] = samples, float(record.total)
            ledger.groups[g].baseline = {"score": record.total, "response": texts[g],
                                         "tokens": len(greedy[g].response_ids),
                                         "scorer": f"{record.scorer}@{record.scorer_version}"}
    return out, baselines


def put_baselines(batch: ExperienceBatch, baselines: dict[str, float]) -> None:
    """The fact `baseline_scores`: the greedy baseline of each sample's group, versioned like the
    reward records (same reward role, same scorer)."""
    first = batch.get("reward_records")[0]
    batch.put("baseline_scores", torch.tensor([baselines[g] for g in batch.group_ids], dtype=torch.float32),
              Role.REWARD, f"{first.scorer}@{first.scorer_version}" if first.scorer_version else "")
