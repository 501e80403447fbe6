"""DAPO dynamic sampling (Yu et al. 2025, arXiv:2503.14476, sec. 3.2; verl's
`algorithm.filter_groups`): a group whose training scores are all equal has advantage 0 under
every group-relative estimator, so it carries no signal. With `algorithm.dynamic_sampling` such
groups are left out of the loss, each recorded in the ledger as `filtered` with its reason, and
the iteration samples further full batches of prompts (rounds) until it holds
`data.prompts_per_iter` groups with signal or has run `algorithm.max_sampling_rounds` rounds.

Every generated group ends in the ledger as committed (trained), filtered (zero variance) or
dropped (rollout or reward failure, or surplus: a later round found more groups with signal than
the iteration still needed). A round never opens a new sampler epoch: group ids are
run/iteration/prompt, and a prompt of the new epoch could repeat one of this iteration's. The
filter judges the score before any KL-in-reward term (as verl judges the reward metric).
"""
from __future__ import annotations

from sealrl.experience import RewardRecord
from sealrl.experience.wire import RolloutSample
from sealrl.trainer.collect import decode_and_score, generate
from sealrl.trainer.derive import training_scores
from sealrl.trainer.ledger import IterationLedger, new_iteration
from sealrl.trainer.state import StageFailed
from sealrl.trainer.variants.episodes import action_masks


def zero_variance(samples: list[RolloutSample], records: dict[str, RewardRecord], algo, max_new_tokens: int
                  ) -> float | None:
    """The common training score of a group whose scores are all exactly equal, else None."""
    scores = training_scores([records[s.sample_id] for s in samples], [sum(m) for m in action_masks(samples)],
                             algo, max_new_tokens)
    return float(scores[0]) if bool((scores == scores[0]).all()) else None


def _filter(run, ledger: IterationLedger, kept: dict, records: dict) -> dict:
    """The groups of `kept` with signal; the others are marked filtered in the ledger."""
    cfg, out = run.cfg, {}
    for g, samples in kept.items():
        common = zero_variance(samples, records, cfg.algorithm, cfg.rollout.max_new_tokens)
        if common is None:
            out[g] = samples
        else:
            ledger.filter(g, f"zero variance: all {len(samples)} training scores are {common:g} (dynamic sampling)")
    return out


def oversample(run, it: int, version, ledger: IterationLedger, groups: dict, records: dict, kept: dict,
               prompts: dict, texts: dict, served: list) -> dict:
    """Filter `kept` (round 0), then generate and score further rounds into `ledger`, `groups`,
    `records`, `prompts` (group id -> prompt), `texts` and `served`, in place. Returns the groups
    that reach the loss: at most data.prompts_per_iter, earlier rounds first."""
    cfg, roles, sampler = run.cfg, run.roles, run.sampler
    target = cfg.data.prompts_per_iter
    ledger.dynamic = True
    signal, round_ = _filter(run, ledger, kept, records), 0
    for round_ in range(1, cfg.algorithm.max_sampling_rounds):
        if len(signal) >= target or sampler.cursor >= sampler.num_prompts:   # full, or a new epoch
            break
        batch = [run.data.train[i] for i in sampler.next_batch()]
        extra, requests = new_iteration(it, cfg.rollout.n, cfg.rollout.max_retries, cfg.run.name, cfg.run.seed,
                                        batch)
        prompts.update(zip(requests, batch))
        with run.stage("generate", "rollout"):
            new_groups = generate(run, extra, requests, version)
        served += roles.rollout.take_served()
        with run.stage("reward", "reward"):
            new_texts, new_records, new_kept = decode_and_score(run, extra, new_groups, prompts.__getitem__)
        ledger.absorb(extra, round_)
        groups.update(new_groups)
        records.update(new_records)
        texts.update(new_texts)
        for g, samples in _filter(run, ledger, new_kept, records).items():
            if len(signal) < target:
                signal[g] = samples
            else:
                ledger.drop(g, f"surplus: round {round_} found more groups with signal than the "
                               f"{target} of data.prompts_per_iter (dynamic sampling)")
    if not signal:
        raise StageFailed(f"iteration {it}: dynamic sampling found no group with signal in {round_ + 1} round(s) "
                          f"of {target} prompts (algorithm.max_sampling_rounds={cfg.algorithm.max_sampling_rounds}); "
                          "the data may be too hard or too easy for the policy")
    return signal
