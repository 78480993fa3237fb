"""--devices parsing and the run plan: one clear error per mistake, and the address table and ring
order the launcher computes."""

import os
import subprocess
import sys

import pytest

from specsot_mq.devices import Device, parse_devices
from specsot_mq.errors import SpecSotError
from specsot_mq.sot.scheduler import default_profiles_path, load_profiles
from specsot_mq.stages.base import parse_overrides
from specsot_mq.stages.launch import plan_run


def test_devices_parse_in_order():
    assert parse_devices("127.0.0.1#0, 127.0.0.1#cpu,10.0.0.2#cpu1") == [
        Device("127.0.0.1", "0"), Device("127.0.0.1", "cpu"), Device("10.0.0.2", "cpu1")]  # fmt: skip
    assert Device("10.0.0.2", "3").torch_device == "cuda:3" and Device("h", "cpu1").torch_device == "cpu"


@pytest.mark.parametrize("text, message", [
    ("", "empty entry"),
    ("127.0.0.1#0,,127.0.0.1#1", "empty entry"),
    ("127.0.0.1", "not of the form ip#gpu"),
    ("#0", "not of the form ip#gpu"),
    ("127.0.0.1#gpu0", "GPU number, cpu"),
    ("localhost", "not of the form ip#gpu"),
    ("10.0.0.2#", "GPU number, cpu"),
    ("10.0.0.2#mps", "GPU number, cpu"),
    ("127.0.0.1#0,127.0.0.1#0", "listed twice"),
    ("no-such-host.invalid#0", "unknown host"),
])  # fmt: skip
def test_device_mistakes_get_one_clear_error(text, message):
    with pytest.raises(SpecSotError, match=message):
        parse_devices(text)


def test_a_device_without_a_profile_is_named(tmp_path):
    path = tmp_path / "devices.json"
    path.write_text('{"profiles": {"cpu": {"compute": 1, "memory_gb": 1, "bandwidth_gb_s": 1, "max_parallel": 2}}}')
    with pytest.raises(SpecSotError, match="'127.0.0.1#0' has no profile"):
        plan_run(parse_devices("127.0.0.1#0"), load_profiles(path), "p2p", tmp_path)


def test_run_plan_local_and_remote(tmp_path):
    profiles = load_profiles(default_profiles_path())
    local = plan_run(parse_devices("127.0.0.1#cpu0,127.0.0.1#cpu1"), profiles, "ring", tmp_path)
    assert list(local.table) == ["gateway", "skeleton", "parse", "schedule", "branch@127.0.0.1#cpu0",
                                 "branch@127.0.0.1#cpu1", "merge"]  # the ring order  # fmt: skip
    assert all(a.startswith("ipc://") for a in local.table.values())
    assert local.devices["skeleton"] == "127.0.0.1#cpu0" and local.profiles["branch@127.0.0.1#cpu1"]["max_parallel"] == 8
    # Every CPU device stage takes its share of its own host's cores, counted there (worker.py,
    # core_share.py), unless the launch fixes a count for all of them.
    assert local.threads == {}
    fixed = plan_run(parse_devices("127.0.0.1#cpu,192.0.2.7#0"), profiles, "p2p", tmp_path, stage_threads=3)
    assert fixed.threads == {"skeleton": 3, "branch@127.0.0.1#cpu": 3}  # not the GPU's stage
    for bad in (0, -2, True):
        with pytest.raises(SpecSotError, match="--threads must be a whole number of at least 1"):
            plan_run(parse_devices("127.0.0.1#cpu"), profiles, "p2p", tmp_path, stage_threads=bad)
    remote = plan_run(parse_devices("127.0.0.1#cpu,192.0.2.7#0"), profiles, "p2p", tmp_path, base_port=7000)
    assert remote.table["gateway"] == "tcp://127.0.0.1:7000" and remote.table["branch@192.0.2.7#0"].startswith("tcp://192.0.2.7:")
    assert remote.hosts["branch@192.0.2.7#0"] == "192.0.2.7" and remote.hosts["merge"] == "127.0.0.1"
    for bad in (0, 65533, 80000):  # 7 stages' ports do not fit from there
        with pytest.raises(SpecSotError, match=f"--base-port {bad} leaves too few tcp ports"):
            plan_run(parse_devices("127.0.0.1#cpu,192.0.2.7#0"), profiles, "p2p", tmp_path, base_port=bad)
    with pytest.raises(SpecSotError, match="--topology"):
        plan_run(parse_devices("127.0.0.1#cpu"), profiles, "mesh", tmp_path)


@pytest.mark.parametrize("flag, message", [
    ("parse", "KIND=module.path:ClassName"),
    ("nope=a.b:C", "KIND=module.path:ClassName"),
    ("parse=no_such_module:X", "cannot be loaded"),
    ("parse=specsot_mq.errors:SpecSotError", "not a Stage subclass"),
])  # fmt: skip
def test_stage_overrides_are_checked(flag, message):
    with pytest.raises(SpecSotError, match=message):
        parse_overrides([flag])
    assert parse_overrides(["parse=specsot_mq.stages.parse:ParseStage"]) == {"parse": "specsot_mq.stages.parse:ParseStage"}


def test_a_stage_process_bounds_openmp_spinning_before_torch_loads():
    """Idle OpenMP threads of a stage must sleep after a short spin (busy stages on one host share
    its cores, core_share.py), and OpenMP reads that setting once, when torch loads it: the runner
    sets it on import, before a device stage imports torch (the other stages never do)."""
    # An import hook notes the settings at the moment torch is first imported.
    code = """
import importlib.abc, os, sys
class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print(os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_WAIT_POLICY"))
            sys.meta_path.remove(self)
        return None
sys.meta_path.insert(0, Watch())
import specsot_mq.stages.runner
assert "torch" not in sys.modules
import torch
"""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "10000 None"


def test_device_stages_on_one_gpu_split_its_memory_and_cpu_stages_share_the_cores():
    from types import SimpleNamespace

    from specsot_mq.stages.worker import _sharing, gpu_share

    spec = SimpleNamespace(
        devices={"skeleton": "10.0.0.1#0", "branch0": "10.0.0.1#0", "branch1": "10.0.0.1#1", "branch2": "10.0.0.2#0",
                 "branch3": "10.0.0.1#cpu", "branch4": "10.0.0.1#cpu1"},
        hosts={"skeleton": "10.0.0.1", "branch0": "10.0.0.1", "branch1": "10.0.0.1", "branch2": "10.0.0.2",
               "branch3": "10.0.0.1", "branch4": "10.0.0.1"},
    )  # fmt: skip
    assert gpu_share(spec, "skeleton") == gpu_share(spec, "branch0") == 0.5  # both on 10.0.0.1's GPU 0
    assert gpu_share(spec, "branch1") == 1.0 and gpu_share(spec, "branch2") == 1.0  # alone on theirs
    assert _sharing(spec, "branch3") == ["branch3", "branch4"]  # the host's CPU stages share its cores
