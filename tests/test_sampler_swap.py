"""benchmarks/sampler_swap.py: its torch-generator uniforms reach the engine (the same prompts
draw other tokens), and its comparison gives the paired figures written out by hand."""
import json
import math

from sealrl.experience.store import iteration_path, read_table
from tests.harness import embedded_run, load_benchmark

swap = load_benchmark("sampler_swap")
WORKLOAD = ("run.iterations=1", "rollout.temperature=1.5")


def _drawn(run, it: int = 0) -> tuple[list, list]:
    table, _ = read_table(iteration_path(run / "experience", it))
    return table.column("prompt_id").to_pylist(), table.column("response_ids").to_pylist()


def test_the_torch_uniforms_replace_the_hashed_ones_in_the_engine(tmp_path, monkeypatch):
    from sealrl.rollout import loop, scheduler
    native = _drawn(embedded_run(tmp_path / "native", *WORKLOAD))
    assert _drawn(embedded_run(tmp_path / "again", *WORKLOAD)) == native   # the native draws repeat exactly
    noise = swap.torch_uniforms(0)
    monkeypatch.setattr(loop, "uniform_noise", noise)
    monkeypatch.setattr(scheduler, "uniform_noise", noise)
    prompts, responses = _drawn(embedded_run(tmp_path / "swapped", *WORKLOAD))
    assert prompts == native[0]   # the same prompts, in the same order
    differ = sum(a != b for a, b in zip(native[1], responses))
    assert differ > 0, "the patched uniforms did not reach the engine"


def test_the_comparison_is_the_paired_differences_of_block_means(tmp_path):
    def side(seed: int, level: float, after: float) -> dict:   # 30 steps: level, level + 0.1, level + 0.2
        steps = [level] * 10 + [level + 0.1] * 10 + [level + 0.2] * 10
        return {"seed": seed, "reward_mean": steps, "entropy": [1.0 - x for x in steps], "after": after}
    paired = tmp_path / "paired.json"
    paired.write_text(json.dumps({"sealrl": {"seeds": [side(0, 0.2, 0.3), side(1, 0.3, 0.4)]},
                                  "trl": {"seeds": [side(0, 0.1, 0.35), side(1, 0.1, 0.3)]}}))
    out = swap.compare({0: side(0, 0.15, 0.32), 1: side(1, 0.35, 0.33)}, paired)
    assert out["seeds"] == [0, 1]
    torch_vs_trl = out["reward_mean"]["torch_minus_trl"][1]   # steps 11-20: +0.05 and +0.25
    assert math.isclose(torch_vs_trl["mean"], 0.15) and torch_vs_trl["above"] == 2
    assert math.isclose(torch_vs_trl["se"], round(math.sqrt(2 * 0.1 ** 2) / math.sqrt(2), 4))
    native_vs_trl = out["reward_mean"]["native_minus_trl"][0]   # +0.1 and +0.2
    assert math.isclose(native_vs_trl["mean"], 0.15) and math.isclose(native_vs_trl["t"], 3.0)
    assert out["reward_mean"]["torch_minus_native"][2]["mean"] == round(((0.15 - 0.2) + (0.35 - 0.3)) / 2, 4)
    assert out["entropy"]["torch_minus_trl"][1]["mean"] == -0.15
    assert out["after"][1] == {"torch": 0.33, "native": 0.4, "trl": 0.3}
