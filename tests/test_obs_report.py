"""`sealrl report`: stage shares, the SVG charts and the HTML page, on a hand-made run folder
and on a real tiny run (whose trace.json must be a valid Chrome trace)."""
import argparse
import importlib.util
import json
import re
from html import escape

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sealrl.obs.report import add_parser, binned, load_rows, pick_samples, render, write_report
from sealrl.obs.svg import Series, line_chart, nice_ticks
from sealrl.obs.timeline import (
    critical_seconds,
    critical_shares,
    mean_stage_shares,
    read_trace,
    stage_breakdown,
    stage_shares,
)

PAYLOAD = "<script>document.title='pwned'</script><img src=x onerror=\"document.title='pwned'\">&amp;"


def make_run(run_dir, num_iterations=12, num_samples=40):
    """A run folder by hand: metrics (eval every 4, one NaN), summary, trace and the last
    iteration's experience whose first response is an HTML/script payload."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(num_iterations):
        row = {"iteration": i, "reward/mean": 0.2 + 0.05 * i, "reward/accuracy": 0.1 + 0.05 * i,
               "kl/ref_kl": 0.001 * i, "actor/approx_kl": 1e-4, "actor/entropy": 0.9 - 0.05 * i,
               "rollout/response_len_mean": 10.0 + i, "rollout/response_len_max": 16.0 + i,
               "actor/clip_frac_upper": 0.01, "actor/clip_frac_lower": 0.02 if i != 5 else "nan",
               "time/generate_s": 1.0, "time/actor_update_s": 2.0, "time/reward_s": 0.5,
               "time/iteration_s": 4.0, "time/train_wall_s": 4.0 * (i + 1), "time/share_generate": 0.25}
        if i % 4 == 3:
            row["eval/accuracy"] = 0.3 + 0.02 * i
        rows.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run_dir / "summary.json").write_text(json.dumps({"accuracy_before": 0.25, "accuracy_after": 0.6,
                                                      "iterations": num_iterations, "wall_s": 48.0,
                                                      "run_dir": str(run_dir)}))
    texts = [f"response {i}" for i in range(num_samples)]
    texts[0] = PAYLOAD
    table = pa.table({
        "sample_id": [f"r/{num_iterations - 1}/p{i // 4}/{i % 4}" for i in range(num_samples)],
        "prompt_text": [f"{i}+1=" for i in range(num_samples)], "response_text": texts,
        "reward_status": ["ok"] * (num_samples - 1) + ["error"], "reward_total": [1.0, 0.0] * (num_samples // 2),
        "reward_message": [""] * (num_samples - 1) + ["scorer timed out"],
        "advantages": [[0.5 - i % 2, 0.5 - i % 2] for i in range(num_samples)],
        "response_mask": [[True, True]] * num_samples,
        "policy_version": [f"r@{num_iterations - 1}.0#abc"] * num_samples, "stop_reason": ["eos"] * num_samples})
    (run_dir / "experience").mkdir(exist_ok=True)
    pq.write_table(table, run_dir / "experience" / f"iter_{num_iterations - 1:06d}.parquet")
    return run_dir


def test_stage_shares_golden():
    # 1 s generate + 2 s actor update of a 4 s iteration: 0.25, 0.5, and 0.25 untimed;
    # the total, the cumulative wall time and precomputed shares are not stages
    row = {"time/generate_s": 1.0, "time/actor_update_s": 2.0, "time/iteration_s": 4.0,
           "time/train_wall_s": 100.0, "time/share_generate": 0.25, "reward/mean": 3.0}
    assert stage_shares(row) == {"generate": 0.25, "actor_update": 0.5, "other": 0.25}
    assert stage_breakdown(row) == {"generate": 1.0, "actor_update": 2.0, "other": 1.0}
    assert stage_shares({"time/generate_s": 1.0}) == {}
    # overlapping stages (async) sum past 1: other is clamped at 0, never negative
    assert stage_shares({"time/a_s": 3.0, "time/b_s": 3.0, "time/iteration_s": 4.0})["other"] == 0.0


def test_critical_seconds_golden():
    # the training lane: prepare 0-1 s, waits 1-3 s for the generation lane, update 3-4 s; the
    # generation lane: generate 0-2.5 s (of it, 1.5 s inside the wait), reward 2.5-3 s (inside
    # it), generate again 3-4 s (the next iteration's, hidden behind the update: off the path)
    own = [("prepare", 0.0, 1.0), ("update", 3.0, 4.0)]
    lane = [("generate", 0.0, 2.5), ("reward", 2.5, 3.0), ("generate", 3.0, 4.0)]
    crit = critical_seconds(own, lane, [(1.0, 3.0)])
    assert crit == {"prepare": 1.0, "update": 1.0, "generate": 1.5, "reward": 0.5}
    shares = critical_shares(crit, 4.0)
    assert shares == {"time/critical_share_prepare": 0.25, "time/critical_share_update": 0.25,
                      "time/critical_share_generate": 0.375, "time/critical_share_reward": 0.125,
                      "time/critical_share_other": 0.0}
    # one lane (the synchronous loop): the critical path is every stage
    assert critical_seconds(own + [("generate", 1.0, 3.0)], [], []) == {"prepare": 1.0, "update": 1.0,
                                                                      "generate": 2.0}


def test_mean_stage_shares_weights_by_time():
    # generate is 1 s of 2 s, then 1 s of 8 s: 2 / 10 of the run, not the mean of 0.5 and 0.125
    rows = [{"time/generate_s": 1.0, "time/iteration_s": 2.0}, {"time/generate_s": 1.0, "time/iteration_s": 8.0}]
    assert mean_stage_shares(rows) == {"other": 0.8, "generate": 0.2}


def test_nice_ticks():
    assert nice_ticks(0.0, 1.0) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0.23, 0.61) == [0.3, 0.4, 0.5, 0.6]
    assert nice_ticks(0.0, 29.0, 6) == [0, 5, 10, 15, 20, 25]


def test_missing_values_break_the_line():
    svg = line_chart("t", [Series("s", [0, 1, 2, 3, 4], [1.0, 2.0, "nan", 3.0, 4.0], "#000")])
    assert svg.count("<polyline") == 2 and "NaN" not in svg
    assert "no data" in line_chart("t", [Series("s", [0, 1], [None, "nan"], "#000")])


def test_report_page(tmp_path):
    run = make_run(tmp_path / "run")
    html = render(run)
    assert html.count('<svg class="chart"') == 6  # reward+accuracy, KL, entropy, length, clip, stage time
    # self-contained: no script, no fetched resource (the SVG namespace is an identifier, not a fetch)
    assert not re.search(r"<script|<link|\bsrc=|@import|url\(", html.replace(escape(PAYLOAD), ""), re.I)
    assert "https://" not in html and html.count("http://") == html.count("http://www.w3.org/2000/svg")
    # model output is text: the payload appears escaped, once, and never as markup
    assert PAYLOAD not in html and "&lt;script&gt;document.title=" in html and "&amp;amp;" in html
    samples = re.search(r'<table class="samples">(.*?)</table>', html, re.S).group(1)
    assert samples.count("<tr>") == 1 + 16 and "error: scorer timed out" in samples
    assert "-0.5" in samples and "r@11.0#abc" in samples
    # eval points: before training at 0, logged evaluations at i + 1, after training at the end
    reward_chart = html.split('<svg class="chart"')[1]
    assert reward_chart.count("<circle") == 2 + 3  # before/after + iterations 3, 7, 11
    assert "50.0%" in html and "12.5%" in html  # actor_update 2 s of 4; reward and untimed 0.5 s each


def test_write_report_default_path_and_cli(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["report", str(run)])
    assert args.fn(args) == 0
    assert capsys.readouterr().out.strip() == str(run / "report.html") and (run / "report.html").is_file()
    out = write_report(run, tmp_path / "elsewhere" / "r.html")
    assert out.is_file() and not (tmp_path / "elsewhere" / "r.html.tmp").exists()
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        write_report(tmp_path / "nothing")


def test_long_runs_bin_the_stage_bars(tmp_path):
    run = make_run(tmp_path / "run", num_iterations=1000)
    stage_chart = render(run).split('<svg class="chart"')[6]
    assert stage_chart.count("<rect") - stage_chart.count('width="10" height="10"') - 1 == 4 * 250
    assert "mean of 4 iterations" in stage_chart
    assert binned([0, 1, 2, 3, 4], {"a": [1.0, 3.0, 5.0, 7.0, 9.0]}, max_bars=2) == ([0, 3], {"a": [3.0, 8.0]}, 3)


def test_redone_iterations_replace_earlier_lines(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"iteration": 0, "reward/mean": 1}, {"iteration": 1, "reward/mean": 2}, {"iteration": 1, "reward/mean": 3}]))
    assert [r["reward/mean"] for r in load_rows(tmp_path)] == [1, 3]
    assert len(pick_samples(list(range(5)))) == 5 and pick_samples(list(range(100)))[::15] == [0, 99]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    """Three iterations of GRPO (with a reference model) on a tiny random model, with every
    installed logger."""
    from sealrl.config import build_config
    from sealrl.models.hf import save_causal_lm
    from sealrl.models.tiny import build_tiny_model
    from sealrl.trainer.driver import train
    tmp = tmp_path_factory.mktemp("obs_run")
    model, tok = build_tiny_model(seed=0, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    save_causal_lm(model, tok, tmp / "model")
    loggers = ["tensorboard"] + [m for m in ("wandb", "mlflow") if importlib.util.find_spec(m)]
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_CACHE_DIR", str(tmp / "wandb-home"))
    mp.setenv("WANDB_CONFIG_DIR", str(tmp / "wandb-home"))
    mp.delenv("MLFLOW_TRACKING_URI", raising=False)
    try:
        train(build_config(None, [
            f"model.path={tmp / 'model'}", f"run.output_dir={tmp}", "run.name=obs", "run.iterations=3",
            "run.eval_every=2", "run.checkpoint_every=0", "data.num_train=64",
            "eval.num=8", "data.prompts_per_iter=4", "rollout.n=4", "rollout.max_new_tokens=4",
            "actor.micro_batch_size=16", "algorithm.kl_coef=0.01", f"run.loggers={','.join(loggers)}"]))
    finally:
        mp.undo()
    return tmp / "obs", loggers


def test_real_trace_is_a_valid_chrome_trace(real_run):
    run, _ = real_run
    events = read_trace(run / "trace.json")
    stages = {e["name"] for e in events if e["ph"] == "X"}
    assert {"weight_sync", "generate", "reward", "advantage"} <= stages
    # every timed stage of the metrics appears as a complete event in the trace
    rows = load_rows(run)
    assert set(stage_breakdown(rows[0])) - {"other"} <= stages
    assert all(abs(sum(stage_shares(r).values()) - 1.0) < 1e-6 for r in rows)


def test_real_run_measured_metrics_agree(real_run):
    """The measured metrics of a real run agree with each other and with the sealed facts."""
    from sealrl.experience.store import read_iteration
    run, _ = real_run
    rows = load_rows(run)
    last = rows[-1]
    batch = read_iteration(run / "experience" / "iter_000002.parquet")
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in batch.samples)
    for stage in ("reference", "old_log_prob"):  # same perf_counter span as time/<stage>_s
        assert last[f"prep/{stage}_tokens_per_s"] == pytest.approx(tokens / last[f"time/{stage}_s"], rel=1e-9)
        assert 0 <= last[f"prep/{stage}_queue_s"] < last["time/iteration_s"] - last["time/generate_s"]
    assert "prep/critic_values_queue_s" not in last  # GRPO: no critic
    for r in rows:
        assert (0 < r["rollout/first_completion_s"] <= r["rollout/group_completion_s_min"]
                <= r["rollout/group_completion_s_mean"] <= r["rollout/last_completion_s"] <= r["time/generate_s"])
        assert r["rollout/samples_ok"] == 16 and r["rollout/samples_dropped"] == 0 == r["rollout/samples_retried"]
        assert r["groups/effective_size_mean"] == 4 == r["groups/effective_size_min"]
        # the engine's KV cache: at least one prompt's T_max columns of every layer's keys and values
        # in fp32 (2 layers, 2 KV heads of 16 dims), and never fuller than what it reserved
        assert r["memory/rollout_kv_peak_gb"] * 2**30 >= 2 * 2 * 2 * 16 * 4 * (1 + 1)
        assert 0 < r["memory/rollout_kv_use"] <= 1
        critical = {k.replace("critical_", ""): v for k, v in r.items() if k.startswith("time/critical_share_")}
        assert critical == pytest.approx({k: v for k, v in r.items() if k.startswith("time/share_")}, abs=1e-9)
        shares = {k: v for k, v in r.items() if k.startswith("time/share_")}
        # the logged row's key order may differ: `other` = 1 - sum agrees to rounding
        assert shares == pytest.approx({f"time/share_{k}": v for k, v in stage_shares(r).items()}, abs=1e-12)
    step = int(batch.samples[0].policy_version.split("@")[1].split(".")[0])
    assert last["rollout/policy_version_step"] == step


def test_bad_trace_is_reported(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps({"traceEvents": [{"name": "x", "ph": "X", "ts": 0, "pid": 0}]}))
    with pytest.raises(ValueError, match="lacks tid"):
        read_trace(tmp_path / "t.json")


def test_real_run_report_and_loggers(real_run):
    run, loggers = real_run
    html = write_report(run).read_text()
    samples = re.search(r'<table class="samples">(.*?)</table>', html, re.S).group(1)
    assert samples.count("<tr>") == 1 + 16 and "obs@2.0#" in samples  # samples of the last iteration
    assert html.count('<svg class="chart"') == 7 and "no data" not in html   # + train vs rollout
    assert "wandb" not in loggers or list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert "mlflow" not in loggers or list((run / "mlruns").glob("*/*/metrics/reward/mean"))


def test_the_train_vs_rollout_mismatch_is_plotted_when_logged(tmp_path):
    run = make_run(tmp_path / "run")
    path = run / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({**r, "logprob/current_vs_rollout_abs_diff_max": 1e-6 * (i + 1),
                                        "logprob/current_vs_rollout_k3": 1e-9}) + "\n" for i, r in enumerate(rows)))
    html = render(run)
    assert html.count('<svg class="chart"') == 7 and "Train vs rollout log-probs (first step)" in html
