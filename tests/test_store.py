import json

import pyarrow.parquet as pq
import pytest
import torch

from sealrl.experience import Role, pad_token_rows
from sealrl.experience.store import (
    CONSUMED,
    append_consumed,
    read_consumed,
    read_iteration,
    read_table,
    write_iteration,
)
from tests.helpers_experience import REF, V0, add_rewards, make_batch

ALL = ("response_mask", "rollout_log_probs", "reward_records")


def _assert_same(a, b):
    assert a.samples == b.samples
    assert a.contract == b.contract and a.versions == b.versions
    assert a.run_id == b.run_id and a.iteration == b.iteration
    assert sorted(a.field_names()) == sorted(b.field_names())
    for name in a.field_names():
        assert a.provenance(name) == b.provenance(name)
        x, y = a.get(name), b.get(name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), name
        else:
            assert x == y, name
    assert a.seal_digest == b.seal_digest


def test_round_trip_every_field(tmp_path):
    b = make_batch(texts={0: "héllo wörld ✓ 数学", 3: "emoji 🚀\n"})
    widths = [len(s.response_ids) for s in b.samples]
    rows = lambda v: pad_token_rows([[v - 0.25 * j for j in range(n)] for n in widths], 4, torch.float32)
    b.put("filtered_log_probs", rows(-0.1), Role.ROLLOUT, V0.id)
    b.put("old_log_probs", rows(-0.2), Role.ACTOR, V0.id)
    b.put("ref_log_probs", rows(-0.3), Role.REFERENCE, REF.id)
    b.put("values", rows(0.7), Role.CRITIC, "critic@0")
    b.put("last_values", torch.tensor([0.1, -2.5, 3.0, 1e-7]), Role.CRITIC, "critic@0")
    add_rewards(b)
    b.seal(required=ALL)
    b.put("scores", torch.tensor([1.0, 0.0, -1.0, 0.5]), Role.DRIVER, "penalty")
    b.put("advantages", rows(1.5), Role.DRIVER, "grpo")
    b.put("zero_variance", torch.tensor([True, False, False, True]), Role.DRIVER, "grpo")
    path = write_iteration(tmp_path, b)
    back = read_iteration(path)
    _assert_same(b, back)
    table, meta = read_table(path)
    assert "consumed_step" not in table.column_names   # an event after the seal: consumed.jsonl
    assert meta["fields"]["ref_log_probs"] == {"producer": "reference", "version": REF.id}
    # errored rewards are stored as a status with no total, never as 0
    assert table.column("reward_status").to_pylist()[0] == "timeout"
    assert table.column("reward_total").to_pylist()[0] is None
    assert table.column("prompt_text").to_pylist()[0] == "héllo wörld ✓ 数学"


def test_empty_responses_and_batch_of_one(tmp_path):
    b = make_batch(responses=((),))
    b.seal()
    _assert_same(b, read_iteration(write_iteration(tmp_path, b)))
    b = make_batch(responses=((), ()))
    assert b.num_response_tokens == 0
    b.seal()
    _assert_same(b, read_iteration(write_iteration(tmp_path / "two", b)))


def test_unsealed_batches_are_not_stored(tmp_path):
    with pytest.raises(ValueError, match="only sealed"):
        write_iteration(tmp_path, make_batch())


def test_tampered_file_is_detected(tmp_path):
    b = make_batch()
    b.seal()
    path = write_iteration(tmp_path, b)
    table = pq.read_table(path)
    col = table.column("rollout_log_probs").to_pylist()
    col[0][0] = 0.0
    import pyarrow as pa
    table = table.set_column(table.schema.get_field_index("rollout_log_probs"), "rollout_log_probs",
                             pa.array(col, pa.list_(pa.float32())))
    pq.write_table(table, path)
    with pytest.raises(ValueError, match="changed after sealing"):
        read_iteration(path)


def test_consumption_log_round_trip_and_bad_lines(tmp_path):
    append_consumed(tmp_path, 0, 1, "r@0.0#a", "r@1.0", "d0")
    append_consumed(tmp_path, 1, 2, "r@1.0#b", "r@2.0", "d1")
    with open(tmp_path / CONSUMED, "a") as f:
        f.write("{not json\n" + json.dumps({"consumed_step": 3}) + "\n")
    by_iteration, errors = read_consumed(tmp_path)
    assert by_iteration == {0: [{"iteration": 0, "consumed_step": 1, "sampled_by": "r@0.0#a", "committed": "r@1.0",
                                 "seal_digest": "d0"}],
                            1: [{"iteration": 1, "consumed_step": 2, "sampled_by": "r@1.0#b", "committed": "r@2.0",
                                 "seal_digest": "d1"}]}
    assert len(errors) == 2 and errors[0].startswith(f"{CONSUMED} line 3: JSONDecodeError")
    assert errors[1].startswith(f"{CONSUMED} line 4: KeyError")
    assert read_consumed(tmp_path / "absent") == ({}, [])
