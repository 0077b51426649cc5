"""Followers start without the Neuron profiler switches (docs/neuron.md §2.3): every rank of a host
would otherwise write its profile into the one NEURON_RT_INSPECT_OUTPUT_DIR."""
import os
import subprocess

from deepinfer.distributed.follower_env import follower_environment
from deepinfer.engine_config import EngineConfig
from deepinfer.executor import local_ranks as ranks_module

INSPECT = {"NEURON_RT_INSPECT_ENABLE": "1", "NEURON_RT_INSPECT_OUTPUT_DIR": "/tmp/profile",
           "NEURON_RT_INSPECT_DEVICE_PROFILE": "1"}


def test_follower_environment_drops_inspect_variables_and_keeps_the_rest():
    parent = {**INSPECT, "NEURON_RT_LOG_LEVEL": "INFO", "NEURON_CC_FLAGS": "--lnc 2", "PATH": "/usr/bin",
              "PYTHONPATH": "/user/lib"}
    env = follower_environment(parent, "/repo")
    assert not any(k.startswith("NEURON_RT_INSPECT") for k in env)
    assert env["NEURON_RT_LOG_LEVEL"] == "INFO" and env["NEURON_CC_FLAGS"] == "--lnc 2"
    assert env["PATH"] == "/usr/bin"
    assert env["PYTHONPATH"] == os.pathsep.join(["/repo", "/user/lib"])
    assert parent["NEURON_RT_INSPECT_ENABLE"] == "1"   # the driver's own environment is untouched
    assert follower_environment({"PATH": "/bin"}, "/repo")["PYTHONPATH"] == "/repo"


class _Proc:
    """Stands in for a follower's Popen: alive until waited for."""
    pid = 4242

    def __init__(self):
        self.code = None

    @property
    def returncode(self):   # what the ranks' watchdog reads after poll()
        return self.code

    def poll(self):
        return self.code

    def wait(self, timeout=None):
        self.code = 0
        return 0

    def send_signal(self, sig):
        self.code = -sig


def test_spawned_followers_get_the_follower_environment(monkeypatch):
    """LocalRanks.spawn hands every follower process that environment (the driver keeps its own)."""
    for k, v in INSPECT.items():
        monkeypatch.setenv(k, v)
    envs = []

    def popen(cmd, env=None, stdin=None):
        envs.append(env)
        return _Proc()

    monkeypatch.setattr(subprocess, "Popen", popen)

    def no_store(*args, **kwargs):   # no driver store here: the watchdog goes on without one at once
        raise ConnectionError("no store in this test")

    monkeypatch.setattr(ranks_module.launch, "open_store", no_store)
    ec = EngineConfig(model="unused", context_parallel_size=4, master_port=29999)
    ranks = ranks_module.LocalRanks(ec, 0, store=None)
    try:
        ranks.spawn()
    finally:
        ranks.close(None)
    assert len(envs) == 3
    for env in envs:
        assert not any(k.startswith("NEURON_RT_INSPECT") for k in env)
        assert env["PYTHONPATH"].split(os.pathsep)[0] == ranks_module._PACKAGE_ROOT
    assert os.environ["NEURON_RT_INSPECT_OUTPUT_DIR"] == "/tmp/profile"
