"""Prompt loading: round trips, prompt ids, and every validation error naming file/row/field."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sealrl.data.dataset import DatasetError, load_prompts, prompts_from_rows, write_jsonl, write_parquet
from sealrl.data.tasks import make_task
from sealrl.models.tiny import build_char_tokenizer

TOK = build_char_tokenizer()


def row(content="12+34=", **over):
    r = {"id": None, "prompt": [{"role": "user", "content": content}], "data_source": "arith",
         "reward_model": {"ground_truth": "64", "style": "rule"}, "extra_info": {"index": 0}}
    r.update(over)
    return {k: v for k, v in r.items() if v is not None}


def write_raw_jsonl(path, rows):
    """Rows given as dicts are dumped; bytes are written as they are (for broken lines)."""
    with open(path, "wb") as f:
        for r in rows:
            f.write(r if isinstance(r, bytes) else json.dumps(r).encode())
            f.write(b"\n")
    return path


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_round_trip_of_task_rows(tmp_path, ext):
    rows = make_task("arith", "train", 20, seed=0)
    path = tmp_path / f"arith.{ext}"
    (write_jsonl if ext == "jsonl" else write_parquet)(rows, path)
    ps = load_prompts(path, TOK, max_prompt_tokens=16)
    assert len(ps) == 20 and ps.num_dropped == 0
    p = ps[0]
    assert p.prompt_id == "arith-02d638e44bce"
    assert p.text == "26+01=" and p.messages == ({"role": "user", "content": "26+01="},)
    # Char tokenizer: digits 0-9 are ids 4-13, '+' is 14, '=' is 18; no BOS is added.
    assert p.token_ids == (6, 10, 14, 4, 5, 18)
    assert p.ground_truth == "720" and p.data_source == "arith"
    assert p.extra_info["split"] == "train"
    assert [q.prompt_id for q in ps] == [r["id"] for r in rows]


def test_countdown_ground_truth_survives_parquet(tmp_path):
    rows = make_task("countdown", "test", 5, seed=0)
    write_parquet(rows, tmp_path / "cd.parquet")
    ps = load_prompts(tmp_path / "cd.parquet", TOK, max_prompt_tokens=64)
    assert [p.ground_truth for p in ps] == [r["reward_model"]["ground_truth"] for r in rows]


def test_prompt_id_precedence(tmp_path):
    rows = [row(id="given"), row(extra_info={"index": 7}), row(extra_info={"split": "x"})]
    ps = load_prompts(write_raw_jsonl(tmp_path / "mix.jsonl", rows), TOK, 16)
    assert [p.prompt_id for p in ps] == ["given", "7", "mix:2"]


def test_without_chat_template_contents_are_joined():
    rows = [row(prompt=[{"role": "system", "content": "ab"}, {"role": "user", "content": "1="}])]
    p = prompts_from_rows(rows, TOK, 16, use_chat_template=False)[0]
    assert p.text == "ab1=" and len(p.token_ids) == 4


JSONL_CASES = [
    # (bad row, reason, field, fragment of the message)
    (row(prompt=None), "missing_field", "prompt", "missing"),
    (row(prompt="12+34="), "wrong_type", "prompt", "must be a list"),
    (row(prompt=[]), "empty_prompt", "prompt", "no messages"),
    (row(prompt=["hi"]), "wrong_type", "prompt[0]", "role and content"),
    (row(prompt=[{"role": "user"}]), "missing_field", "prompt[0].content", "missing"),
    (row(prompt=[{"role": "user", "content": 5}]), "wrong_type", "prompt[0].content", "string"),
    (row(content=""), "empty_prompt", "prompt[0].content", "is empty"),
    (row(content="1" * 17), "too_long", "prompt", "17 tokens > max_prompt_tokens=16"),
    (row(content="12\u00d734="), "unknown_token", "prompt", "outside the vocabulary"),
    (row(data_source=3), "wrong_type", "data_source", "non-empty string"),
    (row(reward_model="64"), "wrong_type", "reward_model", "must be an object"),
    (row(reward_model={"style": "rule"}), "missing_field", "reward_model.ground_truth", "missing"),
    (row(extra_info=[1]), "wrong_type", "extra_info", "must be an object"),
    (row(id=1.5), "wrong_type", "id", "non-empty string or an int"),
    (row(id="a/b"), "bad_id", "id", "'/'"),
    ([1, 2], "wrong_type", "<row>", "must be an object"),
    (b'{"prompt": [', "invalid_json", "<line>", "invalid JSON"),
    (b'{"prompt": [{"role": "user", "content": "1\xff2="}]}', "invalid_utf8", "prompt[0].content",
     "invalid UTF-8 at byte 42 of the line"),
    (b'{"prompt": [\xff]}', "invalid_utf8", "<line>", "byte 12"),
    (b'{"id": "\\ud800", "prompt": []}', "invalid_utf8", "id", "not valid UTF-8"),
]


@pytest.mark.parametrize("bad,reason,field,fragment", JSONL_CASES,
                         ids=[f"{c[1]}:{c[2]}" for c in JSONL_CASES])
def test_jsonl_errors_name_file_row_and_field(tmp_path, bad, reason, field, fragment):
    path = write_raw_jsonl(tmp_path / "data.jsonl", [row(id="ok0"), bad, row(id="ok2")])
    with pytest.raises(DatasetError) as err:
        load_prompts(path, TOK, max_prompt_tokens=16)
    msg = str(err.value)
    assert msg.startswith(f"{path}: row 1 (line 2): field '{field}':"), msg
    assert fragment in msg and err.value.reason == reason and err.value.row == 1
    # The same file in drop mode keeps the two good rows and counts the bad one.
    ps = load_prompts(path, TOK, max_prompt_tokens=16, on_bad_row="drop")
    assert [p.prompt_id for p in ps] == ["ok0", "ok2"]
    assert dict(ps.dropped) == {reason: 1} and ps.drop_examples == [msg]


def test_bad_value_is_shown_shortened(tmp_path):
    path = write_raw_jsonl(tmp_path / "d.jsonl", [row(content="9" * 500)])
    with pytest.raises(DatasetError, match=r"got '9{56}\.\.\.$"):
        load_prompts(path, TOK, max_prompt_tokens=16)


def test_duplicate_ids_name_both_rows(tmp_path):
    path = write_raw_jsonl(tmp_path / "d.jsonl", [row(id="a"), row(id="b"), row(id="a")])
    with pytest.raises(DatasetError, match=r"row 2 \(line 3\): field 'id': duplicate prompt id "
                                           r"\(first at row 0\); got 'a'"):
        load_prompts(path, TOK, 16)
    ps = load_prompts(path, TOK, 16, on_bad_row="drop")
    assert [p.prompt_id for p in ps] == ["a", "b"] and ps.dropped["duplicate_id"] == 1


def test_drop_mode_counts_by_reason(tmp_path):
    rows = [row(id="g0"), row(prompt=None), row(content=""), row(content="1" * 40),
            b"\xc3(", row(reward_model=[]), row(id="g6"), row(id="g0")]
    ps = load_prompts(write_raw_jsonl(tmp_path / "d.jsonl", rows), TOK, 16, on_bad_row="drop")
    assert [p.prompt_id for p in ps] == ["g0", "g6"]
    assert dict(ps.dropped) == {"missing_field": 1, "empty_prompt": 1, "too_long": 1,
                                "invalid_utf8": 1, "wrong_type": 1, "duplicate_id": 1}
    assert ps.num_dropped == 6


def test_parquet_errors(tmp_path):
    good = row(id="g0")
    # A column of plain strings where chat messages belong.
    path = tmp_path / "flat.parquet"
    write_parquet([{**good, "prompt": "12+34="}], path)
    with pytest.raises(DatasetError, match=rf"^{path}: row 0: field 'prompt': must be a list"):
        load_prompts(path, TOK, 16)
    path = tmp_path / "norm.parquet"
    write_parquet([good, {**good, "id": "g1", "reward_model": None}], path)
    with pytest.raises(DatasetError, match=rf"^{path}: row 1: field 'reward_model': missing"):
        load_prompts(path, TOK, 16)
    path = tmp_path / "noprompt.parquet"
    write_parquet([{k: v for k, v in good.items() if k != "prompt"}], path)
    with pytest.raises(DatasetError, match="row 0: field 'prompt': missing"):
        load_prompts(path, TOK, 16)


def test_parquet_invalid_utf8_names_the_nested_field(tmp_path):
    contents = pa.array([b"12+34=", b"1\xff=", b"5+5="], type=pa.binary()).view(pa.string())
    prompt = pa.ListArray.from_arrays(
        pa.array([0, 1, 2, 3], pa.int32()),
        pa.StructArray.from_arrays([pa.array(["user"] * 3), contents], ["role", "content"]))
    table = pa.table({"id": ["a", "b", "c"], "prompt": prompt,
                      "data_source": ["arith"] * 3,
                      "reward_model": [{"ground_truth": "x", "style": "rule"}] * 3})
    path = tmp_path / "bad.parquet"
    pq.write_table(table, path)
    with pytest.raises(DatasetError, match=rf"^{path}: row 1: field 'prompt\[0\]\.content': "
                                           r"invalid UTF-8; got b'1\\xff='$"):
        load_prompts(path, TOK, 16)
    ps = load_prompts(path, TOK, 16, on_bad_row="drop")
    assert [p.prompt_id for p in ps] == ["a", "c"] and dict(ps.dropped) == {"invalid_utf8": 1}


def test_prompts_from_rows_validates_the_same_way():
    with pytest.raises(DatasetError, match=r"^rows: row 1: field 'prompt\[0\]\.content': is empty"):
        prompts_from_rows([row(id="a"), row(id="b", content="")], TOK, 16)
    with pytest.raises(ValueError, match="on_bad_row"):
        prompts_from_rows([row()], TOK, 16, on_bad_row="skip")
    with pytest.raises(ValueError, match="unsupported extension"):
        load_prompts("data.csv", TOK, 16)


def test_embedded_vocabulary_is_printable_ascii_with_the_arithmetic_ids_unmoved():
    # Ids by hand: 4 special tokens, then digits (4..13), the 19 operator/punctuation characters
    # ("+" is 14, "\n" is 32), a..z (33..58), A..Z (59..84); the appended characters follow in
    # string.punctuation order from 85 ("#"), and the tab is last (100).
    vocab = TOK.get_vocab()
    assert len(vocab) == 101
    assert [vocab[c] for c in "0+=\naA"] == [4, 14, 18, 32, 33, 59]
    assert [vocab[c] for c in "#$%&@[\\]^_`{|}~\t"] == list(range(85, 101))
    text = "Q: 3 #### {x}_1^2 $\\frac{1}{2}$ [a|b] ~ @50% & `c`\t!"
    ids = TOK(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and TOK.unk_token_id not in ids and TOK.decode(ids) == text


def test_gsm8k_and_latex_prompts_load(tmp_path):
    rows = [row(content="Tom has 3 + 4 pens.\n####", id="a"),
            row(content="What is $\\frac{1}{2}$ of {8}?", id="b")]
    ps = load_prompts(write_raw_jsonl(tmp_path / "g.jsonl", rows), TOK, 64)
    assert [p.text for p in ps] == ["Tom has 3 + 4 pens.\n####", "What is $\\frac{1}{2}$ of {8}?"]


def test_unknown_character_refusal_names_it_the_row_and_the_way_out(tmp_path):
    path = write_raw_jsonl(tmp_path / "d.jsonl", [row(), row(content="3\u00d74 = ?\r\u00d7")])
    with pytest.raises(DatasetError) as err:
        load_prompts(path, TOK, 16)
    assert str(err.value) == (
        f"{path}: row 1 (line 2): field 'prompt': characters outside the vocabulary of the model's "
        "tokenizer: '\u00d7' (U+00D7), '\\r' (U+000D); use a model whose tokenizer covers them "
        "(model.path=<local Hugging Face folder>), replace them in the data, or skip such rows "
        "(data.on_bad_row=drop); got '3\u00d74 = ?\\r\u00d7'")
    assert err.value.reason == "unknown_token"
