"""A rollout role that forces a partial-rollout switch at a chosen token, in this process or in
the generation process (where a test cannot patch anything): tests/test_partial.py builds its
runs with it (trainer.setup.Rollout)."""
import time

from sealrl.roles.rollout import Rollout
from sealrl.rollout import switching


class HeldRollout(Rollout):
    """Live switching held at token 2 of iterations >= 1 until a newer version is loaded here."""

    def generate_switching(self, requests, contract, version, plan=None, resolve=None, stream=None):
        if plan is not None:
            return super().generate_switching(requests, contract, version, plan, resolve, stream)
        it, engine = int(requests[0].group_id.split("/")[-2]), self.engine
        switch = forced_switch(engine, it)
        return switching.generate_switching(engine, requests, contract, version, switch, stream)


def forced_switch(engine, it):
    """The clock's schedule, with the lane held at token 2 of iterations >= 1 until the
    training lane publishes a newer version than the one sampling (then it switches there)."""
    def switch(step, current):
        if step == 2 and it >= 1:
            deadline = time.monotonic() + 60
            while engine.active_version == current and time.monotonic() < deadline:
                time.sleep(0.005)
        newest = engine.active_version
        return newest if step == 2 and newest != current else None
    return switch
