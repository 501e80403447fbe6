import subprocess
import sys

import pytest

from sealrl.config import ConfigError, build_config, check_config, config_diff, load_config


def test_defaults_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("actor:\n  lr: 3.0e-5\nrollout:\n  n: 4\n")
    cfg = load_config(str(f), ["rollout.n=8", "actor.betas=[0.9, 0.95]", "run.name=x1", "run.stage_timeout_s=60"])
    assert cfg.actor.lr == 3e-5 and cfg.rollout.n == 8           # override beats file
    assert cfg.actor.betas == (0.9, 0.95) and cfg.run.name == "x1" and cfg.run.stage_timeout_s == 60
    assert cfg.hash() == load_config(str(f), ["rollout.n=8", "actor.betas=[0.9, 0.95]", "run.name=x1",
                                              "run.stage_timeout_s=60"]).hash()
    assert cfg.hash() != load_config(str(f), ["rollout.n=7"]).hash()


@pytest.mark.parametrize("override, message", [
    ("actor.lrr=1e-5", "unknown config key actor.lrr; did you mean 'actor.lr'?"),
    ("actr.lr=1e-5", "unknown config section 'actr' in 'actr.lr=1e-5'; did you mean 'actor'?"),
    ("rollout.n=abc", "rollout.n must be of type int, got 'abc'"),
    ("rollout.n=0", "rollout.n must be >= 1, got 0"),
    ("rollout.temperature=-1", "rollout.temperature must be > 0, got -1.0"),
    ("algorithm.name=grp", "algorithm.name must be grpo | dr_grpo"),
    ("run.name=../escape", "run.name must be a plain folder name, got '../escape'"),
    ("actor.dual_clip=0.5", "actor.dual_clip must be 0 or > 1, got 0.5"),
    ("nodot", "override 'nodot' must look like section.key=value"),
])
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        build_config(None, [override])
    assert message in str(e.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    typo = tmp_path / "typo.yaml"
    typo.write_text("rollout:\n  temprature: 0.7\n")
    with pytest.raises(ConfigError, match="did you mean 'rollout.temperature'"):
        load_config(str(typo))


def test_config_diff():
    a, b = build_config(), build_config(None, ["actor.lr=1e-5"])
    assert config_diff(a.to_dict(), b.to_dict()) == ["actor.lr: 0.0001 -> 1e-05"]


def test_cli_errors_are_one_line(tmp_path):
    for args in (["train", str(tmp_path / "nope.yaml")], ["train", "examples/arith_grpo.yaml", "actor.lrr=1"]):
        out = subprocess.run([sys.executable, "-m", "sealrl.cli", *args], capture_output=True, text=True)
        assert out.returncode == 2
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("sealrl: error: "), out.stderr
        assert "Traceback" not in out.stderr


@pytest.mark.parametrize("correction", ["token_is", "seq_is", "token_reject", "seq_reject"])
def test_correction_in_bypass_mode_is_refused_naming_both_keys(correction):
    # bypass: old = rollout, so the weights would be exactly 1 and nothing rejected
    with pytest.raises(ConfigError) as e:
        build_config(None, ["algorithm.old_log_prob=bypass", f"algorithm.correction={correction}"])
    assert "algorithm.correction" in str(e.value) and "algorithm.old_log_prob" in str(e.value)
    assert "\n" not in str(e.value)
    build_config(None, ["algorithm.old_log_prob=recompute", f"algorithm.correction={correction}"])
    build_config(None, ["algorithm.old_log_prob=bypass", "algorithm.correction=none"])


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.kl_target=0.01"], "algorithm.kl_target > 0 needs algorithm.kl_coef > 0"),
    (["algorithm.kl_coef=0.1", "algorithm.kl_target=0.01", "algorithm.kl_horizon=0"],
     "algorithm.kl_horizon must be >= 1, got 0"),
    (["algorithm.kl_target=-1"], "algorithm.kl_target must be >= 0"),
])
def test_adaptive_kl_settings_are_checked_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config(None, overrides)


def test_critic_minibatch_must_divide_the_batch_and_the_optimal_token_baseline_needs_no_env():
    from sealrl.config import ConfigError
    ok = build_config(None, ["algorithm.name=ppo", "critic.mini_batch_size=16", "data.prompts_per_iter=8",
                             "rollout.n=4"])
    check_config(ok)
    with pytest.raises(ConfigError, match="critic.mini_batch_size=12 must divide the batch"):
        check_config(build_config(None, ["algorithm.name=ppo", "critic.mini_batch_size=12",
                                         "data.prompts_per_iter=8", "rollout.n=4"]))
    with pytest.raises(ConfigError, match="optimal_token_baseline with a multi-turn environment"):
        check_config(build_config(None, ["algorithm.name=optimal_token_baseline", "env.name=calc"]))


def _leaf_keys(obj, prefix: str = "") -> list[str]:
    import dataclasses
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out += _leaf_keys(value, f"{prefix}{f.name}.") if dataclasses.is_dataclass(value) else [prefix + f.name]
    return out


# The config keys a user can set (every leaf, nested sections included). A new key is a cost every
# user pays in reading the docs: raise this only with a key that trades something a user must
# choose, and say so in the commit (STYLE.md rule 12). 138 at session 9; session 10 added
# run.keep_checkpoints, reward.scorer_memory_mb, critic.ppo_epochs / mini_batch_size /
# micro_batch_size, algorithm.mismatch_tol, rollout.backend and four rollout.vllm.* keys (149).
# Session 11 (issue 29, fast by default) removed twelve: the five actor keys that chose between
# equivalent implementations (lean_forward, share_prompts, pack_sequences, fused_adamw,
# logit_chunk_keep) and critic.fused_adamw, now the fast path's or run.exact's; the critic's
# warmup_steps and gradient_checkpointing, which follow the actor's; rollout.continuous_batching
# (always, when rows are bounded); rollout.vllm.max_num_seqs (rollout.max_rows); run.progress (a
# bar on a terminal); eval.temperature (rollout.temperature). It added run.exact: 138.
# Session 13 (issue 27, say where each role goes) added six placement keys: strategy,
# cpus_per_rank, gpus_per_replica, replica_resources, rank_resources, head_grace_s, and
# reference (driver | ray: the KL reference off the driver): 145.
# Session 14 (issue 31) added algorithm.mismatch_action (stop | drop_group: end the run or train on
# without the groups past algorithm.mismatch_tol, a trade only the user can choose): 146.
# Session 16 (issue 27, item 2: the scorers as a Ray role when the user wants them off the
# driver) added placement.scorers (driver | ray), the twin of placement.reference: 147.
# Session 18 (issue 29: the count may not grow past 138) removed nine that choose nothing a user
# needs apart: the critic's weight_decay, adam_eps, dtype, device and its four lora.* keys follow
# the actor's (OpenRLHF shares them the same way), and data.num_eval is eval.num (a generated task
# makes that many held-out problems; the first k of n are the same k problems): 138.
KEY_BUDGET = 138


def test_the_number_of_config_keys_does_not_grow_unnoticed():
    keys = _leaf_keys(build_config())
    assert len(keys) == len(set(keys)) == KEY_BUDGET, f"{len(keys)} keys; KEY_BUDGET is {KEY_BUDGET}"
