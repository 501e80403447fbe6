import os
import re

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


# Files whose tests start a local Ray (or a Ray test cluster); elsewhere a test with "ray" in its
# name or parameters, or one that uses a Ray fixture, does. They are marked `ray`: `make test`
# (scripts/test_lanes.py) runs them in one pytest process, one after another on one shared local
# Ray, while a second process runs the rest. The Ray runs keep the cores busy; most other tests
# wait (deadlines, process starts), so the two overlap well, and two Rays never share the machine.
RAY_FILES = {"test_cluster", "test_feature_matrix", "test_train_group", "test_placement_ray", "test_ray_features",
             "test_ray_attach"}
RAY_NAME = re.compile(r"(^|[_\[\]-])ray([_\[\]-]|$)")
# Files whose tests start a Ray of their own (a test cluster, an attach): the shared local Ray
# (tests/harness.py:local_ray) is stopped before each of them.
OWN_RAY_FILES = {"test_cluster", "test_ray_attach"}


def _file(item) -> str:
    return item.nodeid.split("::", 1)[0].rpartition("/")[2].removesuffix(".py")


def uses_ray(item) -> bool:
    return (_file(item) in RAY_FILES or bool({"ray_session", "shared_ray"} & set(item.fixturenames))
            or bool(RAY_NAME.search(item.nodeid.split("::", 1)[-1].lower())))


@pytest.fixture
def shared_ray():
    """The process's shared local Ray (tests/harness.py): a run that finds it places its pools on
    it. Afterwards no placement group of the test may be left on it (else it is stopped, so that
    the next test starts from a clean one)."""
    from tests.harness import local_ray, stop_local_ray
    local_ray()
    yield
    from ray.util import placement_group_table
    if any(pg["state"] != "REMOVED" for pg in placement_group_table().values()):
        stop_local_ray()


@pytest.fixture(autouse=True)
def _own_ray_alone(request):
    if _file(request.node) in OWN_RAY_FILES:
        from tests.harness import stop_local_ray
        stop_local_ray()
    yield


@pytest.fixture(autouse=True, scope="session")
def _stop_shared_ray_at_the_end():
    yield
    from tests.harness import stop_local_ray
    stop_local_ray()


def pytest_collection_modifyitems(config, items):
    for item in items:   # `pytest -m unit | contract | e2e` selects one kind
        module = getattr(item, "module", None)
        if module is not None:
            item.add_marker(kind(module))
        if uses_ray(item):
            item.add_marker("ray")
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is present on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
