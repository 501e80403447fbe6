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


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
