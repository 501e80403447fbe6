"""The small run that end-to-end tests start from, so a test names only what it changes.

`SMALL`: the embedded warm start on the arithmetic task, 48 training rows, 4 held-out, two
iterations of 4 prompts x 4 candidates of at most 5 tokens, one micro-batch of 16, lr 1e-3,
seed 1: a run of about a second on one core whose groups carry signal.
`small_args(*overrides)` is that config's override list with the test's own merged in (each key
once, as the command line requires; a test's value replaces SMALL's); `small_run(out, name,
*overrides)` trains it into out/name.
"""
from __future__ import annotations

from pathlib import Path

SMALL = ("run.iterations=2", "data.num_train=48", "eval.num=4", "data.prompts_per_iter=4", "rollout.n=4",
         "rollout.max_new_tokens=5", "actor.micro_batch_size=16", "actor.lr=1e-3", "run.seed=1")


def small_args(*overrides: str) -> list[str]:
    merged = dict(item.split("=", 1) for item in SMALL)
    for item in overrides:
        key, value = item.split("=", 1)
        merged[key] = value
    return [f"{k}={v}" for k, v in merged.items()]


def small_run(out: Path, name: str, *overrides: str) -> tuple[dict, Path]:
    """(summary, run folder) of the small run with `overrides`, trained into out/name."""
    from sealrl.config import build_config
    from sealrl.trainer.driver import train
    summary = train(build_config(None, small_args(*overrides, f"run.output_dir={out}", f"run.name={name}")))
    return summary, Path(out) / name


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (the benchmarks folder is not a package)."""
    import importlib.util
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def embedded_run(out: Path, *overrides: str) -> Path:
    """The folder of a run of the embedded model's defaults with `overrides` (no evaluation, a
    checkpoint at the end only), trained into out/r."""
    from sealrl.config import build_config
    from sealrl.trainer.driver import train
    train(build_config(None, ["eval.num=0", "run.eval_every=0", "run.checkpoint_every=0", *overrides,
                              f"run.output_dir={out}", "run.name=r"]))
    return Path(out) / "r"


# ---- one local Ray for the Ray tests of a process ----------------------------------------------
_LOCAL_RAY = {"up": False}


def local_ray(num_cpus: int = 6) -> None:
    """The local Ray the Ray tests of this process share, started on first use (a start costs
    ~4 s and a stop ~1.5 s on 2 cores). A run that finds Ray initialised places its pools on it
    and leaves it up; `num_cpus` are logical (2 replicas, 2 actor ranks and 2 critic ranks at the
    most any test asks). tests/conftest.py stops it before a test that starts a Ray of its own,
    and at the end of the session."""
    import ray

    from sealrl.placement.workers import init_ray
    if _LOCAL_RAY["up"] and ray.is_initialized():
        return
    if ray.is_initialized():   # someone else's: never share it
        ray.shutdown()
    init_ray(num_cpus=num_cpus)
    _LOCAL_RAY["up"] = True


def stop_local_ray() -> None:
    if _LOCAL_RAY["up"]:
        import ray
        ray.shutdown()
        _LOCAL_RAY["up"] = False
