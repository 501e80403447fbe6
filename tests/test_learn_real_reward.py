"""benchmarks/learn_real_reward.py (the real-model learning benchmark's reward) and the data set
of benchmarks/learn_real_data.py: unit tests, fast, no model."""
import json
import re
from pathlib import Path

import pytest

from tests.harness import load_benchmark

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
reward = load_benchmark("learn_real_reward")
data = load_benchmark("learn_real_data")


def score(response, truth="7"):
    return reward.compute_score("learn_real_arith", response, truth)


@pytest.mark.parametrize("response", [
    "3 + 4 = 7. The answer is \\boxed{7}.",
    "The answer is $\\boxed{7}$",
    "\\boxed{7 \\text{ apples}}",
    "The answer is 7",
    "The answer is: 7 apples. Tom bought 4 of them.",   # the stated answer, not the last number
    "3 + 4 = 7.",
    "Tom has 3 + 4 = 7 apples",
    "7",
    "So he has 7.0 apples left.",
    "2 + 3 = 5, and 5 + 2 = 7. The answer is \\boxed{7}.",
])
def test_natural_formats_score_one(response):
    assert score(response) == 1.0


@pytest.mark.parametrize("response", [
    "2 + 5 = 7, and 7 - 2 = 3. The answer is \\boxed{3}.",   # the model's spurious second step
    "The answer is \\boxed{8}. 7 is wrong.",                 # boxed wins over the last number
    "The answer is 8, not 7",                                # the stated answer wins
    "Tom has 3 + 4 apples, so 34.",
    "-7",
])
def test_wrong_answers_score_zero(response):
    assert score(response) == 0.0


def test_other_number_formats():
    assert score("The answer is 1,000.", "1000") == 1.0
    assert score("It costs -3 dollars.", "-3") == 1.0
    assert score("\\boxed{12}", " 12 ") == 1.0


@pytest.mark.parametrize("response", ["", "   ", "no number here", "\\boxed{", "\\boxed{}", "\\boxed{x}",
                                      "answer is", "\x00\ufffd", "{" * 10_000, "\\boxed{" * 5_000,
                                      None, 7, ["7"]])
def test_malformed_responses_score_zero_without_raising(response):
    assert score(response) == 0.0


def test_huge_response_is_scored():
    assert score("9" * 5_000 + " apples. The answer is 7") == 1.0


def test_unparseable_ground_truth_is_an_error():
    with pytest.raises(ValueError, match="not a number"):
        score("7", "seven")


def test_split_is_seeded_disjoint_and_answers_are_right():
    train, test = data.split(500, 200, seed=0)
    assert (len(train), len(test)) == (500, 200)
    assert not {q for q, _, _ in train} & {q for q, _, _ in test}
    assert (train, test) == data.split(500, 200, seed=0)
    assert {s for _, _, s in train + test} == {1, 2}
    assert all(a >= 0 for _, a, _ in train + test)
    # the template "has a, buys b more, and then gives c": answer a + b - c
    q, a, _ = next(p for p in test if ", buys " in p[0])
    nums = [int(w.strip(",")) for w in q.split() if w.strip(",").isdigit()]
    assert a == nums[0] + nums[1] - nums[2]


def test_rows_are_verl_layout():
    row = data.rows([("Q?", 5, 1)], "test")[0]
    assert row["data_source"] == data.DATA_SOURCE
    assert [m["role"] for m in row["prompt"]] == ["system", "user", "assistant", "user"]
    assert row["prompt"][-1]["content"] == "Q?" and row["reward_model"]["ground_truth"] == "5"
    assert row["extra_info"] == {"split": "test", "index": 0, "steps": 1}


def test_the_example_config_is_the_benchmarks_sealrl_side():
    """examples/smollm2_learn.yaml is learn_real.py's workload at its default arguments."""
    from sealrl.config import load_config
    args = load_benchmark("learn_real").parse_args([])
    cfg = load_config(str(BENCH.parent / "examples" / "smollm2_learn.yaml"))
    assert (cfg.data.prompts_per_iter, cfg.rollout.n, cfg.rollout.max_new_tokens) == (args.prompts, args.n,
                                                                                       args.max_new_tokens)
    assert (cfg.actor.lr, cfg.algorithm.kl_coef, cfg.rollout.temperature) == (args.lr, args.kl_coef, args.temperature)
    assert (cfg.run.iterations, cfg.run.eval_every, cfg.eval.num) == (args.iterations, args.eval_every, args.num_eval)
    assert cfg.reward.fn == "benchmarks/learn_real_reward.py:compute_score"


def test_committed_data_is_the_generators():
    """examples/learn_real/data is learn_real_data.write() at its defaults (seed 0, 500/200 rows)."""
    import pyarrow.parquet as pq
    folder = BENCH.parent / "examples" / "learn_real" / "data"
    train, test = data.split(500, 200, seed=0)
    assert pq.read_table(folder / "train.parquet").to_pylist() == data.rows(train, "train")
    assert pq.read_table(folder / "test.parquet").to_pylist() == data.rows(test, "test")


def test_the_plot_draws_each_sides_mean_and_every_seeds_points(tmp_path):
    """benchmarks/plot_learn_real.py: one line per side (the mean over seeds), one point per
    seed and evaluation, x in steps (samples / (prompts x n)), from the log's last JSON line."""
    plot = load_benchmark("plot_learn_real")
    seeds = [{"seed": s, "curve": [[0, 0.2], [320, 0.25 + s / 100], [640, 0.3]]} for s in (0, 1, 2)]
    report = {"args": {"prompts": 4, "n": 8},
              "sealrl": {"seeds": seeds, "mean": {"curve": [[0, 0.2], [320, 0.26], [640, 0.3]]}},
              "trl": {"seeds": seeds[:1], "mean": {"curve": [[0, 0.2], [320, 0.25], [640, 0.3]]}}}
    log = tmp_path / "learn_real.log"
    log.write_text("learn_real: sealrl, seed 0 ...\n" + json.dumps(report) + "\n")
    svg = plot.chart(plot.report_of(log))
    assert svg.count("<polyline") == 2 and svg.count("<circle") == 3 * 3 + 3
    assert "sealrl, mean of 3 seeds" in svg and "trl, mean of 1 seeds" in svg and "<style>" in svg
    x = [float(v) for v in re.findall(r'<text x="([\d.]+)" y="[\d.]+" text-anchor="middle">20<', svg)]
    assert len(x) == 1   # the last evaluation is at step 20 (640 samples / 32 a step)


def _run_log(tmp_path, name: str, seeds: dict[str, list[tuple[int, float]]], **args) -> Path:
    """A learn_real.py log whose report holds, per side, (seed, accuracy after) of 30 steps."""
    lr = load_benchmark("learn_real")
    report = {"args": {"seeds": ",".join(str(s) for s, _ in next(iter(seeds.values()))), "iterations": 30,
                       "prompts": 4, "n": 8, "lr": 2e-5, "eval_every": 10, "skip": None, **args}}
    results = {side: [{"seed": s, "curve": [[0, 0.2], [960, after]], "before": 0.2, "after": after,
                       "gain_points": round(100 * (after - 0.2), 2), "train_wall_s": 100.0 * (1 + i),
                       "eval_s": 10.0} for s, after in runs] for i, (side, runs) in enumerate(seeds.items())}
    log = tmp_path / name
    log.write_text("learn_real: sealrl, seed 0 ...\n" + json.dumps(lr.finish(report, results)) + "\n")
    return log


def test_merge_pools_the_seeds_of_several_runs(tmp_path):
    """learn_real.py --merge: every seed of both runs per side, the means over all of them."""
    lr = load_benchmark("learn_real")
    a = _run_log(tmp_path, "a.log", {"sealrl": [(0, 0.3), (1, 0.4)], "trl": [(0, 0.35), (1, 0.25)]})
    b = _run_log(tmp_path, "b.log", {"sealrl": [(3, 0.5)], "trl": [(3, 0.2)]})
    merged = lr.merge([a, b])
    assert [s["seed"] for s in merged["sealrl"]["seeds"]] == [0, 1, 3]
    assert merged["sealrl"]["mean"]["after"] == 0.4 and merged["trl"]["mean"]["after"] == round(0.8 / 3, 4)
    assert merged["after_minus_trl_points"] == round(100 * (0.4 - round(0.8 / 3, 4)), 2)
    assert merged["train_wall_ratio_trl_over_sealrl"] == 2.0
    assert merged["args"]["seeds"] == "0,1,3" and merged["args"]["merged"] == [str(a), str(b)]


def test_merge_refuses_another_workload_or_a_repeated_seed(tmp_path):
    lr = load_benchmark("learn_real")
    a = _run_log(tmp_path, "a.log", {"sealrl": [(0, 0.3)], "trl": [(0, 0.3)]})
    other = _run_log(tmp_path, "b.log", {"sealrl": [(1, 0.3)], "trl": [(1, 0.3)]}, lr=1e-5)
    with pytest.raises(SystemExit, match=r"b\.log ran another workload than the first log that names one \(lr\)"):
        lr.merge([a, other])
    again = _run_log(tmp_path, "c.log", {"sealrl": [(0, 0.5)], "trl": [(2, 0.3)]})
    with pytest.raises(SystemExit, match=r"c\.log repeats sealrl seed 0"):
        lr.merge([a, again])
    empty = tmp_path / "d.log"
    empty.write_text("learn_real: sealrl, seed 0 ...\n")
    with pytest.raises(SystemExit, match=r"d\.log has neither a report nor a finished seed"):
        lr.merge([a, empty])


def test_merge_reads_the_finished_seeds_of_a_stopped_run(tmp_path):
    """A run stopped before its report leaves its finished seeds on stderr: --merge takes them,
    checks its workload when the stderr names it, and lists it as unchecked when it does not."""
    lr = load_benchmark("learn_real")
    a = _run_log(tmp_path, "a.log", {"sealrl": [(0, 0.3)], "trl": [(0, 0.3)]})
    args = lr.final_report(a)["args"]
    seed = {"seed": 5, "curve": [[0, 0.2], [960, 0.5]], "before": 0.2, "after": 0.5, "gain_points": 30.0,
            "train_wall_s": 100.0, "eval_s": 10.0}
    lines = ["learn_real: sealrl, seed 5 ...", f"learn_real: sealrl, seed 5: {json.dumps(seed)}",
             "learn_real: trl, seed 5 ..."]
    stopped = tmp_path / "stopped.err"
    stopped.write_text("\n".join(lines) + "\n")
    merged = lr.merge([a, stopped])
    assert [s["seed"] for s in merged["sealrl"]["seeds"]] == [0, 5] and len(merged["trl"]["seeds"]) == 1
    assert merged["sealrl"]["mean"]["after"] == 0.4 and merged["args"]["unchecked"] == [str(stopped)]
    named = tmp_path / "named.err"
    named.write_text(lr.ARGS_LINE + json.dumps({**args, "lr": 1e-5}) + "\n" + "\n".join(lines) + "\n")
    with pytest.raises(SystemExit, match=r"named\.err ran another workload .*\(lr\)"):
        lr.merge([a, named])
    named.write_text(lr.ARGS_LINE + json.dumps(args) + "\n" + "\n".join(lines) + "\n")
    assert "unchecked" not in lr.merge([a, named])["args"]


def test_paired_blocks_compare_the_per_step_logs_seed_by_seed():
    """The report's paired_blocks: per block of eval_every steps, sealrl minus TRL averaged over
    the block, then over the seeds that logged the block on both sides, with t and the count above 0."""
    lr = load_benchmark("learn_real")
    sealrl = [{"seed": 0, "entropy": [1.0] * 4}, {"seed": 1, "entropy": [0.5, 0.5, 0.2, 0.4]},
              {"seed": 2, "entropy": [0.9] * 2}, {"seed": 7, "entropy": [0.0] * 4}]
    trl = [{"seed": 0, "entropy": [0.8, 0.6, 1.0, 1.0]}, {"seed": 1, "entropy": [0.6] * 4},
           {"seed": 2, "entropy": [0.9] * 4}]   # seed 2 logged one block on sealrl's side; 7 has no pair
    blocks = lr.paired_blocks(sealrl, trl, 2)
    assert set(blocks) == {"entropy"}
    first, second = blocks["entropy"]
    # first block: seed 0 +0.3, seed 1 -0.1, seed 2 0.0 -> mean 0.0667, stdev 0.2082, se 0.1202
    assert first == {"steps": "1-2", "seeds": 3, "mean": 0.0667, "t": 0.55, "above": 1}
    # second block: seed 0 0.0, seed 1 -0.3 (seed 2 did not log it)
    assert second == {"steps": "3-4", "seeds": 2, "mean": -0.15, "t": -1.0, "above": 0}


def test_the_paired_order_is_the_one_sealrls_sampler_takes():
    """--order paired hands TRL's trainer (shuffle off) the rows in the order sealrl's own sampler
    yields them for the run seed, across an epoch boundary too."""
    from sealrl.data.sampler import PromptSampler
    lr = load_benchmark("learn_real")
    rows = [{"row": i} for i in range(10)]
    for seed in (0, 3):
        sampler = PromptSampler(len(rows), 5, seed=seed, shuffle=True)
        want = [i for _ in range(5) for i in sampler.next_batch()]   # two epochs and a step of a third
        got = [r["row"] for r in lr.sealrl_order(rows, seed, 5, 5)]
        assert got == want and len(got) == 25
    assert lr.sealrl_order(rows, 0, 5, 5) != lr.sealrl_order(rows, 1, 5, 5)
    assert len(lr.sealrl_order(rows, 0, 2, 4)) == 8   # within the first epoch any step size pairs
    with pytest.raises(ValueError, match="10 rows are not a whole number of 4-prompt steps"):
        lr.sealrl_order(rows, 0, 3, 4)   # sealrl's third step would be the epoch's last 2 rows


def test_the_report_pairs_the_seeds_both_sides_ran(tmp_path):
    """Per seed both sides ran: sealrl's final accuracy minus TRL's, their mean and standard error,
    and whether both sides logged the same prompts at every step (a side that logged none: False)."""
    lr = load_benchmark("learn_real")
    same = [[1, 2], [3, 4]]
    sealrl = [{"seed": 0, "after": 0.30, "prompts": same}, {"seed": 1, "after": 0.40, "prompts": same},
              {"seed": 2, "after": 0.50, "prompts": same}, {"seed": 7, "after": 0.9}]
    trl = [{"seed": 1, "after": 0.30, "prompts": same}, {"seed": 0, "after": 0.35, "prompts": same},
           {"seed": 2, "after": 0.40, "prompts": [[1, 2], [3, 5]]}]
    out = lr.paired(sealrl, trl)
    assert out["paired_seeds"] == [0, 1, 2] and out["paired_after_minus_trl_points"] == [-5.0, 10.0, 10.0]
    assert out["same_prompts"] == [True, True, False]
    assert out["paired_mean_points"] == 5.0 and out["paired_stderr_points"] == 5.0
    assert lr.paired(sealrl[3:], trl) == {}
    assert lr.paired([{"seed": 1, "after": 0.3}], trl)["same_prompts"] == [False]   # an older run: no prompts


def test_each_side_reports_its_per_step_diagnostics_under_one_name():
    lr = load_benchmark("learn_real")
    rows = [{"actor/grad_norm": 1.23456, "actor/entropy": 0.5, "rollout/response_len_mean": 40.0},
            {"actor/grad_norm": 2.0, "actor/entropy": 0.25, "rollout/response_len_mean": 20.0}, {"eval/accuracy": 0.3}]
    assert lr.per_step(rows, lr.SEALRL_STEP_KEYS) == {"grad_norm": [1.2346, 2.0], "entropy": [0.5, 0.25],
                                                       "response_len": [40.0, 20.0]}
    assert lr.per_step([{"grad_norm": 0.5, "entropy": 0.7, "completions/mean_length": 33.0}], lr.TRL_STEP_KEYS) == \
        {"grad_norm": [0.5], "entropy": [0.7], "response_len": [33.0]}
