"""Weight manifests: what verify_weights catches, and that the version names the exact bytes."""
from __future__ import annotations

import pytest
import torch

from sealrl.sync.manifest import WeightManifest, WeightSyncError, build_manifest, tensor_sha256, verify_weights


def state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(10, 4, generator=g)
    return {"embed.weight": embed, "lm_head.weight": embed,  # tied: same tensor twice
            "layer.weight": torch.randn(4, 4, generator=g),
            "layer.scale": torch.randn(4, generator=g).to(torch.bfloat16),
            "mask": torch.tensor([True, False])}


def manifest_of(sd, step=0) -> WeightManifest:
    return build_manifest(sd, "run", step, 0, tokenizer_hash="t" * 64, model_config_hash="c" * 64)


def test_verifies_its_own_weights_and_stamps_the_version():
    sd = state_dict()
    m = manifest_of(sd, step=3)
    verify_weights(sd, m)
    assert (m.version.run_id, m.version.step, m.version.attempt) == ("run", 3, 0)
    assert m.version.tokenizer_hash == "t" * 64 and len(m.version.weights_hash) == 64
    assert m.entries["layer.scale"].dtype == "bfloat16" and m.entries["mask"].shape == (2,)


def test_weights_hash_changes_with_one_bit():
    sd = state_dict()
    changed = dict(sd, **{"layer.weight": sd["layer.weight"].clone()})
    changed["layer.weight"].view(-1).view(torch.int32)[5] ^= 1  # flip the lowest mantissa bit
    assert manifest_of(changed).version.weights_hash != manifest_of(sd).version.weights_hash
    assert manifest_of(changed).version.id != manifest_of(sd).version.id


@pytest.mark.parametrize("corrupt, reason", [
    (lambda sd: sd.__setitem__("layer.weight", sd["layer.weight"] + 1e-6), "checksum"),
    (lambda sd: sd.pop("layer.weight"), "missing"),
    (lambda sd: sd.__setitem__("extra.bias", torch.zeros(2)), "unexpected"),
    (lambda sd: sd.__setitem__("layer.weight", sd["layer.weight"][:2]), "shape"),
    (lambda sd: sd.__setitem__("layer.weight", sd["layer.weight"].double()), "dtype"),
])
def test_names_the_bad_tensor(corrupt, reason):
    sd = state_dict()
    m = manifest_of(sd)
    bad = dict(sd)
    corrupt(bad)
    with pytest.raises(WeightSyncError, match=reason) as info:
        verify_weights(bad, m)
    assert info.value.tensor == ("extra.bias" if reason == "unexpected" else "layer.weight")
    assert info.value.tensor in str(info.value)


def test_stale_weights_that_were_never_transferred_fail_the_checksum():
    old = state_dict()
    new = {k: (v + 1 if v.dtype.is_floating_point else v) for k, v in old.items()}
    with pytest.raises(WeightSyncError, match="checksum"):
        verify_weights(old, manifest_of(new))


def test_tampered_manifest_is_refused():
    sd = state_dict()
    m = manifest_of(sd)
    entries = dict(m.entries)
    entries["layer.weight"] = entries["layer.weight"]._replace(sha256="0" * 64)
    with pytest.raises(WeightSyncError, match="weights_hash"):
        verify_weights(sd, WeightManifest(m.version, entries))


def test_json_round_trip():
    m = manifest_of(state_dict())
    back = WeightManifest.from_json(m.to_json())
    assert back == m
    verify_weights(state_dict(), back)


def test_checksum_is_over_bytes_not_layout():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert tensor_sha256(t.t().contiguous().t()) == tensor_sha256(t)  # same values, other strides
    assert tensor_sha256(t.t()) != tensor_sha256(t)  # a transposed tensor is other values


def test_a_large_set_is_hashed_in_threads_to_the_same_digests_and_names_the_first_bad_tensor(monkeypatch):
    """Past PARALLEL_BYTES the checksums run in a thread pool: the digests are the one-thread
    ones, in order, and verification still names the first bad tensor in name order."""
    import sealrl.sync.manifest as manifest
    state = {f"w{i}": torch.randn(1 << 20, generator=torch.Generator().manual_seed(i)) for i in range(6)}  # 24 MiB
    assert sum(t.numel() * 4 for t in state.values()) >= manifest.PARALLEL_BYTES
    tensors = [state[n] for n in sorted(state)]
    used = []
    real_pool = manifest.ThreadPoolExecutor
    monkeypatch.setattr(manifest, "ThreadPoolExecutor", lambda *a, **k: used.append(a) or real_pool(*a, **k))
    monkeypatch.setattr(manifest.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert manifest.checksums(tensors) == [tensor_sha256(t) for t in tensors]
    assert used   # the pool ran
    m = build_manifest(state, "run", 1, 0, "tok", "cfg")
    bad = dict(state)
    for name in ("w4", "w2"):
        bad[name] = state[name].clone()
        bad[name][7] += 1.0
    with pytest.raises(WeightSyncError, match=r"tensor .w2.: checksum"):
        verify_weights(bad, m)


def test_a_tied_tensor_is_hashed_once_with_the_digest_of_each_name(monkeypatch):
    """checksums hashes the bytes of an alias (a tied LM head) once and gives that digest to
    every name; two equal-valued tensors that are not aliases are each hashed."""
    import sealrl.sync.manifest as manifest
    sd = state_dict()
    sd["copy.weight"] = sd["embed.weight"].clone()   # equal values, other bytes
    hashed = []
    real = manifest.tensor_sha256
    monkeypatch.setattr(manifest, "tensor_sha256", lambda t: hashed.append(t.data_ptr()) or real(t))
    names = sorted(sd)
    digests = manifest.checksums([sd[n] for n in names])
    assert digests == [real(sd[n]) for n in names]
    assert len(hashed) == len(names) - 1   # lm_head.weight shares embed.weight's hash
    assert hashed.count(sd["embed.weight"].data_ptr()) == 1
    assert hashed.count(sd["copy.weight"].data_ptr()) == 1
    # a view of other bytes of the same storage is not an alias
    whole = torch.arange(8, dtype=torch.float32)
    assert manifest.checksums([whole[:4], whole[4:]]) == [real(whole[:4]), real(whole[4:])]
