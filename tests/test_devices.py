"""Devices of the roles (actor/critic/reference/rollout.device, models/precision.py): the keys are
validated, auto resolves to cuda only when torch sees one, cuda without one is a ConfigError
naming the key before anything is built, the data-parallel backend follows the device, an
explicit device=cpu run is bitwise the default run on a CPU machine, and the bf16 weights the
rollout loads are checksummed over their own bf16 bytes. CUDA runs: marked gpu, and
benchmarks/gpu_check.py trains on the device in fp32 and bf16."""
from __future__ import annotations

import hashlib
import json

import pyarrow.parquet as pq
import pytest
import torch

from sealrl.config import ConfigError, build_config
from sealrl.experience.store import read_iteration
from sealrl.models import precision
from sealrl.models.hf import model_config_hash, tokenizer_hash
from sealrl.models.synthetic import build_mid
from sealrl.roles.actor import Actor
from sealrl.roles.reference import Reference
from sealrl.roles.rollout import Rollout
from sealrl.sync.manifest import WeightSyncError, in_dtype
from sealrl.trainer.driver import train
from sealrl.trainer.inputs import check_inputs
from tests.harness import small_args
from tests.test_models_packing import _actor, _update_grads
from tests.test_placement_dp import V0, make_batch, make_model

ROLES = ("actor", "reference", "rollout")   # the critic follows actor.device


@pytest.mark.parametrize("role", ROLES)
def test_device_keys_are_validated(role):
    assert getattr(build_config(None, []), role).device == "auto"
    with pytest.raises(ConfigError, match=f"{role}.device must be one of auto | cpu | cuda, got 'tpu'"):
        build_config(None, [f"{role}.device=tpu"])


@pytest.mark.parametrize("role", ROLES)
def test_cuda_without_cuda_is_a_config_error_naming_the_key(role, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = build_config(None, [f"{role}.device=cuda"])
    with pytest.raises(ConfigError, match=f"{role}.device=cuda asked for, but torch sees no CUDA") as err:
        check_inputs(cfg)   # before any run folder or model exists
    assert err.value.key == f"{role}.device"
    assert {r: d.type for r, d in precision.role_devices(build_config(None, [])).items()} == \
        dict.fromkeys((*ROLES, "critic"), "cpu")


def test_auto_is_cuda_only_where_torch_sees_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # resolving touches no GPU
    assert precision.resolve_device("auto", "actor.device") == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert precision.resolve_device("auto", "actor.device") == torch.device("cpu")
    assert precision.resolve_device("cpu", "actor.device") == torch.device("cpu")


def test_lora_reference_must_be_on_the_actors_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    lora = ["actor.lora.rank=4", "algorithm.kl_coef=0.1", "actor.device=cuda"]
    with pytest.raises(ConfigError, match="the reference is the actor's own model") as err:
        precision.role_devices(build_config(None, [*lora, "reference.device=cpu"]))
    assert err.value.key == "reference.device"
    assert precision.role_devices(build_config(None, [*lora, "reference.device=auto"]))["reference"].type == "cuda"
    assert precision.role_devices(build_config(None, ["actor.device=cuda", "reference.device=cpu"]))["critic"].type \
        == "cuda"   # the critic follows actor.device
    # without LoRA the reference is its own copy and may live elsewhere
    assert precision.role_devices(build_config(None, ["actor.device=cuda", "reference.device=cpu"]))["reference"].type \
        == "cpu"


def test_process_group_backend_follows_the_device():
    assert precision.process_group_backend("cpu") == "gloo"
    assert precision.process_group_backend(torch.device("cpu")) == "gloo"
    assert precision.process_group_backend("cuda") == "nccl"
    assert precision.process_group_backend(torch.device("cuda", 1)) == "nccl"


def test_bf16_rollout_weights_are_checksummed_over_their_own_bytes():
    """The manifest the rollout verifies names the bf16 bytes it loads (hashed here by hand, not
    with the manifest's function); the fp32 export under that manifest is refused."""
    model, tokenizer = build_mid(seed=0, vocab_size=512, hidden=32, layers=1, heads=2, kv_heads=1, mlp=64)
    cfg = build_config(None, ["actor.device=cpu"])
    actor = Actor(model, cfg.actor, cfg.algorithm, "run", tokenizer_hash(tokenizer), 1.0, 0, 10, 8)
    state32, manifest32 = actor.export()
    state16, manifest16 = in_dtype(state32, manifest32, "bf16")
    name = "model.layers.0.mlp.up_proj.weight"
    raw = state32[name].to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
    assert len(raw) == 2 * state32[name].numel()
    assert manifest16.entries[name].sha256 == hashlib.sha256(raw).hexdigest()
    assert manifest16.entries[name].dtype == "bfloat16"
    rows = [[n, list(e.shape), e.dtype, e.sha256] for n, e in sorted(manifest16.entries.items())]
    assert manifest16.version.weights_hash == hashlib.sha256(json.dumps(rows).encode()).hexdigest()
    assert manifest16.version.model_config_hash == model_config_hash(model.config)
    rollout = Rollout(model, tokenizer, device="cpu")
    with pytest.raises(WeightSyncError, match="dtype float32 != manifest bfloat16"):
        rollout.load(state32, manifest16)
    rollout.load(state16, manifest16)
    assert rollout.backend[1] == "bfloat16"
    assert rollout.version.weights_hash == manifest16.version.weights_hash


BASE = small_args("run.loggers=", "data.num_train=32", "run.threads=1", "run.checkpoint_every=0")


@pytest.mark.parametrize("algo", [["algorithm.kl_coef=0.05"], ["algorithm.name=ppo", "algorithm.kl_coef=0.05"]])
def test_explicit_cpu_run_is_bitwise_the_default_run(tmp_path, algo, monkeypatch):
    """Every role on device=cpu, named, against the defaults (auto: cpu where torch sees no
    CUDA, as here): the same weights and the same sealed experience, digest for digest."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    runs = []
    for name, extra in (("auto", []), ("cpu", [f"{r}.device=cpu" for r in ROLES])):
        out = tmp_path / name   # one run name: it is part of every sample id
        summary = train(build_config(None, BASE + algo + extra + [f"run.output_dir={out}", "run.name=r"]))
        files = sorted((out / "r" / "experience").glob("iter_*.parquet"))
        runs.append((summary["weights_hash"], [(read_iteration(p).seal_digest, pq.read_table(p).to_pydict())
                                               for p in files]))
    assert len(runs[0][1]) == 2
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_roles_compute_on_the_device_and_record_cpu_tensors():
    torch.backends.cuda.matmul.allow_tf32 = False
    model = make_model()
    actor = _actor("actor.device=cuda")
    assert all(p.device.type == "cuda" for p in actor.model.parameters())
    metrics, grads = _update_grads(actor)
    assert all(g.device.type == "cuda" for g in grads)
    cpu_metrics, _ = _update_grads(_actor("actor.device=cpu"))
    assert metrics["actor/pg_loss"] == pytest.approx(cpu_metrics["actor/pg_loss"], rel=1e-4, abs=1e-5)
    batches = {}
    for device in ("cpu", "cuda"):
        batch = make_batch()
        Reference(model, V0, 1.0, 0, 16, device=device).compute(batch)
        batches[device] = batch.get("ref_log_probs")
    assert batches["cuda"].device.type == "cpu"
    assert (batches["cuda"] - batches["cpu"]).abs().max() <= 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rollout_holds_the_verified_bf16_bytes_on_the_device():
    from sealrl.sync.manifest import build_manifest, tensor_sha256
    model, tokenizer = build_mid(seed=0, vocab_size=512, hidden=32, layers=1, heads=2, kv_heads=1, mlp=64)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    manifest = build_manifest(state, "run", 1, 0, tokenizer_hash(tokenizer), model_config_hash(model.config))
    state16, manifest16 = in_dtype(state, manifest, "bf16")
    rollout = Rollout(model, tokenizer, device="cuda")
    rollout.load(state16, manifest16)
    embed = rollout.engine.versions.active.held.lm.embed   # what the device samples with
    assert embed.device.type == "cuda" and embed.dtype == torch.bfloat16
    assert tensor_sha256(embed) == manifest16.entries["model.embed_tokens.weight"].sha256


def test_ray_placements_without_gpu_bundles_refuse_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    ray = ["placement.backend=ray"]
    with pytest.raises(ConfigError, match="bundles ask for CPUs only") as err:
        precision.role_devices(build_config(None, [*ray, "rollout.device=cuda"]))
    assert err.value.key == "rollout.device"
    colocated = [*ray, "placement.rollout_pool=colocated", "placement.actor_ranks=2", "placement.rollout_replicas=2"]
    with pytest.raises(ConfigError, match="bundles ask for CPUs only") as err:
        precision.role_devices(build_config(None, colocated))   # auto: the actor on cuda here
    assert err.value.key == "placement.rollout_pool"
    assert precision.role_devices(build_config(None, [*colocated, "actor.device=cpu"]))["actor"].type == "cpu"
    assert precision.role_devices(build_config(None, ray))["rollout"].type == "cuda"   # auto: resolved per process
