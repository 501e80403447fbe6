"""Two-phase weight activation (DESIGN section 5): every replica stages and verifies, and only
then do all switch; a corrupted tensor on one replica activates nothing anywhere and the error
names the replica and the tensor. Errors that cross process boundaries keep type and fields."""
from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from sealrl.experience import MissingResultsError
from sealrl.experience.wire import VersionNotHeldError
from sealrl.models.hf import model_config_hash, tokenizer_hash
from sealrl.models.tiny import build_tiny_model
from sealrl.placement.rollout_pool import RolloutPool
from sealrl.placement.workers import LocalWorkerGroup, RemoteCallError, WorkerError
from sealrl.roles.rollout import Rollout
from sealrl.sync.manifest import WeightSyncError, build_manifest
from tests.helpers_replicas import CorruptedTransfer

TENSOR = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def versions():
    model, tok = build_tiny_model(seed=0, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    hashes = tokenizer_hash(tok), model_config_hash(model.config)
    state0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    state1 = {k: v + 0.02 * torch.randn_like(v) for k, v in state0.items()}
    return model, tok, (state0, build_manifest(state0, "run", 0, 0, *hashes)), \
        (state1, build_manifest(state1, "run", 1, 0, *hashes))


def test_stage_keeps_the_active_version_until_activate(versions):
    model, tok, (state0, v0), (state1, v1) = versions
    worker = Rollout(model, tok)
    assert worker.load(state0, v0) == v0.version
    assert worker.stage(state1, v1) == v1.version
    assert (worker.version, worker.staged_version) == (v0.version, v1.version)   # staged, not active
    with pytest.raises(VersionNotHeldError, match="activate run@7.0.*run@1.0.* staged"):
        worker.activate(dataclasses.replace(v1.version, step=7))
    assert worker.activate(v1.version) == v1.version
    assert (worker.version, worker.staged_version) == (v1.version, None)
    assert worker.activate(v1.version) == v1.version                              # repeated: a no-op
    with pytest.raises(VersionNotHeldError, match="nothing staged"):
        worker.activate(v0.version)                                               # no way back unstaged


def test_a_corrupted_tensor_on_one_replica_activates_nothing_anywhere(versions, tmp_path):
    model, tok, (state0, v0), (state1, v1) = versions
    healthy = Rollout(model, tok)
    corrupted = CorruptedTransfer(model, tok, str(tmp_path / "marker"), TENSOR, step=1)
    pool = RolloutPool(LocalWorkerGroup("rollout", [healthy, corrupted]))
    assert pool.load(state0, v0) == v0.version
    with pytest.raises(WorkerError, match=f"role rollout worker 1: stage: WeightSyncError: .*{TENSOR}.*checksum") as e:
        pool.load(state1, v1)
    assert isinstance(e.value.cause, WeightSyncError) and e.value.cause.tensor == TENSOR
    # replica 0 verified v1 but never switched, and dropped its staged copy
    assert [(w.version, w.staged_version) for w in (healthy, corrupted)] == [(v0.version, None)] * 2
    assert pool.version == v0.version and pool.history == [("load", v0.version.id)]
    assert pool.load(state1, v1) == v1.version == pool.version   # an intact transfer goes through


def test_one_phase_sync_on_a_group_also_activates_nothing(versions, tmp_path):
    model, tok, (state0, v0), (state1, v1) = versions
    group = LocalWorkerGroup("rollout", [CorruptedTransfer(model, tok, str(tmp_path / "m"), TENSOR, step=1),
                                         Rollout(model, tok)])
    RolloutPool(group).load(state0, v0)
    with pytest.raises(WorkerError, match="worker 0: stage: WeightSyncError"):
        RolloutPool(group).load(state1, v1)
    assert group.attr("version") == [v0.version, v0.version] and group.attr("staged_version") == [None, None]


@pytest.mark.parametrize("error", [
    WeightSyncError(TENSOR, "checksum 1 != manifest 2"),
    WorkerError("rollout", 1, "stage", "WeightSyncError: ...", WeightSyncError(TENSOR, "missing"), lost=True),
    MissingResultsError("rollout", ["run/0/p0/0", "run/0/p0/1"]),
], ids=lambda e: type(e).__name__)
def test_errors_pickle_with_their_type_message_and_fields(error):
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
    assert {k: str(v) for k, v in vars(back).items()} == {k: str(v) for k, v in vars(error).items()}
    assert RemoteCallError.portable(error) is error    # sent as itself, not as a stand-in
