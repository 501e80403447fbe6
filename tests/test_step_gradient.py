"""benchmarks/step_gradient.py: sealrl's GRPO update step has the gradient of TRL's GRPO loss
(loss_type="dapo", one iteration) written out on the plain Hugging Face model, on a run's sealed
first batch; and replaying every batch of a run with that loss and torch's AdamW ends at the run's
weights. The embedded model, the fast path, several micro-batches, a temperature other than 1."""
import yaml

from sealrl.config import build_config
from sealrl.experience.store import iteration_path, read_iteration
from tests.harness import embedded_run, load_benchmark

step = load_benchmark("step_gradient")
WORKLOAD = ("rollout.temperature=1.5", "actor.micro_batch_size=16")


def _config(run):
    return build_config(yaml.safe_load((run / "config.yaml").read_text()), [])


def test_the_first_update_is_trls_grpo_loss(tmp_path):
    run = embedded_run(tmp_path, "run.iterations=1", "data.prompts_per_iter=16", *WORKLOAD)
    cfg, batch = _config(run), read_iteration(iteration_path(run / "experience", 0))
    ours = step.sealrl_side(cfg, batch)[0]
    out = step.compare(ours, step.trl_side(cfg, batch)[0])
    assert out["grad_norm_sealrl"] > 0.0
    # The two sides sum the same fp32 terms in other orders (packed shared-prompt rows in
    # micro-batches against one padded-free sequence at a time): a few units of fp32's 1.2e-7 per
    # accumulation, far below 1e-4 of each tensor's largest entry; a wrong sign, scale, mask or
    # temperature moves whole tensors (relative differences of order 1).
    assert out["max_rel_diff"] < 1e-4 and abs(out["cosine"] - 1.0) < 1e-6
    cfg.rollout.temperature = 1.0   # the check has teeth: the loss at another temperature is another gradient
    assert step.compare(ours, step.trl_side(cfg, batch)[0])["max_rel_diff"] > 1e-2


def test_replaying_a_whole_run_with_trls_loss_and_step_gives_its_final_weights(tmp_path):
    run = embedded_run(tmp_path, "run.iterations=3", "data.prompts_per_iter=4", *WORKLOAD)
    cfg = _config(run)
    out = step.replay_report(cfg, run, 3)
    assert out["change_norm_trained"] > 0.0
    # Each step's gradients agree to fp32 summation order (the test above); AdamW divides by
    # sqrt(v), which can enlarge a rounding difference on an entry whose gradient is near zero,
    # but such entries carry a small share of the change: 1e-3 of it allows that with room. A
    # replay at another temperature takes other steps from the first on (a share of order 0.1).
    assert out["difference_over_change"] < 1e-3 and out["change_cosine"] > 1 - 1e-6
    cfg.rollout.temperature = 1.0
    assert step.replay_report(cfg, run, 3)["difference_over_change"] > 1e-2
