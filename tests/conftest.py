import os

# Idle OpenMP threads spin by default and, on 2 shared cores, slow everything else many-fold.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="session")
def one_thread():
    """The test models are tiny: one thread is as fast as two here and never waits for a core
    that another process holds. Runs that set run.threads change it for their duration only."""
    import torch
    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A small random Llama + char tokenizer saved as a Hugging Face folder (built, not downloaded)."""
    from sealrl.models.hf import save_causal_lm
    from sealrl.models.tiny import build_tiny_model
    model, tok = build_tiny_model(seed=0, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64)
    path = tmp_path_factory.mktemp("tiny") / "model"
    save_causal_lm(model, tok, path)
    return str(path)


# the contract suites: one protocol, every implementation (the rollout clients, the remote roles,
# the layering of the package, verl's own functions as golden values)
CONTRACT = {"test_rollout_conformance", "test_layers", "test_algos_verl", "test_algos_properties"}
# files whose tests train runs through a helper of another file or the command line
E2E = {"test_async_variants", "test_cluster", "test_exact_resume", "test_mismatch", "test_process_lane",
       "test_reward_faults", "test_rewards_config"}


def kind(module) -> str:
    """unit | contract | e2e: a file in CONTRACT; a file whose tests train runs (in E2E, or it
    imports the driver's `train` or the harness's `small_run`); else a unit test file."""
    name = module.__name__.rpartition(".")[2]
    if name in CONTRACT:
        return "contract"
    if name in E2E:
        return "e2e"
    from sealrl.trainer.driver import train
    from tests.harness import small_run
    trains = any(v is train or v is small_run for v in vars(module).values())
    return "e2e" if trains else "unit"


def pytest_collection_modifyitems(config, items):
    for item in items:   # `pytest -m unit | contract | e2e` selects one kind
        module = getattr(item, "module", None)
        if module is not None:
            item.add_marker(kind(module))
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
