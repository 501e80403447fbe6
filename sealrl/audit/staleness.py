"""The staleness bound of DESIGN section 10, from the records alone: the sealed policy version of
each sample and the consumption lines (experience/consumed.jsonl).

The versions a run committed are the steps 0 and each iteration's consumed_step (an iteration
whose optimizer steps were all skipped commits nothing new). Iteration i's update starts from
the version iteration i-1 committed; a sample's staleness is how many committed versions lie
after the one that sampled it, up to that one. rollout.max_staleness bounds it. With partial
rollouts (sealed `token_versions`, the step of each token's version) a sample's staleness is
that of the oldest version among its tokens (`row_oldest`)."""
from __future__ import annotations

from sealrl.audit.folder import RunFolder


def committed_chain(run: RunFolder) -> list[int]:
    """The committed steps of the run, in order: 0, then each readable iteration's one consumed_step."""
    steps = {0} | {f.one("consumed_step") for f in run.readable} - {None}
    return sorted(steps)


def actor_step_before(run: RunFolder, iteration: int) -> int | None:
    """The step iteration `iteration`'s update started from: 0 for iteration 0, else the one
    consumed_step of iteration - 1 (None when that file is missing, unreadable or mixed)."""
    if iteration == 0:
        return 0
    before = run.file(iteration - 1)
    return before.one("consumed_step") if before is not None and before.readable else None


def staleness_of(chain: list[int], actor_step: int, sampled_step: int) -> int | None:
    """Committed versions after `sampled_step` up to `actor_step`; None when either was never committed."""
    if actor_step not in chain or sampled_step not in chain:
        return None
    return chain.index(actor_step) - chain.index(sampled_step)


def staleness_problem(chain: list[int], actor_step: int, sampled_step: int, bound: int) -> str:
    """Why a sample of version `sampled_step` may not be trained from `actor_step`; "" when it may."""
    age = staleness_of(chain, actor_step, sampled_step)
    if age is None:
        return f"step {sampled_step} is not a version the run committed ({chain})"
    if age < 0:
        return "it was sampled by a later version than the actor's"
    if age > bound:
        return f"staleness {age} exceeds rollout.max_staleness={bound}"
    return ""


def step_of(version_id: str | None) -> int | None:
    """The step of a version id `run@step.attempt#hash`; None when it is not one."""
    try:
        return int(str(version_id).rsplit("@", 1)[1].split(".", 1)[0])
    except (IndexError, ValueError):
        return None


def row_oldest(f, row: int, sampled_step: int, declared_steps: set[int]) -> tuple[int, str]:
    """(the oldest step among row `row`'s tokens and its sealed policy version `sampled_step`,
    why its token versions are wrong or "")."""
    steps = (f.cols.get("token_versions") or [None] * f.num_rows)[row]
    if not steps:
        return sampled_step, ""
    if steps[0] != sampled_step:
        return min(sampled_step, *steps), (f"its first token was sampled by step {steps[0]}, "
                                           f"the sample says {sampled_step}")
    unknown = sorted(set(steps) - declared_steps)
    if unknown:
        return min(sampled_step, *steps), f"token versions {unknown} are not declared in the file's versions"
    return min(steps), ""


def staleness_distribution(run: RunFolder) -> dict[int, int]:
    """Realised staleness -> number of trained samples (iterations whose chain can be followed)."""
    from sealrl.experience.ids import PolicyVersion
    chain, out = committed_chain(run), {}
    for f in run.readable:
        actor, pv = actor_step_before(run, f.iteration), f.one("policy_version")
        declared = f.meta.get("versions", {})
        if actor is None or pv not in declared:
            continue
        steps = {PolicyVersion.from_json(d).step for d in declared.values()}
        for row in range(f.num_rows):
            age = staleness_of(chain, actor, row_oldest(f, row, PolicyVersion.from_json(declared[pv]).step, steps)[0])
            if age is not None:
                out[age] = out.get(age, 0) + 1
    return dict(sorted(out.items()))
