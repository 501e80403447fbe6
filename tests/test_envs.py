"""Environments and tools: loading by config, the calculator, and tool failures that are
named statuses (raise, hang, flood, bad call) within a deadline, never rewards."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from sealrl.envs import EnvLoadError, EnvStep, make_env
from sealrl.envs.calc import calculator
from sealrl.envs.guess import GuessEnv
from sealrl.envs.tools import ToolEnv
from sealrl.experience.episode import EnvStatus
from sealrl.rewards.base import RewardSample
from sealrl.rewards.episodes import GuessVerifier, ToolAnswerMatch


def raising(args: str) -> str:
    raise RuntimeError("tool broke")


def hanging(args: str) -> str:
    time.sleep(60)
    return "never"


def flooding(args: str) -> str:
    return "x" * 1_000_000


def echo(args: str) -> str:
    return args[::-1]


def test_calculator_exact_and_refuses_code():
    assert calculator("123*456") == "56088"          # 123*456 = 56088
    assert calculator("013*900") == "11700" and calculator("000*5") == "0"   # zero-padded operands
    assert calculator(" (7-2)*3 ") == "15"
    assert calculator("7/2") == "7/2" and calculator("8/2") == "4"
    for bad in ("__import__('os')", "2**999", "x", "1/0", "9" * 65):
        with pytest.raises((ValueError, SyntaxError, ZeroDivisionError)):
            calculator(bad)


def test_tool_failures_are_named_statuses_and_nothing_hangs():
    env = ToolEnv({"echo": echo, "boom": raising, "hang": hanging, "flood": flooding},
                  timeout_s=0.5, max_output_chars=10)
    try:
        ok = env.step(None, "<echo>abc</echo>")
        assert (ok.status, ok.observation, ok.done, ok.reward) == (EnvStatus.OK, "<out>cba</out>", False, None)
        boom = env.step(None, "<boom>1</boom>")
        assert boom.status is EnvStatus.ERROR and "tool broke" in boom.message and boom.reward is None
        t0 = time.monotonic()
        hang = env.step(None, "<hang>1</hang>")
        assert hang.status is EnvStatus.TIMEOUT and time.monotonic() - t0 < 5
        assert hang.observation == "<out>error: timeout</out>"
        again = env.step(None, "<echo>xy</echo>")        # a fresh worker after the kill
        assert again.status is EnvStatus.OK and again.observation == "<out>yx</out>"
        flood = env.step(None, "<flood>1</flood>")
        assert flood.status is EnvStatus.FLOOD and flood.observation == "<out>" + "x" * 10 + "</out>"
        assert "1000000 chars" in flood.message
        bad = env.step(None, "no opening</echo>")
        assert bad.status is EnvStatus.BAD_CALL
        done = env.step(None, "42")                      # no call: the policy answered
        assert done.done and done.status is EnvStatus.NONE and done.observation == ""
    finally:
        env.close()


def test_env_step_refuses_a_reward_on_a_failure():
    with pytest.raises(ValueError, match="not a reward"):
        EnvStep("x", reward=0.0, status=EnvStatus.TIMEOUT)


def test_guess_env_answers_and_verifier():
    env = GuessEnv(step_penalty=0.1)
    secret = env.reset(type("P", (), {"ground_truth": "37"})())
    assert env.step(secret, "50?") == EnvStep("lo;", reward=-0.1)
    assert env.step(secret, "20?") == EnvStep("hi;", reward=-0.1)
    assert env.step(secret, "37?") == EnvStep("ok", done=True)
    assert env.step(secret, "what?").status is EnvStatus.BAD_CALL
    sample = lambda text, truth: RewardSample(sample_id="s", prompt="", response=text, response_ids=(),  # noqa: E731
                                               ground_truth=truth, data_source="", metadata={})
    assert GuessVerifier()(sample("50?lo;37?ok", "37")) == 1.0
    assert GuessVerifier()(sample("50?lo;36?hi;", "37")) == 0.0
    assert ToolAnswerMatch()(sample("<calc>3*4</calc><out>12</out>12<eos>", "12")) == 1.0
    assert ToolAnswerMatch()(sample("<calc>3*4</calc><out>12</out>13", "12")) == 0.0
    assert ToolAnswerMatch()(sample("12", "12")) == 1.0


def test_make_env_by_name_module_and_file(tmp_path: Path):
    calc = make_env("calc", tool_timeout_s=0.25)
    assert calc.stops == ("</calc>",) and calc.worker.timeout_s == 0.25
    calc.close()
    assert isinstance(make_env("sealrl.envs.guess:GuessEnv"), GuessEnv)
    f = tmp_path / "myenv.py"
    f.write_text("class Mine:\n    name = 'mine'\n    version = '2'\n    stops = ('!',)\n"
                 "    def reset(self, p): return None\n    def step(self, s, t): pass\n    def close(self): pass\n")
    assert make_env(f"{f}:Mine").version == "2"
    for bad, match in (("nope", "not a built-in"), ("sealrl.nothing:X", "cannot import"),
                       ("sealrl.envs.guess:Nope", "has no Nope"), (f"{tmp_path}/none.py:X", "no file")):
        with pytest.raises(EnvLoadError, match=match):
            make_env(bad)


def test_a_relative_env_file_is_resolved_once_on_the_driver(tmp_path: Path, monkeypatch):
    """env.name=my_env.py:Class relative to the driver's folder reaches a replica that runs in
    another folder (a Ray worker's) as an absolute path, and its code with it, read once on the
    driver (trainer/setup.episode_spec): a replica on a node without the file builds the class."""
    from sealrl.config import build_config
    from sealrl.trainer.setup import episode_spec
    (tmp_path / "my_env.py").write_text("from sealrl.envs.guess import GuessEnv as Mine\n")
    monkeypatch.chdir(tmp_path)
    spec = episode_spec(build_config(None, ["env.name=my_env.py:Mine"]))
    assert spec.env == f"{tmp_path / 'my_env.py'}:Mine"
    monkeypatch.chdir(tmp_path.parent)   # the replica's folder: the relative name would not load here
    assert isinstance(make_env(spec.env), GuessEnv)
    with pytest.raises(EnvLoadError, match="no file"):
        make_env("my_env.py:Mine")
    # the file's code travels in the spec: a node without the file (or with another version of
    # it) builds the driver's class
    assert spec.source == "from sealrl.envs.guess import GuessEnv as Mine\n"
    (tmp_path / "my_env.py").write_text("raise RuntimeError('not the driver s file')\n")
    assert isinstance(make_env(spec.env, source=spec.source), GuessEnv)
    (tmp_path / "my_env.py").unlink()
    assert isinstance(make_env(spec.env, source=spec.source), GuessEnv)
    with pytest.raises(EnvLoadError, match="no file"):
        make_env(spec.env)


def test_a_tool_worker_dies_with_the_process_that_forked_it(tmp_path: Path):
    """A replica killed at once (SIGKILL, its node lost) must not leave its forked tool worker
    alive: the worker holds the replica's inherited sockets, and Ray would notice the death only
    at the call's deadline (320 s was seen)."""
    import os
    import signal
    import subprocess
    import sys
    script = ("import time\nfrom sealrl.envs.tools import ToolWorker\n"
              "w = ToolWorker({'echo': lambda a: a}, 2.0, 64)\nprint(w.call('echo', 'x')[1], w.host.pid, flush=True)\n"
              "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        out, pid = parent.stdout.readline().split()
        assert out == "x" and os.path.exists(f"/proc/{pid}")
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _running(pid):
            time.sleep(0.02)
        assert not _running(pid), "the tool worker outlived the process that forked it"
    finally:
        parent.kill()


def _running(pid: str) -> bool:
    """Alive and not a zombie (an orphan's zombie is reaped by init, maybe later)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
