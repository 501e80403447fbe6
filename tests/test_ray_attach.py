"""Ray pools on the local Ray sealrl starts: one the machine cannot hold fails at once, one past
what is free after a short grace, each in one line; a worker running other code than the driver
is refused naming it. (Attaching through RAY_ADDRESS and placing roles by custom resources on a
multi-node cluster: tests/test_cluster.py.)"""
from __future__ import annotations

import pytest

ray = pytest.importorskip("ray", reason="placement=ray needs ray: pip install 'sealrl[ray]'")


@pytest.mark.slow
def test_a_pool_the_local_ray_cannot_hold_fails_at_once_naming_asked_and_free(monkeypatch):
    import time

    from sealrl.placement import workers
    from sealrl.placement.workers import PlacementError, PoolSpec, RayPool, init_ray
    monkeypatch.setattr(workers, "LOCAL_GRACE_S", 3.0)   # the grace is what is waited: 20 s by default
    init_ray(num_cpus=2)
    try:
        t0 = time.monotonic()
        with pytest.raises(PlacementError, match=r"3 x \{'CPU': 1.0\} = \{'CPU': 3.0\} cannot be placed; "
                                                 r"the cluster has CPU 2 in all, 2 free"):
            RayPool(PoolSpec(name="actor", roles=("actor",), num_workers=3), timeout_s=300)
        held = RayPool(PoolSpec(name="actor", roles=("actor",), num_workers=2), timeout_s=300)
        with pytest.raises(PlacementError, match=r"'rollout' \(rollout\).* was not free within 3 s; "
                                                 r"the cluster has CPU 2 in all, 0 free"):
            RayPool(PoolSpec(name="rollout", roles=("rollout",), num_workers=1), timeout_s=300)
        assert time.monotonic() - t0 < 60   # the local grace, never the 300 s timeout
        held.close()
    finally:
        ray.shutdown()


class _Nothing:
    pass


@pytest.mark.slow
def test_a_worker_running_other_code_than_the_driver_is_refused_naming_it(monkeypatch):
    from sealrl.placement import workers
    workers.init_ray(num_cpus=2)
    try:
        pool = workers.RayPool(workers.PoolSpec(name="rollout", roles=("rollout",), num_workers=1), timeout_s=60)
        group = workers.RayWorkerGroup("rollout", _Nothing, pool, timeout_s=60)   # same code: accepted
        assert workers.HOSTS[("rollout", 0)]["sealrl"] == workers.host_info()["sealrl"]
        real = workers.host_info
        monkeypatch.setattr(workers, "host_info", lambda: {**real(), "sealrl": "0123456789abcdef"})  # the driver's
        with pytest.raises(workers.PlacementError, match=r"rollout worker 0 on host .* runs sealrl [0-9a-f]{16}, "
                                                         r"the driver 0123456789abcdef: install the same"):
            group.restart(0, timeout_s=60)
    finally:
        ray.shutdown()
