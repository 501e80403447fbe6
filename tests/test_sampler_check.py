"""benchmarks/sampler_check.py: sealrl's rollout engine and Hugging Face `generate` (as TRL calls
it) both draw from softmax(logits / T) of the model, judged by one plain HF forward; and a judge at
another temperature sees the difference (the check has teeth). The embedded model, T = 1.5."""
from sealrl.config.sections import EMBEDDED_MODEL
from tests.harness import embedded_run, load_benchmark


def test_both_samplers_draw_from_the_models_distribution(tmp_path):
    check = load_benchmark("sampler_check")
    run = embedded_run(tmp_path, "run.iterations=1", "rollout.temperature=1.5", "data.prompts_per_iter=64")
    exp = str(run / "experience" / "iter_000000.parquet")
    report = check.main([exp, "--model", str(EMBEDDED_MODEL), "--threads", "1"])
    for side in ("sealrl", "hf_generate"):
        r = report[side]
        assert r["responses"] == 512 and r["tokens"] > 512
        # Under a correct sampler each response's sum of (surprisal - entropy) has mean 0; the
        # mean over 512 responses is then within 4 standard errors (a 6e-5 two-sided chance when
        # the sampler is right; the seeds are fixed, so the outcome is too).
        assert abs(r["surprisal_minus_entropy"]["z"]) < 4.0
        assert r["pit_ks"]["p_value"] > 1e-4
    # the engine's recorded behaviour log-probs are the judge's, to fp32 rounding of a few ops
    assert report["sealrl"]["max_abs_recorded_minus_judge"] < 1e-4
    # Judged at T = 1 the T = 1.5 samples are too surprising: both sides fail the check.
    wrong = check.main([exp, "--model", str(EMBEDDED_MODEL), "--threads", "1", "--judge-temperature", "1.0"])
    for side in ("sealrl", "hf_generate"):
        assert wrong[side]["surprisal_minus_entropy"]["z"] > 4.0
