import json

import pytest
import torch

from sealrl.roles.common import optimizer_from_flat, optimizer_to_flat
from sealrl.trainer.resume.checkpoint import (
    CheckpointError,
    StreamedPart,
    latest_checkpoint,
    load_checkpoint,
    rng_from_flat,
    rng_to_flat,
    save_checkpoint,
    verify_checkpoint,
)


def _model_and_opt(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
    return model, opt


def test_round_trip_restores_optimizer_bitwise(tmp_path):
    model, opt = _model_and_opt()
    t, meta = optimizer_to_flat(opt)
    folder = save_checkpoint(tmp_path, 3, {"model": dict(model.state_dict()), "optim": t},
                             {"optim": meta, "iteration": 3})
    assert latest_checkpoint(tmp_path) == folder
    tensors, state = load_checkpoint(folder, ["model", "optim"])
    model2, opt2 = _model_and_opt(seed=1)
    model2.load_state_dict(tensors["model"])
    optimizer_from_flat(opt2, tensors["optim"], state["optim"])
    # one more identical step on both gives bitwise-identical parameters
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        m(x).pow(2).sum().backward()
        o.step()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_latest_moves_only_after_commit(tmp_path):
    save_checkpoint(tmp_path, 1, {"a": {"x": torch.ones(2)}}, {})
    save_checkpoint(tmp_path, 2, {"a": {"x": torch.zeros(2)}}, {})
    assert latest_checkpoint(tmp_path).name == "step_2"
    # a half-written checkpoint (no marker) is never loaded
    half = tmp_path / "step_3"
    half.mkdir()
    (half / "state.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not committed"):
        verify_checkpoint(half)
    assert latest_checkpoint(tmp_path).name == "step_2"


def test_missing_and_corrupted_parts_are_named(tmp_path):
    folder = save_checkpoint(tmp_path, 1, {"actor_model": {"w": torch.arange(6.0)}}, {"k": 1})
    data = bytearray((folder / "actor_model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (folder / "actor_model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="part actor_model.safetensors is corrupted"):
        load_checkpoint(folder, ["actor_model"])
    folder = save_checkpoint(tmp_path, 2, {"actor_model": {"w": torch.arange(6.0)}}, {"k": 1})
    (folder / "actor_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="part actor_model.safetensors is missing"):
        load_checkpoint(folder, ["actor_model"])
    with pytest.raises(CheckpointError, match="part critic_model is missing"):
        load_checkpoint(save_checkpoint(tmp_path, 3, {"actor_model": {"w": torch.ones(1)}}, {}), ["critic_model"])


def test_a_streamed_part_is_written_chunk_by_chunk_as_shards_and_read_back_as_one(tmp_path):
    model, opt = _model_and_opt()
    t, meta = optimizer_to_flat(opt)
    keys, taken = sorted(t), []

    def chunks():   # a chunk is asked for only when the one before is written
        for i in range(0, len(keys), 2):
            taken.append(sorted(p.name for p in (tmp_path / "step_3.tmp").glob("optim-*")))
            yield {k: t[k] for k in keys[i:i + 2]}

    folder = save_checkpoint(tmp_path, 3, {"optim": StreamedPart(chunks())}, {"optim": meta})
    assert taken == [[], ["optim-00000.safetensors"], ["optim-00000.safetensors", "optim-00001.safetensors"]]
    tensors, state = load_checkpoint(folder, ["optim"])
    assert tensors["optim"].keys() == t.keys() and all(torch.equal(tensors["optim"][k], t[k]) for k in t)
    (folder / "optim-00001.safetensors").unlink()   # a lost shard: the marker names it
    with pytest.raises(CheckpointError, match="part optim-00001.safetensors is missing"):
        load_checkpoint(folder, ["optim"])


def test_latest_pointer_cannot_escape(tmp_path):
    save_checkpoint(tmp_path, 1, {"a": {"x": torch.ones(1)}}, {})
    (tmp_path / "latest").write_text("../../etc")
    with pytest.raises(CheckpointError, match="does not name a checkpoint folder"):
        latest_checkpoint(tmp_path)


def test_rng_round_trip():
    state = rng_to_flat()
    a = torch.rand(3)
    rng_from_flat(state)
    assert torch.equal(torch.rand(3), a)


def test_marker_lists_every_file(tmp_path):
    folder = save_checkpoint(tmp_path, 7, {"p": {"x": torch.ones(2)}}, {"s": 1})
    marker = json.loads((folder / "COMMITTED").read_text())
    assert sorted(marker["files"]) == ["p.safetensors", "state.json"] and marker["step"] == 7
