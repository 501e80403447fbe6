"""Bad input from a tester's corpus: each case ends with one line naming the file (row, field)
or the config key, a user-error class (exit 2 on the CLI), and nothing written before it."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sealrl import cli
from sealrl.config import EMBEDDED_MODEL, ConfigError, UserError, build_config, load_config
from sealrl.data.dataset import DataFileError, DatasetError, load_prompts, write_jsonl, write_parquet
from sealrl.models.tiny import build_char_tokenizer
from sealrl.trainer.inputs import check_inputs, write_dropped_rows

TOK = build_char_tokenizer()
ROOT = Path(__file__).parent.parent


def row(id="a", content="12+34=", role="user", truth="46", source="arith"):
    return {"id": id, "prompt": [{"role": role, "content": content}], "data_source": source,
            "reward_model": {"ground_truth": truth, "style": "rule"}}


def file_cfg(tmp_path, *extra):
    return build_config(None, ["data.task=file", f"run.output_dir={tmp_path / 'runs'}", *extra])


def one_error(fn, cls=UserError) -> str:
    with pytest.raises(cls) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


# ---- accepted silently before ------------------------------------------------------------

def test_unknown_chat_role_is_refused_and_dropped_with_its_row(tmp_path):
    path = tmp_path / "roles.jsonl"
    write_jsonl([row("a"), row("b", role="moderator"), row("c")], path)
    msg = one_error(lambda: load_prompts(path, TOK, 16), DatasetError)
    assert msg.startswith(f"{path}: row 1 (line 2): field 'prompt[0].role': must be one of system, user, "
                          "assistant, tool; got 'moderator'"), msg
    ps = load_prompts(path, TOK, 16, on_bad_row="drop")
    assert [p.prompt_id for p in ps] == ["a", "c"] and dict(ps.dropped) == {"bad_role": 1}
    [d] = ps.dropped_rows
    assert (d.source, d.row, d.field, d.reason) == (str(path), 1, "prompt[0].role", "bad_role")
    assert write_dropped_rows(tmp_path, [ps]) == 1
    [line] = (tmp_path / "dropped_rows.jsonl").read_text().splitlines()
    assert json.loads(line) == {"file": str(path), "row": 1, "field": "prompt[0].role", "reason": "bad_role",
                                "message": msg}


def test_object_ground_truth_is_refused_except_for_structured_sources(tmp_path):
    path = tmp_path / "truth.jsonl"
    write_jsonl([row("a"), row("b", truth={"answer": "46"})], path)
    msg = one_error(lambda: load_prompts(path, TOK, 16), DatasetError)
    assert msg.startswith(f"{path}: row 1 (line 2): field 'reward_model.ground_truth': must be a string "
                          "or a number"), msg
    countdown = tmp_path / "cd.jsonl"
    write_jsonl([row("a", truth={"target": 3, "numbers": [1, 2]}, source="countdown")], countdown)
    assert load_prompts(countdown, TOK, 16)[0].ground_truth == {"target": 3, "numbers": [1, 2]}


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_empty_eval_file_is_refused_like_the_train_file(tmp_path, ext):
    from sealrl.trainer.setup import build_data
    train, evals = tmp_path / "train.jsonl", tmp_path / f"eval.{ext}"
    write_jsonl([row()], train)
    if ext == "jsonl":
        evals.write_text("\n")
    else:
        pq.write_table(pa.table({"prompt": pa.array([], pa.list_(pa.struct([("role", pa.string()),
                                                                             ("content", pa.string())])))}), evals)
    cfg = file_cfg(tmp_path, f"data.train_file={train}", f"data.eval_file={evals}")
    assert one_error(lambda: check_inputs(cfg), ConfigError) == f"data.eval_file: {evals} has no rows"
    assert one_error(lambda: build_data(cfg, TOK), ConfigError) == f"no usable eval prompts in {evals}"


def test_duplicate_yaml_key_is_refused_naming_key_and_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("actor:\n  lr: 1.0e-4\n  micro_batch_size: 8\n  lr: 1.0e-3\n")
    assert one_error(lambda: load_config(str(path)), ConfigError) == \
        f"config file {path}, line 4: duplicate key actor.lr (first at line 2)"


def test_clip_range_of_zero_width_is_refused():
    msg = one_error(lambda: build_config(None, ["actor.clip_low=0", "actor.clip_high=0"]), ConfigError)
    assert msg.startswith("actor.clip_high must be > 0 when actor.clip_low=0"), msg
    build_config(None, ["actor.clip_low=0", "actor.clip_high=0", "actor.loss=pg"])   # pg has no clip


def test_mini_batch_that_does_not_divide_the_batch_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  prompts_per_iter: 4\nactor:\n  mini_batch_size: 6\n")
    numbers = "data.prompts_per_iter * rollout.n = 4 * 8 = 32"
    assert one_error(lambda: load_config(str(path)), ConfigError) == \
        f"config file {path}, line 4: actor.mini_batch_size=6 must divide the batch {numbers}"
    cfg = build_config(None, ["data.prompts_per_iter=4", "actor.mini_batch_size=6"])
    assert numbers in one_error(lambda: check_inputs(cfg), ConfigError)
    load_config(str(path), ["actor.mini_batch_size=8"])


# ---- errors that named neither file nor row ------------------------------------------------

@pytest.mark.parametrize("keep", [0, 0.5], ids=["zero_bytes", "truncated"])
def test_unreadable_parquet_names_the_file(tmp_path, keep):
    path = tmp_path / "bad.parquet"
    write_parquet([row("a"), row("b")], path)
    path.write_bytes(path.read_bytes()[:int(keep * path.stat().st_size)])
    msg = one_error(lambda: load_prompts(path, TOK, 16), DataFileError)
    assert msg.startswith(f"{path}: not a readable Parquet file ("), msg
    cfg = file_cfg(tmp_path, f"data.train_file={path}")
    assert one_error(lambda: check_inputs(cfg), ConfigError).startswith(f"data.train_file: {path}: not a readable")


def test_deeply_nested_json_names_the_row_and_is_dropped(tmp_path):
    deep = b'{"id": "b", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    nested = 1
    for _ in range(40):   # parses, but deeper than the loader accepts
        nested = [nested]
    fairly_deep = json.dumps({**row("c"), "extra_info": {"x": nested}})
    path = tmp_path / "deep.jsonl"
    path.write_bytes(json.dumps(row("a")).encode() + b"\n" + deep + b"\n" + fairly_deep.encode() + b"\n")
    msg = one_error(lambda: load_prompts(path, TOK, 16), DatasetError)
    assert msg.startswith(f"{path}: row 1 (line 2): field '<line>': nested deeper than 32 levels"), msg
    ps = load_prompts(path, TOK, 16, on_bad_row="drop")
    assert [p.prompt_id for p in ps] == ["a"] and dict(ps.dropped) == {"too_deep": 2}


def test_missing_data_file_and_model_folder_name_the_config_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    msg = one_error(lambda: check_inputs(file_cfg(tmp_path, "data.train_file=data/train.jsonl")), ConfigError)
    assert msg == (f"data.train_file: data/train.jsonl: no such file (relative paths are resolved against "
                   f"the working directory {tmp_path})")
    (tmp_path / "model").mkdir()
    for path, problem in ((tmp_path / "nope", "does not exist"),
                          (tmp_path / "model", "is not a Hugging Face model folder (no config.json)")):
        msg = one_error(lambda: check_inputs(build_config(None, [f"model.path={path}"])), ConfigError)
        assert msg == f"model.path: {path} {problem}"
    check_inputs(build_config(None, [f"model.path={EMBEDDED_MODEL}"]))


def test_yaml_syntax_error_keeps_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("run:\n  name: x\nactor: [1, 2\n")
    msg = one_error(lambda: load_config(str(path)), ConfigError)
    assert msg == (f"config file {path} is not valid YAML at line 4, column 1: expected ',' or ']', but got "
                   "'<stream end>' (while parsing a flow sequence from line 3)")


def test_config_value_errors_name_the_file_and_line_or_the_override(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  n: 4\n  temperature: -1\n")
    assert one_error(lambda: load_config(str(path)), ConfigError) == \
        f"config file {path}, line 3: rollout.temperature must be > 0, got -1.0"
    assert one_error(lambda: load_config(str(path), ["rollout.temperature=0"]), ConfigError) == \
        "rollout.temperature must be > 0, got 0.0 (from the override rollout.temperature=0)"


# ---- a traceback before, too slow before -----------------------------------------------------

def test_directory_as_data_file_is_one_line(tmp_path):
    path = tmp_path / "train.jsonl"
    path.mkdir()
    problem = f"{path}: is a directory, not a data file"
    assert one_error(lambda: load_prompts(path, TOK, 16), DataFileError) == problem
    cfg = file_cfg(tmp_path, f"data.train_file={path}")
    assert one_error(lambda: check_inputs(cfg), ConfigError) == f"data.train_file: {problem}"


def test_huge_prompt_is_refused_before_it_is_tokenized(tmp_path):
    path = tmp_path / "huge.jsonl"
    write_jsonl([row("a"), row("b", content="1" * (10 << 20))], path)
    t0 = time.perf_counter()
    msg = one_error(lambda: load_prompts(path, TOK, 64), DatasetError)
    ps = load_prompts(path, TOK, 64, on_bad_row="drop")
    assert time.perf_counter() - t0 < 5     # was 43 s: the whole prompt rendered and tokenized
    assert msg.startswith(f"{path}: row 1 (line 2): field 'prompt': 10485760 characters cannot fit in "
                          "max_prompt_tokens=64 (no token of the vocabulary is longer than 5 characters)"), msg
    assert [p.prompt_id for p in ps] == ["a"] and dict(ps.dropped) == {"too_long": 1}


# ---- the CLI: nothing written before the error; user errors vs bugs ------------------------------

@pytest.mark.parametrize("overrides, key", [
    (["model.path=missing-model"], "model.path: missing-model does not exist"),
    (["data.task=file", "data.train_file=missing.jsonl"], "data.train_file: missing.jsonl: no such file"),
], ids=["model", "data"])
def test_cli_refuses_bad_paths_before_creating_the_run_folder(tmp_path, monkeypatch, capsys, overrides, key):
    monkeypatch.chdir(tmp_path)
    status = cli.main(["train", str(ROOT / "examples/arith_grpo.yaml"), "run.output_dir=runs", *overrides])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith(f"sealrl: error: {key}") and err.count("\n") == 1, err
    assert not (tmp_path / "runs").exists()


def test_user_facing_errors_are_user_errors():
    from sealrl.config import MissingInputError
    from sealrl.models.hf import TokenizerMismatchError
    from sealrl.sync.manifest import WeightSyncError
    from sealrl.trainer.resume.checkpoint import CheckpointError
    for cls in (ConfigError, MissingInputError, DatasetError, DataFileError, CheckpointError, WeightSyncError,
                TokenizerMismatchError):
        assert issubclass(cls, UserError), cls


@pytest.mark.parametrize("error, status", [(RuntimeError("boom"), 1), (ValueError("boom"), 1),
                                           (ConfigError("data.train_file: boom"), 2)])
def test_cli_splits_user_errors_from_bugs(monkeypatch, capsys, error, status):
    def fail(*args, **kwargs):
        raise error
    monkeypatch.setattr("sealrl.config.load_config", fail)
    assert cli.main(["train", "whatever.yaml"]) == status
    err = capsys.readouterr().err
    if status == 2:
        assert err == "sealrl: error: data.train_file: boom\n"
    else:
        assert "Traceback (most recent call last)" in err and f"{type(error).__name__}: boom" in err


def test_math_verify_prints_nothing_a_user_cannot_act_on():
    script = ("from sealrl.rewards.verifiers import MathVerifier; from sealrl.rewards.base import RewardSample; "
              "print(MathVerifier()(RewardSample(sample_id='s', prompt='', response='$4$', response_ids=(), "
              "ground_truth='4', data_source='x', metadata={})))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.strip() == "1.0" and out.stderr == "", out.stderr
