"""sync/versions.py on its own: the stage-verify-activate-retain mechanism every rollout client
uses, over snapshots that hold anything (here strings; the engine holds forward backends)."""
from __future__ import annotations

import pytest
import torch

from sealrl.experience.ids import PolicyVersion
from sealrl.experience.wire import VersionNotHeldError
from sealrl.sync.manifest import WeightSyncError, build_manifest
from sealrl.sync.versions import VersionSlots, private_copy, verified_copy


def v(step: int) -> PolicyVersion:
    return PolicyVersion("run", step, 0, f"hash{step}")


def test_a_failed_stage_stages_nothing_and_the_active_version_keeps_serving():
    slots: VersionSlots[str] = VersionSlots()
    slots.activate(slots.stage(v(0), lambda: "weights 0"))
    slots.stage(v(1), lambda: "weights 1")

    def bad():
        raise WeightSyncError("lm_head.weight", "checksum mismatch")
    with pytest.raises(WeightSyncError, match="lm_head.weight"):
        slots.stage(v(2), bad)
    assert slots.staged_version is None   # the earlier staged v1 is gone too: a stage replaces it
    assert slots.serving().held == "weights 0" and slots.active_version == v(0)
    with pytest.raises(VersionNotHeldError, match="nothing staged"):
        slots.activate(v(2))
    assert slots.activate(v(0)) == v(0)   # the active one again: a no-op


def test_retain_serves_the_last_k_activations_and_no_older():
    slots: VersionSlots[str] = VersionSlots()
    slots.retain(2)
    for step in range(3):
        slots.activate(slots.stage(v(step), lambda step=step: f"weights {step}"))
    assert slots.serving(v(1)).held == "weights 1" and slots.serving(v(2)).held == "weights 2"
    assert slots.serving().version == v(2)
    assert [s.version for s in slots.held()] == [v(1), v(2)]   # what a replacement loads, in order
    with pytest.raises(VersionNotHeldError, match=r"run@0.0.*holds run@2.0"):
        slots.serving(v(0))
    slots.retain(1)   # back to the active one only
    with pytest.raises(VersionNotHeldError):
        slots.serving(v(1))
    with pytest.raises(ValueError, match=">= 1"):
        slots.retain(0)


def test_discard_staged_keeps_the_active_version():
    slots: VersionSlots[str] = VersionSlots()
    slots.activate(slots.stage(v(0), lambda: "a"))
    slots.stage(v(1), lambda: "b")
    slots.discard_staged()
    assert slots.staged_version is None and slots.serving().held == "a"


def test_verified_copy_is_private_keeps_aliases_and_names_a_bad_tensor():
    w = torch.ones(3, 2)
    state = {"embed.weight": w, "lm_head.weight": w, "norm.weight": torch.zeros(2)}   # tied
    manifest = build_manifest(state, "run", 0, 0, "", "")
    shapes = {n: tuple(t.shape) for n, t in state.items()}
    copy = verified_copy(state, manifest, shapes)
    assert copy["embed.weight"] is copy["lm_head.weight"] and copy["embed.weight"] is not w
    w.add_(1.0)   # the sender's tensor changes after the manifest: the copy does not
    assert torch.equal(copy["embed.weight"], torch.ones(3, 2))
    with pytest.raises(WeightSyncError, match="embed.weight"):
        verified_copy(state, manifest, shapes)
    with pytest.raises(WeightSyncError, match="norm.weight.*absent"):
        verified_copy({k: t for k, t in private_copy(state).items() if k != "norm.weight"},
                      build_manifest({k: t for k, t in state.items() if k != "norm.weight"}, "run", 0, 0, "", ""),
                      shapes)
