"""Device and precision (models/precision.py) and gradient checkpointing: bf16 mixed precision
keeps fp32 master weights, fp32 gradients and fp32 AdamW state while the matmuls run in bf16;
the bf16 reference holds bf16 weights; checkpointed actor and critic updates equal plain ones."""
from __future__ import annotations

import pytest
import torch

from sealrl.config import ConfigError, build_config
from sealrl.models import precision
from sealrl.models.critic import CriticModel
from sealrl.models.packing import TeacherForcing
from sealrl.roles.common import batch_log_probs
from sealrl.roles.critic import Critic
from sealrl.roles.reference import Reference
from tests.test_models_packing import _actor, _update_grads
from tests.test_placement_dp import HORIZON, V0, make_batch, make_model


def test_resolve_device_and_dtype():
    assert precision.resolve_device("cpu") == torch.device("cpu")
    assert precision.resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert precision.torch_dtype("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="fp32 | bf16"):
        precision.torch_dtype("fp16")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            precision.resolve_device("cuda")


def test_dtype_keys_are_validated():
    with pytest.raises(ConfigError, match="actor.dtype"):
        build_config(None, ["actor.dtype=fp16"])
    with pytest.raises(ConfigError, match="config key critic.dtype was removed: the critic follows actor.dtype"):
        build_config(None, ["critic.dtype=bf16"])
    with pytest.raises(ConfigError, match="logit_chunk_tokens"):
        build_config(None, ["actor.logit_chunk_tokens=-1"])


def test_bf16_actor_update_keeps_fp32_master_weights_and_state():
    m32, g32 = _update_grads(_actor())
    actor = _actor("actor.dtype=bf16")
    m16, g16 = _update_grads(actor)
    assert all(p.dtype == torch.float32 for p in actor.model.parameters())
    assert all(g.dtype == torch.float32 for g in g16)
    # bf16 compute moves the numbers (so it ran in bf16) but not far (same maths)
    assert m16["actor/pg_loss"] != m32["actor/pg_loss"]
    assert m16["actor/pg_loss"] == pytest.approx(m32["actor/pg_loss"], rel=0.05, abs=0.02)
    del actor.optimizer.step  # the real AdamW step: its state is fp32
    actor.update(make_batch(), V0, 0, 1, kl_coef=0.0)
    state = actor.optimizer.state[next(actor.model.parameters())]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


def test_bf16_reference_holds_bf16_weights_and_fp32_log_probs():
    model, batch = make_model(), make_batch()
    ref = Reference(model, V0, 1.0, 0, 16, dtype="bf16")
    assert all(p.dtype == torch.bfloat16 for p in ref.model.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the actor's copy is untouched
    ref.compute(batch)
    lp16 = batch.get("ref_log_probs")
    lp32, _ = batch_log_probs(model, batch, 1.0, 0, 16)
    assert lp16.dtype == torch.float32
    diff = (lp16 - lp32).abs().max()
    assert 0 < diff <= 0.1


@pytest.mark.parametrize("extra, fast", [([], False), (["actor.logit_chunk_tokens=4"], True)])
def test_gradient_checkpointing_equals_the_plain_actor_update(extra, fast):
    m0, g0 = _update_grads(_actor(*extra, fast=fast))
    actor = _actor("actor.gradient_checkpointing=true", *extra, fast=fast)
    assert actor.model.is_activation_checkpointing
    m1, g1 = _update_grads(actor)
    assert m1["actor/pg_loss"] == pytest.approx(m0["actor/pg_loss"], rel=1e-6)
    for a, b in zip(g0, g1):
        assert (a - b).abs().max() <= 1e-6 * max(1.0, float(a.abs().max()))


def test_gradient_checkpointing_equals_the_plain_critic_update():
    out = []
    for on in (False, True):   # the critic follows actor.gradient_checkpointing (trainer/setup.py)
        cfg = build_config(None, ["algorithm.name=ppo"])
        torch.manual_seed(0)
        critic = Critic(CriticModel.from_causal_lm(make_model()), cfg.critic, 0, 16, "token-mean", HORIZON,
                        tf=TeacherForcing(micro_batch_size=3), checkpointing=on)
        assert critic.model.backbone.is_activation_checkpointing == on
        batch = make_batch()
        critic.compute(batch)
        batch.put("returns", batch.get("advantages") + batch.get("values"), "driver", "test")
        grads = []
        critic.optimizer.step = lambda c=critic: grads.append([p.grad.clone() for p in c.model.parameters()])
        out.append((critic.update(batch)["critic/value_loss"], grads[0]))
    assert out[1][0] == pytest.approx(out[0][0], rel=1e-6)
    for a, b in zip(out[0][1], out[1][1]):
        assert (a - b).abs().max() <= 1e-6 * max(1.0, float(a.abs().max()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_chunked_packed_bf16_update_runs_on_the_device():
    actor = _actor("actor.dtype=bf16", "actor.logit_chunk_tokens=4", fast=True)
    actor.model.cuda()
    actor.optimizer = actor.make_optimizer()
    metrics, grads = _update_grads(actor)
    assert all(g.device.type == "cuda" and g.dtype == torch.float32 for g in grads)
    assert metrics["actor/grad_norm"] > 0


def test_fused_adamw_takes_the_default_steps_up_to_rounding():
    """The fast path's AdamW (actor and critic): torch's fused kernel, the same AdamW update as
    the default loop to float rounding (three real steps, then the weights compared); with
    run.exact the default, the per-parameter loop on the CPU. Both actors take the fast
    forward, so only the optimizer differs: the two forwards differ by their own rounding,
    which Adam's normalised step can magnify where a gradient is near adam_eps."""
    weights = {}
    for fused in (False, True):
        actor = _actor(fast=True)
        if not fused:   # the default loop's optimizer (run.exact's), the same forward
            actor.exact = True
            actor.optimizer = actor.make_optimizer()
            actor.exact = False
        assert actor.optimizer.defaults["fused"] is (True if fused else None)
        for step in range(3):
            actor.update(make_batch(), V0, step, step, kl_coef=0.0)
        weights[fused] = [p.detach().clone() for p in actor.model.parameters()]
    start = [p.detach() for p in make_model().parameters()]
    moved = max(float((a - b).abs().max()) for a, b in zip(weights[False], start))
    assert moved > 1e-4   # the steps moved the weights (lr 1e-3)
    assert max(float((a - b).abs().max()) for a, b in zip(weights[False], weights[True])) <= 1e-6
    cfg = build_config(None, ["algorithm.name=ppo"])
    critic = Critic(CriticModel.from_causal_lm(make_model()), cfg.critic, 0, 16, "token-mean", HORIZON, fused=True)
    assert critic.optimizer.defaults["fused"] is True
