"""Exact resume of an asynchronous run (rollout.max_staleness = k >= 1, docs/async.md): the
versions the generation lane still samples from are part of the training position.

Under the pipeline's schedule iteration i is sampled by the version consuming iteration i - k,
so when a checkpoint is taken before iteration s, iterations s .. s+k-1 are still to be sampled
by the versions that consumed s-k .. s-1, which the actor has left behind. The checkpoint holds
those versions (`lane.versions`: iteration -> version) and their published weights (one
`lane_weights_N` part per version other than the actor's own, which the resumed actor
publishes again). On resume they are loaded into the rollout, oldest first, each verified
against the weights hash its version id names, and become the lane's first versions: the
iterations the crash lost (queued, in flight or not begun) are generated again from the same
versions with the same per-request seeds, bitwise as before. Nothing generated is saved.
"""
from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from sealrl.experience.ids import PolicyVersion
from sealrl.models.lora import adapter_scaling
from sealrl.sync.adapter import build_adapter_manifest
from sealrl.sync.manifest import build_manifest
from sealrl.sync.remote import local_copy
from sealrl.trainer.resume.checkpoint import CheckpointError


def lane_position(retained: dict, actor) -> tuple[dict, dict]:
    """(tensor parts, JSON) of a checkpoint for `retained` = Pipeline.retained(s): iteration ->
    (version, published weights)."""
    parts, versions, weights = {}, {}, {}
    for j, (version, state) in sorted(retained.items()):
        versions[str(j)] = version.to_json()
        own = (version.step, version.attempt) == (actor.step, actor.attempt)   # published again on resume
        if not own and version.id not in weights:
            weights[version.id] = f"lane_weights_{len(parts)}"
            parts[weights[version.id]] = dict(local_copy(state))   # a rank's RemoteState: fetched here
    return parts, {"versions": versions, "weights": weights}


def recall(run, resumed: dict) -> dict:
    """Load the checkpoint's retained versions into the rollout (before the actor's own is
    published) and into the state machine; return iteration -> (version, weights or None) for
    the pipeline. Empty for k = 0 and for a checkpoint that holds none."""
    lane = resumed.get("lane") or {"versions": {}}   # absent in checkpoints written before exact resume
    if not lane["versions"]:
        return {}
    folder = Path(resumed["folder"])   # the one restore_position just read
    rollout, out, held = run.roles.rollout, {}, {}
    rollout.retain(run.cfg.rollout.max_staleness + 1)
    for j, text in sorted(lane["versions"].items(), key=lambda kv: int(kv[0])):
        version = PolicyVersion.from_json(text)
        part = lane["weights"].get(version.id)
        if part is not None and version.id not in held:
            weights = load_file(str(folder / f"{part}.safetensors"))   # its sha256 checked with the marker
            manifest = version_manifest(run, weights, version)
            if manifest.version != version:
                raise CheckpointError(f"{folder}: part {part} does not hold the weights of {version.id} "
                                      f"(they digest to {manifest.version.weights_hash[:12]})")
            rollout.load(weights, manifest)   # verifies every tensor's checksum again
            held[version.id] = weights
        out[int(j)] = (version, held.get(version.id))
    run.sm.recall(list(held))
    return out


def version_manifest(run, weights: dict, v: PolicyVersion):
    """The manifest of `weights` stamped like version `v` (full weights, or a LoRA adapter on
    the base the rollout pinned): its version equals `v` only when the weights are v's."""
    if run.cfg.actor.lora.rank:
        actor = run.roles.actor
        return build_adapter_manifest(weights, adapter_scaling(actor.model), run.roles.rollout_base,
                                      v.run_id, v.step, v.attempt, v.tokenizer_hash, v.model_config_hash)
    return build_manifest(weights, v.run_id, v.step, v.attempt, v.tokenizer_hash, v.model_config_hash)
