"""Rewards chosen by config (docs/rewards.md): a user's function in a file or a module, verl's
`compute_score` signature, weighted components, routing by data source, the format reward, the
reward model and the code sandbox, each from a YAML file with no monkeypatching. Load-time
mistakes are ConfigErrors before any run folder exists; a function that raises, hangs or returns
a non-score gives error/timeout records naming it, and the reward-error policy decides.

Expected values are recomputed in the tests from the stored response tokens (decoded with the
policy's tokenizer), not read back from the scorer under test."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import pytest

from sealrl.config import EMBEDDED_MODEL, ConfigError, build_config, load_config
from sealrl.rewards.base import RewardSample
from sealrl.rewards.from_config import build_reward
from sealrl.rewards.pool import RewardPool

TINY = {"run": {"name": "t", "iterations": 2, "loggers": "", "threads": 1, "seed": 1},
        "data": {"num_train": 48, "prompts_per_iter": 4}, "eval": {"num": 4},
        "rollout": {"n": 4, "max_new_tokens": 5}, "actor": {"micro_batch_size": 16, "lr": 1e-3}}

# verl's signature, unchanged: a dict with a score and a named component
VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    correct = float(solution_str.strip() == str(ground_truth))
    return {"score": correct, "digits": float(sum(ch.isdigit() for ch in solution_str))}
'''


def _write_yaml(folder: Path, reward: dict, **sections) -> Path:
    import yaml
    body = {k: dict(v) for k, v in TINY.items()}
    for name, extra in sections.items():
        body.setdefault(name, {}).update(extra)
    body["reward"] = reward
    body["run"]["output_dir"] = str(folder / "out")
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def _train(yaml_path: Path, *overrides: str) -> Path:
    from sealrl.trainer.driver import train
    cfg = load_config(str(yaml_path), list(overrides))
    summary = train(cfg)
    assert summary["completed"] and summary["iterations"] == 2
    return Path(cfg.run.output_dir) / cfg.run.name


def _rows(run: Path) -> list[dict]:
    """Every stored sample of the run, with its response decoded by the policy's tokenizer."""
    from transformers import AutoTokenizer

    from sealrl.experience.store import iteration_path, read_table
    tok = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    rows = []
    for it in range(2):
        table, _ = read_table(iteration_path(run / "experience", it))
        for r in table.to_pylist():
            r["text"] = tok.decode(r["response_ids"], skip_special_tokens=True)
            r["components"] = json.loads(r["reward_components"])
            rows.append(r)
    assert rows
    return rows


def _audit_ok(run: Path) -> None:
    from sealrl.audit import audit_run
    report = audit_run(run)
    assert report.ok, report.summary()


def sample(response: str, truth="7", **kw) -> RewardSample:
    return RewardSample(sample_id=kw.pop("sample_id", "r/0/p/0"), prompt="3+4=", response=response,
                        ground_truth=truth, **kw)


# ---- the contract, without training --------------------------------------------------------------

def test_verl_signature_binds_by_name_and_extra_info_arrives(tmp_path, monkeypatch):
    (tmp_path / "mine.py").write_text(textwrap.dedent('''
        def score(ground_truth, solution_str, /, extra_info, data_source, sample_id, prompt, unused=3, **kw):
            return {"score": 0.25 * len(solution_str) + extra_info["bonus"],
                    "from_" + data_source: float(prompt == "3+4=" and sample_id == "r/0/p/0")}
    '''))
    monkeypatch.chdir(tmp_path)   # a relative reward file is found from the working directory
    fn = build_reward(build_config(None, ["reward.fn=mine.py:score"]).reward, "file")
    record = RewardPool(fn, num_scorers=0).score([sample("abcd", data_source="gsm8k", metadata={"bonus": 2})])[0]
    assert record.ok and record.total == 0.25 * 4 + 2 and record.components == {"from_gsm8k": 1.0}
    assert record.scorer == "mine.py:score" and len(record.scorer_version) == 12


def test_a_module_function_and_a_float(tmp_path, monkeypatch):
    (tmp_path / "pkg_rewards_cfg").mkdir()
    (tmp_path / "pkg_rewards_cfg" / "__init__.py").write_text("")
    (tmp_path / "pkg_rewards_cfg" / "rules.py").write_text("def exact(response, ground_truth):\n"
                                                           "    return response == ground_truth\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = build_reward(build_config(None, ["reward.fn=pkg_rewards_cfg.rules:exact"]).reward, "file")
    right, wrong = RewardPool(fn, num_scorers=0).score([sample("7"), sample("8", sample_id="r/0/p/1")])
    assert (right.total, wrong.total) == (1.0, 0.0)      # a bool is a number: True -> 1.0
    assert right.components == {"pkg_rewards_cfg.rules:exact": 1.0}


@pytest.mark.parametrize("fn, source, message", [
    ("nope.py:f", None, "reward.fn='nope.py:f': reward file nope.py does not exist (relative paths are resolved "
                        "against the working directory"),
    ("r.py:missing", "def score(response):\n    return 1.0\n",
     "r.py has no function 'missing' (functions there: score)"),
    ("r.py:THRESHOLD", "THRESHOLD = 0.5\n", "r.py:THRESHOLD is a float, not a function"),
    ("r.py:f", "def f(response, tokenizer):\n    return 1.0\n",
     "r.py:f takes a parameter 'tokenizer' that sealrl cannot fill; expected parameters named from data_source, "
     "prompt, response, solution_str, ground_truth, extra_info"),
    ("r.py:f", "def f(ground_truth):\n    return 1.0\n", "r.py:f takes (ground_truth), which never sees the response"),
    ("r.py:f", "import not_a_module_anywhere\n", "loading "),
    ("no_such_pkg_xyz.mod:f", None, "module no_such_pkg_xyz.mod cannot be imported"),
    ("arith.py", None, "reward.fn must be auto | arith | countdown | math | format | code_exec | reward_model | "
                       "tool_answer | guess, package.module:function or path/file.py:function, got 'arith.py'"),
])
def test_load_time_errors_stop_before_a_run_folder(tmp_path, monkeypatch, fn, source, message):
    from sealrl.trainer.inputs import check_inputs
    monkeypatch.chdir(tmp_path)
    if source is not None:
        (tmp_path / "r.py").write_text(source)
    with pytest.raises(ConfigError) as e:
        check_inputs(load_config(str(_write_yaml(tmp_path, {"fn": fn}))))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("reward, message", [
    ({"fn": "math", "components": [{"fn": "arith"}]}, "reward.fn='math' and reward.components are exclusive"),
    ({"components": [{"fn": "arith", "weight": "x"}]}, "reward.components[0].weight must be a finite number"),
    ({"components": [{"fn": "arith"}, {"fn": "arith"}]}, "reward.components[1].name 'arith' must be a string other "
                                                         "than 'total', unique"),
    ({"components": [{"fun": "arith"}]}, "reward.components[0] must be a mapping with keys fn, weight"),
    ({"components": [{"fn": "format"}]}, "reward.components[0].fn=format needs reward.format_pattern"),
    ({"fn": "reward_model"}, "reward.fn=reward_model needs reward.model_path"),
    ({"fn": "reward_model", "model_path": "no/such/rm"}, "reward.model_path: no/such/rm is not a Hugging Face model"),
    ({"route": {"gsm8k": "nope.py:f"}}, "reward.route.gsm8k='nope.py:f': reward file nope.py does not exist"),
])
def test_bad_components_route_and_builtins(tmp_path, monkeypatch, reward, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        build_reward(build_config({"reward": reward}).reward, "arith")
    assert message in str(e.value)


RUNTIME_FAULTS = '''
import math, time, zlib
EVAL_HANGS = False
def score(solution_str, ground_truth, sample_id):
    if sample_id.startswith("eval/") and EVAL_HANGS:
        time.sleep(600)
    kind = int(sample_id.rsplit("/", 1)[1])   # the candidate
    if kind == 0:
        raise KeyError("no such answer")
    if kind == 1:   # which non-score: by the prompt id
        return (math.nan, math.inf, None, "1.0", {"acc": 1.0})[zlib.crc32(sample_id.split("/")[-2].encode()) % 5]
    if kind == 2 and "/1/" in sample_id and not sample_id.startswith("eval/"):
        time.sleep(600)   # far past reward.timeout_s: only the pool's SIGKILL ends it
    return float(solution_str.strip() == str(ground_truth))
'''
NON_SCORES = ["returned nan (float)", "returned inf (float)", "returned None (NoneType)", "returned '1.0' (str)",
              "raised ValueError: returned a dict without a 'score' key (keys ['acc'])"]


def _prompt_with(residue: int) -> str:
    return next(f"p{i}" for i in range(100) if zlib.crc32(f"p{i}".encode()) % 5 == residue)


def test_runtime_faults_are_error_records_naming_the_function(tmp_path, monkeypatch):
    (tmp_path / "faulty.py").write_text(RUNTIME_FAULTS)
    monkeypatch.chdir(tmp_path)
    fn = build_reward(build_config(None, ["reward.fn=faulty.py:score"]).reward, "file")
    ids = ["r/0/p/0"] + [f"r/0/{_prompt_with(k)}/1" for k in range(5)] + ["r/0/p/3"]
    records = RewardPool(fn, num_scorers=0).score([sample("7", sample_id=i) for i in ids])
    expected = ["raised KeyError: 'no such answer' at faulty.py:9 in score", *NON_SCORES]
    for record, detail, sample_id in zip(records, expected, ids):
        assert record.status == "error" and record.total is None
        assert record.message.startswith(f"scorer 'faulty.py:score' (version {fn.version}) on sample '{sample_id}': ")
        assert detail in record.message, record.message
    assert records[-1].ok and records[-1].total == 1.0


# ---- trained from YAML ---------------------------------------------------------------------------

@pytest.mark.slow
def test_trains_with_a_verl_reward_file_from_yaml(tmp_path, monkeypatch):
    (tmp_path / "reward.py").write_text(VERL_REWARD)
    monkeypatch.chdir(tmp_path)
    run = _train(_write_yaml(tmp_path, {"fn": "reward.py:compute_score"}))
    for r in _rows(run):
        truth = json.loads(r["ground_truth"])
        assert r["reward_status"] == "ok" and r["reward_scorer"] == "reward.py:compute_score"
        assert r["reward_total"] == float(r["text"].strip() == str(truth))
        assert r["components"] == {"digits": float(sum(ch.isdigit() for ch in r["text"]))}
    _audit_ok(run)


@pytest.mark.slow
def test_weighted_custom_function_and_format_reward(tmp_path, monkeypatch):
    (tmp_path / "reward.py").write_text(VERL_REWARD)
    monkeypatch.chdir(tmp_path)
    reward = {"format_pattern": "[0-9]*0", "num_scorers": 2,
              "components": [{"fn": "reward.py:compute_score", "weight": 0.5},
                             {"fn": "format", "weight": 2.0, "name": "below_100"}]}
    run = _train(_write_yaml(tmp_path, reward))
    rows = _rows(run)
    for r in rows:
        correct = float(r["text"].strip() == json.loads(r["ground_truth"]))
        fmt = float(re.fullmatch("[0-9]*0", r["text"].strip()) is not None)
        assert r["components"] == {"compute_score": correct, "compute_score/digits": float(sum(
            ch.isdigit() for ch in r["text"])), "below_100": fmt}
        assert r["reward_total"] == pytest.approx(0.5 * correct + 2.0 * fmt, abs=1e-12)
        assert r["reward_scorer"] == "weighted"
    # responses are reversed sums: a trailing 0 says the sum is below 100; both outcomes occur
    assert {r["components"]["below_100"] for r in rows} == {0.0, 1.0}
    _audit_ok(run)
    # a component edited after the run no longer sums to the total: the audit names it
    from sealrl.audit import audit_run
    from tests.test_audit import _iter, _rewrite

    def edit(cols):
        parts = json.loads(cols["reward_components"][0])
        parts["below_100"] += 1.0
        cols["reward_components"][0] = json.dumps(parts, sort_keys=True)
    _rewrite(_iter(run, 1), edit)
    report = audit_run(run)
    weighted = [v for v in report.violations if "weighted sum" in v.message]
    assert [v.check for v in weighted] == ["rewards"] and weighted[0].iteration == 1, report.summary()


@pytest.mark.slow
def test_runtime_faults_in_training_follow_the_reward_error_policy(tmp_path, monkeypatch):
    (tmp_path / "faulty.py").write_text(RUNTIME_FAULTS.replace("EVAL_HANGS = False", "EVAL_HANGS = True"))
    monkeypatch.chdir(tmp_path)
    reward = {"fn": "faulty.py:score", "num_scorers": 2, "timeout_s": 5.0}
    run = _train(_write_yaml(tmp_path, reward, algorithm={"reward_error": "penalty", "reward_error_penalty": -1.0},
                             eval={"num": 2}))
    summary = json.loads((run / "summary.json").read_text())
    # the evaluation scores in the scorer processes too: its calls (which sleep 600 s) time out
    # after 5 s and count as unsolved; scored in the driver, this run would not have ended
    assert summary["accuracy_before"] == summary["accuracy_after"] == 0.0
    rows = _rows(run)
    for r in rows:
        candidate, it = int(r["sample_id"].rsplit("/", 1)[1]), r["sample_id"].split("/")[1]
        if candidate in (0, 1):
            assert r["reward_status"] == "error" and r["reward_total"] is None
            assert "scorer 'faulty.py:score'" in r["reward_message"]
            detail = "no such answer" if candidate == 0 else NON_SCORES[zlib.crc32(r["prompt_id"].encode()) % 5]
            assert detail in r["reward_message"], r["reward_message"]
        elif candidate == 2 and it == "1":
            assert r["reward_status"] == "timeout" and r["reward_total"] is None
            assert "no result within the 5 s deadline" in r["reward_message"], r["reward_message"]
            assert "scorer 'faulty.py:score'" in r["reward_message"]
        else:
            assert r["reward_status"] == "ok"
        if r["reward_status"] != "ok":
            assert r["scores"] == -1.0   # the explicit penalty, never a disguised 0
    _audit_ok(run)


@pytest.mark.slow
def test_reward_model_from_yaml_in_its_own_process(tmp_path):
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    from sealrl.models.tiny import build_char_tokenizer, tiny_llama_config
    rm_dir = tmp_path / "rm"
    tokenizer = build_char_tokenizer()
    # its own chat template, not the policy's
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }};{% endfor %}"
    config = tiny_llama_config(len(tokenizer), hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    config.num_labels = 1
    torch.manual_seed(3)
    LlamaForSequenceClassification(config).save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    run = _train(_write_yaml(tmp_path, {"fn": "reward_model", "model_path": str(rm_dir), "num_scorers": 1,
                                        "timeout_s": 120.0}))
    model = LlamaForSequenceClassification.from_pretrained(rm_dir).eval()
    rm_tok = AutoTokenizer.from_pretrained(rm_dir)
    rows = _rows(run)
    for r in rows:   # the RM's own template around the prompt and the response, its own tokenizer
        ids = rm_tok(f"u:{r['prompt_text']};a:{r['text']};", add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            assert r["reward_total"] == pytest.approx(model(input_ids=ids).logits[0, 0].item(), abs=1e-5)
    assert all(r["reward_status"] == "ok" and r["reward_scorer"] == "reward_model" for r in rows)
    assert len({round(r["reward_total"], 6) for r in rows}) > 1   # scores depend on the response
    _audit_ok(run)


CODE_ROWS = 6


def _mixed_data(folder: Path) -> Path:
    """A verl-layout file: arithmetic rows and 'code' rows whose one test expects no output."""
    tests = json.dumps({"tests": [{"stdin": "", "stdout": ""}]})
    rows = []
    for i in range(12):
        a, b = 17 + 13 * i % 80, 12 + 29 * i % 85   # two-digit sums above and below 100
        code = i < CODE_ROWS
        rows.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "data_source": "code" if code else "arith",
                     "reward_model": {"ground_truth": tests if code else str(a + b), "style": "rule"},
                     "extra_info": {"index": i}})
    path = folder / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="the code sandbox needs root (uid change, namespaces)")
def test_code_execution_routed_by_data_source(tmp_path, monkeypatch):
    (tmp_path / "reward.py").write_text(VERL_REWARD)
    monkeypatch.chdir(tmp_path)
    data = _mixed_data(tmp_path)
    reward = {"fn": "reward.py:compute_score", "route": {"code": "code_exec"}, "sandbox_wall_s": 10.0,
              "num_scorers": 2, "timeout_s": 60.0}
    run = _train(_write_yaml(tmp_path, reward, data={"task": "file", "train_file": str(data),
                                                     "eval_file": str(data)}))
    rows = _rows(run)
    for r in rows:
        assert r["reward_status"] == "ok" and r["reward_scorer"] == "route"
        if r["data_source"] == "code":   # the program passes when it runs cleanly and prints nothing
            out = subprocess.run([sys.executable, "-I", "-S", "-c", r["text"].strip()], capture_output=True,
                                 text=True, timeout=60)
            expected = float(out.returncode == 0 and out.stdout.strip() == "")
            assert r["components"] == {"code_exec": expected} and r["reward_total"] == expected, r["text"]
        else:
            assert r["components"]["digits"] == float(sum(ch.isdigit() for ch in r["text"]))
    assert {r["data_source"] for r in rows} == {"code", "arith"}
    # '601' runs; '020' is a SyntaxError (a decimal literal with a leading zero): both occur
    assert {r["reward_total"] for r in rows if r["data_source"] == "code"} == {0.0, 1.0}
    _audit_ok(run)


def test_cli_names_a_missing_function_in_one_line(tmp_path):
    (tmp_path / "reward.py").write_text(VERL_REWARD)
    yaml_path = _write_yaml(tmp_path, {"fn": "reward.py:compute"})
    out = subprocess.run([sys.executable, "-m", "sealrl.cli", "train", str(yaml_path)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip() == (f"sealrl: error: reward.fn='reward.py:compute': {(tmp_path / 'reward.py').resolve()}"
                                  " has no function 'compute' (functions there: compute_score)")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_an_edited_reward_file_refuses_a_resume(tmp_path, monkeypatch):
    from sealrl.trainer.driver import train
    from sealrl.trainer.resume.checkpoint import CheckpointError
    (tmp_path / "reward.py").write_text(VERL_REWARD)
    monkeypatch.chdir(tmp_path)
    yaml_path = _write_yaml(tmp_path, {"fn": "reward.py:compute_score"})
    train(load_config(str(yaml_path), ["run.iterations=1"]))
    (tmp_path / "reward.py").write_text(VERL_REWARD.replace("ground_truth)", "ground_truth).lower()"))
    with pytest.raises(CheckpointError, match=r"reward_fn.version: '\w{12}' -> '\w{12}'"):
        train(load_config(str(yaml_path), ["run.resume=auto"]))


def test_components_and_route_from_overrides():
    cfg = build_config(None, ["reward.components=[{fn: arith, weight: 2}, {fn: auto, weight: -1, name: again}]",
                              "reward.route={countdown: countdown}"]).reward
    fn = build_reward(cfg, "arith")
    right, other = RewardPool(fn, num_scorers=0).score([
        sample("7", data_source="arith"),
        sample("1+2*3", truth={"target": 7, "numbers": [1, 2, 3]}, data_source="countdown", sample_id="r/0/p/1")])
    assert right.total == 2 * 1.0 - 1 * 1.0 and right.components == {"arith": 1.0, "again": 1.0}
    assert other.total == 1.0 and other.components == {"countdown": 1.0} and other.scorer == "route"
