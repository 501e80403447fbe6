"""What the training lane keeps in memory: the rollback snapshot copies the committed state only
just before the first optimizer step (never beside the update's activations) and restores it
bit for bit; gradients are freed after the step; a synchronous run keeps no copy of the
weights it published (the rollout holds its own)."""
from __future__ import annotations

import os
import subprocess
import sys
import weakref
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sealrl.config import build_config
from sealrl.models.hf import tokenizer_hash
from sealrl.models.tiny import build_tiny_model
from sealrl.roles.actor import Actor
from sealrl.roles.rollout import Rollout
from sealrl.trainer.driver import publish
from tests.test_placement_dp import HORIZON, V0, make_batch, make_model

ROOT = Path(__file__).resolve().parents[1]


def make_actor() -> Actor:
    cfg = build_config(None, [])
    return Actor(make_model(), cfg.actor, cfg.algorithm, "run", "tok", 1.0, 0, 10, HORIZON)


def state(actor: Actor) -> tuple[dict, dict]:
    """(weights, AdamW moments and step counts) as copies, to compare bit for bit."""
    weights = {k: v.clone() for k, v in actor.model.state_dict().items()}
    optim = {(i, k): t.clone() for i, s in enumerate(actor.optimizer.state.values()) for k, t in s.items()}
    return weights, optim


def assert_equal_state(a: tuple[dict, dict], b: tuple[dict, dict]) -> None:
    assert a[0].keys() == b[0].keys() and a[1].keys() == b[1].keys()
    for x, y in ((a[0], b[0]), (a[1], b[1])):
        for k in x:
            assert torch.equal(x[k], y[k]), k


def test_snapshot_copies_only_after_the_backward_and_restores_the_committed_state():
    actor = make_actor()
    actor.update(make_batch(), V0, 0, seed=1, kl_coef=0.0)   # AdamW has moments now
    committed, step = state(actor), actor.step
    snap = actor.snapshot()
    copied_during_forward = []
    hook = actor.model.register_forward_hook(lambda *_: copied_during_forward.append(snap.model is not None))
    actor.update(make_batch(), V0, 1, seed=2, kl_coef=0.0)
    hook.remove()
    assert copied_during_forward == [False]   # one forward, no copy beside its activations
    assert snap.model is not None and actor.step == step + 1
    assert any(not torch.equal(v, committed[0][k]) for k, v in actor.model.state_dict().items())
    actor.restore(snap)
    assert actor.step == step
    assert_equal_state(state(actor), committed)
    # the retry after the rollback gives what an update that never failed gives, bit for bit
    actor.update(make_batch(), V0, 1, seed=2, kl_coef=0.0)
    plain = make_actor()
    plain.update(make_batch(), V0, 0, seed=1, kl_coef=0.0)
    plain.update(make_batch(), V0, 1, seed=2, kl_coef=0.0)
    assert_equal_state(state(actor), state(plain))


def test_an_update_failing_before_its_step_copies_nothing_and_rolls_back(monkeypatch):
    actor = make_actor()
    actor.update(make_batch(), V0, 0, seed=1, kl_coef=0.0)
    committed, step = state(actor), actor.step
    snap = actor.snapshot()

    def fail(*_a, **_k):
        raise RuntimeError("injected: after the backward, before the step")
    monkeypatch.setattr(actor.optimizer, "step", fail)
    with pytest.raises(RuntimeError, match="injected"):
        actor.update(make_batch(), V0, 1, seed=2, kl_coef=0.0)
    # the copy is taken just before optimizer.step is called: this failure came after it
    assert snap.model is not None
    monkeypatch.undo()
    snap2 = actor.snapshot()

    def fail_backward(*_a, **_k):
        raise RuntimeError("injected: in the loss")
    monkeypatch.setattr(actor, "_policy_loss", fail_backward)
    with pytest.raises(RuntimeError, match="in the loss"):
        actor.update(make_batch(), V0, 1, seed=2, kl_coef=0.0)
    assert snap2.model is None   # nothing was copied: the weights never changed
    actor.restore(snap2)
    assert actor.step == step and all(p.grad is None for p in actor.model.parameters())
    assert_equal_state(state(actor), committed)


def test_restore_refuses_a_state_changed_without_a_step():
    actor = make_actor()
    snap = actor.snapshot()
    with torch.no_grad():
        next(actor.model.parameters()).add_(1.0)   # in place, outside any optimizer step
    with pytest.raises(RuntimeError, match="changed without an optimizer step"):
        actor.restore(snap)


def test_only_the_newest_snapshot_is_filled_and_a_dropped_one_never():
    actor = make_actor()
    old, new = actor.snapshot(), actor.snapshot()
    actor.update(make_batch(), V0, 0, seed=1, kl_coef=0.0)
    assert old.model is None and new.model is not None   # one copy per step, not one per snapshot
    with pytest.raises(RuntimeError, match="changed without an optimizer step"):
        actor.restore(old)   # stale: refused, never silently wrong
    dropped = weakref.ref(actor.snapshot())   # dropped at once: the registry keeps it not alive
    assert dropped() is None


def test_a_one_step_update_keeps_no_copy_and_rolls_back_only_before_its_step(monkeypatch):
    """Snapshot(copy=False), what the driver takes when the actor's update is one optimizer step:
    nothing is ever copied; a failure before the step restores the committed state, bit for bit;
    one after the step changed it raises NoRollback (never a silent wrong restore)."""
    from sealrl.roles.common import NoRollback
    actor = make_actor()
    actor.update(make_batch(), V0, 0, seed=1, kl_coef=0.0)
    committed, step = state(actor), actor.step
    stale = actor.snapshot()   # a copying snapshot the next one replaces: never filled either
    snap = actor.snapshot(copy=False)

    def fail_loss(*_a, **_k):
        raise RuntimeError("injected: in the loss")
    monkeypatch.setattr(actor, "_policy_loss", fail_loss)
    with pytest.raises(RuntimeError, match="in the loss"):
        actor.update(make_batch(), V0, 1, seed=2, kl_coef=0.0)
    monkeypatch.undo()
    actor.restore(snap)
    assert actor.step == step and snap.model is None and stale.model is None
    assert_equal_state(state(actor), committed)

    import sealrl.roles.actor as actor_module
    snap = actor.snapshot(copy=False)
    monkeypatch.setattr(actor_module.algos, "ratio_stats", lambda *_: (_ for _ in ()).throw(RuntimeError("after")))
    with pytest.raises(RuntimeError, match="after"):   # the step ran, then the update's metrics failed
        actor.update(make_batch(), V0, 1, seed=2, kl_coef=0.0)
    assert snap.model is None and actor.step == step + 1
    with pytest.raises(NoRollback, match="keeps no copy"):
        actor.restore(snap)


def test_the_driver_copies_only_for_an_update_of_several_steps(monkeypatch):
    """update_with_rollback: one optimizer step (the default, one minibatch and one epoch) takes the
    snapshot without a copy, and a failure after that step stops the run, named; two steps copy."""
    import sealrl.roles.actor as actor_module
    from sealrl.trainer.state import StageFailed
    from sealrl.trainer.update import update_with_rollback
    for epochs, copies in ((1, False), (2, True)):
        actor = make_actor()
        actor.cfg.ppo_epochs = epochs
        cfg = build_config(None, [f"actor.ppo_epochs={epochs}"])
        run = SimpleNamespace(cfg=cfg, roles=SimpleNamespace(actor=actor, critic=None),
                              kl_ctl=SimpleNamespace(beta=0.0))
        taken = []
        real = actor.snapshot
        monkeypatch.setattr(actor, "snapshot", lambda copy=True: taken.append(copy) or real(copy))
        assert update_with_rollback(run, make_batch(), V0, 0)["update/attempts"] == 1
        assert taken == [copies] and actor.step == epochs
        monkeypatch.setattr(actor_module.algos, "ratio_stats", lambda *_: (_ for _ in ()).throw(RuntimeError("late")))
        if copies:   # restored from the copy, tried again, failed again: named, state restored
            with pytest.raises(StageFailed, match=r"iteration 1: update failed at attempt 2 .*late.*restored"):
                update_with_rollback(run, make_batch(), V0, 1)
            assert actor.step == epochs
        else:
            with pytest.raises(StageFailed, match=r"iteration 1: update failed at attempt 1 \(RuntimeError: late\) "
                                                  r"and cannot be rolled back: .*keeps no copy"):
                update_with_rollback(run, make_batch(), V0, 1)
        monkeypatch.undo()


def test_gradients_are_freed_after_the_optimizer_step():
    actor = make_actor()
    actor.update(make_batch(), V0, 0, seed=1, kl_coef=0.0)
    assert actor.step == 1 and all(p.grad is None for p in actor.model.parameters())


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_synchronous_publish_keeps_no_copy_of_the_published_weights(staleness):
    model, tokenizer = build_tiny_model(seed=0, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    cfg = build_config(None, [f"rollout.max_staleness={staleness}"])
    actor = Actor(model, cfg.actor, cfg.algorithm, "run", tokenizer_hash(tokenizer), 1.0, 0, 10, HORIZON)
    run = SimpleNamespace(cfg=cfg, roles=SimpleNamespace(actor=actor, rollout=Rollout(model, tokenizer),
                                                            rollout_base=None),
                          stage=lambda *_: nullcontext(), to=lambda *_: None, last_weights=None)
    version = publish(run)
    assert run.roles.rollout.version == version
    if staleness == 0:
        assert run.last_weights is None   # the rollout verified and holds its own copy
    else:   # an asynchronous lane checkpoints the versions it still samples from
        assert run.last_weights.keys() == model.state_dict().keys()


# Run in a fresh interpreter: the heap of a long test session (earlier tests, glibc's dynamic
# mmap and trim thresholds) decides where blocks land; a new process starts from glibc's defaults.
# A "pass" allocates and touches 6 blocks of 40 MiB, then frees them (an update's activations,
# a logits chunk); the last of four passes' page faults say whether the earlier passes' memory
# was there to reuse. Blocks above 32 MiB (glibc's largest dynamic mmap threshold) are always
# mmapped by default, so without holding every pass faults its pages in again, whatever else
# the heap holds.
BLOCKS, BLOCK_FLOATS = 6, 10 * 2**20   # a pass: 6 fp32 blocks of 40 MiB
HOLD = f"""
import os, resource, sys, torch
from sealrl.trainer.memory import hold_freed_memory
held = hold_freed_memory() if sys.argv[1] == "hold" else None
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def a_pass():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [torch.ones({BLOCK_FLOATS}) for _ in range({BLOCKS})]
    peak = rss()
    del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, peak
(_, first_peak), _, _, (faults, peak) = [a_pass() for _ in range(4)]
print(held, faults, first_peak, peak)
"""


def _last_pass(mode: str) -> tuple[str, int, int, int]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env = {k: v for k, v in env.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}   # glibc's defaults
    out = subprocess.run([sys.executable, "-c", HOLD, mode], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    held, *numbers = out.stdout.split()
    return held, *map(int, numbers)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux (glibc's malloc, page faults)")
def test_held_memory_is_reused_without_page_faults():
    held, faults, first_peak, peak = _last_pass("hold")
    if held != "True":
        pytest.skip("no mallopt in this C library")
    default_faults = _last_pass("default")[1]
    pass_bytes = BLOCKS * BLOCK_FLOATS * 4
    pages = pass_bytes // os.sysconf("SC_PAGE_SIZE")   # what a pass touches
    assert default_faults >= pages // 2   # glibc's default: the blocks went back to the OS at free()
    assert faults < pages // 50           # held: the last pass reuses the earlier passes' pages
    # the heap may settle up to about a pass higher (a block cannot always reuse the hole of an
    # equal one: alignment slack); growing by a pass each time would be 3 passes by the last one
    assert peak - first_peak < pass_bytes * 3 // 2
