"""The bring-your-own example (examples/byo): conversion, the reward, and a short training run."""
import importlib.util
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from sealrl.audit import audit_run
from sealrl.config import EMBEDDED_MODEL, load_config
from sealrl.data.dataset import load_prompts
from sealrl.models.hf import load_causal_lm

BYO = Path(__file__).resolve().parents[1] / "examples" / "byo"
PROBLEMS = [json.loads(line) for line in (BYO / "problems.jsonl").read_text().splitlines()]


def load(name):
    spec = importlib.util.spec_from_file_location(f"byo_{name}", BYO / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convert, reward = load("convert"), load("reward")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("byo") / "data"
    assert convert.main(["--out-dir", str(out)]) == 0
    return out


def test_problems_are_gsm8k_layout_and_many_enough():
    assert len(PROBLEMS) >= 40
    assert all(set(p) == {"question", "answer"} and "\n#### " in p["answer"] for p in PROBLEMS)
    assert len({p["question"] for p in PROBLEMS}) == len(PROBLEMS)


def test_converted_parquet_reads_back_through_the_loader(data_dir):
    _, tokenizer = load_causal_lm(EMBEDDED_MODEL)
    cfg = load_config(str(BYO / "byo_grpo.yaml"))
    loaded = {name: load_prompts(data_dir / f"{name}.parquet", tokenizer, cfg.data.max_prompt_tokens)
              for name in ("train", "test")}   # on_bad_row=error: any refusal fails here
    assert (len(loaded["train"]), len(loaded["test"])) == (40, 10)
    ids = [int(p.prompt_id) for ps in loaded.values() for p in ps]
    assert sorted(ids) == list(range(len(PROBLEMS)))   # a split: disjoint, and nothing lost
    for ps in loaded.values():
        for p in ps:
            src = PROBLEMS[int(p.prompt_id)]
            assert p.data_source == "byo_word_problems"
            assert p.messages == ({"role": "user", "content": src["question"] + "\nAnswer after ####."},)
            assert p.ground_truth == src["answer"].split("####")[-1].strip()
            assert p.extra_info["answer"] == src["answer"]
            assert tokenizer.unk_token_id not in p.token_ids
            # prompt and response fit the embedded model's 128 positions
            assert len(p.token_ids) + cfg.rollout.max_new_tokens <= 128
    table = pq.read_table(data_dir / "test.parquet")
    assert table.column_names == ["data_source", "prompt", "reward_model", "extra_info"]
    assert set(table.column("extra_info").combine_chunks().field("split").to_pylist()) == {"test"}


def test_split_is_fixed_by_its_seed(tmp_path, data_dir):
    def held_out(out):
        return [r["index"] for r in pq.read_table(out / "test.parquet").column("extra_info").to_pylist()]
    convert.main(["--out-dir", str(tmp_path / "again")])
    convert.main(["--out-dir", str(tmp_path / "other"), "--seed", "1"])
    assert held_out(tmp_path / "again") == held_out(data_dir)
    assert held_out(tmp_path / "other") != held_out(data_dir)


def test_convert_refuses_a_line_without_a_final_answer(tmp_path, capsys):
    src = tmp_path / "p.jsonl"
    src.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?", "answer": "4"}\n')
    assert convert.main(["--src", str(src), "--out-dir", str(tmp_path / "d"), "--test-size", "1"]) == 2
    assert f"{src}: line 2: field 'answer': has no '#### <final answer>'; got '4'" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("response,truth,score", [
    (" #### 7", "7", 1.0),
    ("3 + 4 = 7 #### 8", "7", 0.0),          # the answer is after the last ####, not before
    ("12 apples, then 3", "3", 1.0),         # no marker: the last number
    (" 7<eos>9", "7", 1.0),                   # cut at the stop token
    ("#### 1,000", "1000", 1.0),
    ("#### 7.0", "7", 1.0),                   # equal as math, not as strings
    ("#### \\frac{14}{2}", "7", 1.0),
    ("#### seven", "7", 0.0),
    ("", "7", 0.0),
])
def test_compute_score(response, truth, score):
    assert reward.compute_score("byo_word_problems", response, truth, {}) == score


def test_compute_score_refuses_an_unparsable_ground_truth():
    with pytest.raises(ValueError, match="cannot parse the ground truth 'seven'"):
        reward.compute_score("byo_word_problems", "#### 7", "seven", {})


@pytest.mark.slow   # about a minute on 2 shared cores
def test_two_iterations_train_on_the_converted_data(tmp_path, data_dir):
    from sealrl.trainer.driver import train
    # the example's own reward: examples/byo/reward.py:compute_score, resolved from the repository root
    cfg = load_config(str(BYO / "byo_grpo.yaml"), [
        f"data.train_file={data_dir / 'train.parquet'}",
        f"data.eval_file={data_dir / 'test.parquet'}", f"run.output_dir={tmp_path}", "run.iterations=2",
        "run.eval_every=0", "run.checkpoint_every=0", "run.threads=1",
        "run.loggers="])
    summary = train(cfg)
    run = tmp_path / "byo_grpo"
    assert summary["iterations"] == 2
    ledger = [json.loads(x) for x in (run / "ledger.jsonl").read_text().splitlines()]
    assert len(ledger) == 2 * 8   # 8 prompts a iteration, each one group
    assert audit_run(run).failed_checks() == []
    records = pq.read_table(run / "experience" / "iter_000001.parquet").column("reward_scorer").to_pylist()
    assert set(records) == {"examples/byo/reward.py:compute_score"}, set(records)
