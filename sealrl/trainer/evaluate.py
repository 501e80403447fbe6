"""Held-out evaluation: greedy accuracy, and pass@k when k > 1.

Greedy decoding is top-k = 1 sampling, so it runs through the same engine, the same weights
and the same version checks as training rollouts."""
from __future__ import annotations

from sealrl.data.dataset import PromptSet
from sealrl.experience import PolicyVersion, SamplingContract, group_id
from sealrl.experience.wire import GenerationRequest, env_input
from sealrl.rewards.base import RewardSample
from sealrl.rewards.pool import RewardPool
from sealrl.seams.rollout import RolloutClient
from sealrl.trainer.ledger import request_seed


def evaluate(rollout: RolloutClient, version: PolicyVersion, prompts: PromptSet, reward_fn, tokenizer,
             max_new_tokens: int, num: int, pass_k: int = 1, temperature: float = 1.0,
             seed: int = 0, batch_size: int = 256, num_scorers: int = 0, timeout_s: float = 10.0,
             memory_mb: int = 0
             ) -> dict[str, float]:
    """`num_scorers`, `timeout_s`: as reward.*; a scorer that errs or hangs past the deadline
    leaves its sample unsolved."""
    items = list(prompts)[:num]
    if not items:
        return {}
    greedy = SamplingContract(temperature=1.0, top_k=1, max_new_tokens=max_new_tokens, n=1)
    scorer = RewardPool(reward_fn, num_scorers=num_scorers, timeout_s=timeout_s, memory_mb=memory_mb)
    correct = _solved(rollout, version, items, greedy, 1, scorer, tokenizer, seed, batch_size)
    out = {"eval/accuracy": sum(any(c) for c in correct) / len(items), "eval/num": float(len(items))}
    if pass_k > 1:
        sampled = SamplingContract(temperature=temperature, max_new_tokens=max_new_tokens, n=pass_k)
        correct = _solved(rollout, version, items, sampled, pass_k, scorer, tokenizer, seed, batch_size)
        out[f"eval/pass@{pass_k}"] = sum(any(c) for c in correct) / len(items)
    scorer.close()
    return out


def _solved(rollout, version, items, contract, n, scorer, tokenizer, seed, batch_size) -> list[list[bool]]:
    """Per prompt, per candidate: did the verifier return a positive ok score?"""
    results = []
    for start in range(0, len(items), batch_size):
        chunk = items[start:start + batch_size]
        reqs = [GenerationRequest(group_id("eval", 0, p.prompt_id), tuple(p.token_ids),
                                  request_seed(seed, -1, p.prompt_id), tuple(range(n)), env_input(p)) for p in chunk]
        samples = rollout.generate(reqs, contract, version)
        by_group = {}
        for s in samples:
            by_group.setdefault(s.group_id, []).append(s)
        rs = []
        for p, req in zip(chunk, reqs):
            for s in by_group.get(req.group_id, []):
                rs.append(RewardSample(sample_id=s.sample_id, prompt=p.text,
                                       response=tokenizer.decode(list(s.response_ids), skip_special_tokens=True),
                                       response_ids=tuple(s.response_ids), ground_truth=p.ground_truth,
                                       data_source=p.data_source, metadata=p.extra_info))
        records = dict(zip([r.sample_id for r in rs], scorer.score(rs)))
        for req in reqs:
            results.append([records[s.sample_id].ok and records[s.sample_id].total > 0
                            for s in by_group.get(req.group_id, [])])
    return results
