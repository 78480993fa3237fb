"""A stage process outlives no launcher: `specsot serve` stops its local launch's stages on SIGTERM
(as systemd or docker stop it), and a stage whose launcher was killed outright stops by itself."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import fresh_home
from pipeline_helpers import make_tiny_model
from specsot_mq.stages.base import RunSpec


def _alive(pid: int) -> bool:
    """Whether pid runs (a zombie, ended but not yet reaped by whoever adopted it, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _stages_of(marker: str) -> list[int]:
    """The stage processes whose command line holds `marker` (their run's model path)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "specsot_mq.stages.runner" in cmd and marker in cmd and _alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def _until(check, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return check()


def _kill(pid: int) -> None:
    """SIGKILL a stage left behind by a failed test, with its process group (its own session)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_stops_its_local_launch_on_sigterm(tmp_path, default_model_dir):
    """uvicorn shuts down on SIGTERM and then raises it again; the default handler used to end
    `specsot serve` there, before it stopped the launch it had started: six stage processes were
    left running, a model loaded in two of them."""
    model, _ = make_tiny_model(tmp_path / "tiny", default_model_dir)
    port = _free_port()
    env = {**os.environ, "SPECSOT_HOME": str(fresh_home(tmp_path / "home"))}  # no run file of a launch to attach to
    cmd = [sys.executable, "-c", "from specsot_mq.cli.app import main; main()", "serve", "--model", str(model),
           "--dtype", "fp32", "--draft", "none", "--devices", "127.0.0.1#cpu", "--port", str(port)]  # fmt: skip
    log = open(tmp_path / "serve.log", "wb")
    serve = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:

        def ready() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json().get("status") == "ok"
            except (httpx.HTTPError, ValueError):
                return False

        assert _until(ready, 180), (tmp_path / "serve.log").read_text()
        stages = _stages_of(str(model))
        assert len(stages) == 6  # gateway, skeleton, parse, schedule, branch, merge
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0, (tmp_path / "serve.log").read_text()
        assert _until(lambda: not any(map(_alive, stages)), 30), [p for p in stages if _alive(p)]
    finally:
        if serve.poll() is None:
            serve.kill()
        for pid in _stages_of(str(model)):
            _kill(pid)


def test_a_stage_whose_launcher_was_killed_stops_by_itself(tmp_path):
    """A launcher that gets SIGKILL (or the OOM killer) cannot stop its stages; each notices that the
    process that started it is gone and stops as on SIGTERM, exit 0."""
    run = tmp_path / "run"
    run.mkdir()
    spec = RunSpec("p2p", {"gateway": f"ipc://{run}/g.sock", "merge": f"ipc://{run}/m.sock"},
                   {"gateway": "gateway", "merge": "merge"}, {}, {}, {}, f"ipc://{run}/c.sock", model=str(run))  # fmt: skip
    # the launcher: starts the stage as Launcher does (its own session), waits until it has bound
    # its inbox, then dies without a word
    launcher = f"""
import os, subprocess, sys, time
from pathlib import Path
log = open({str(tmp_path / "merge.log")!r}, "wb")
stage = subprocess.Popen([sys.executable, "-m", "specsot_mq.stages.runner", "--name", "merge", "--spec", {spec.to_json()!r}],
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
print(stage.pid, flush=True)
while not Path({str(run / "m.sock")!r}).exists() and stage.poll() is None:
    time.sleep(0.05)
os.kill(os.getpid(), 9)
"""
    done = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr
    stage = int(done.stdout.split()[0])
    try:
        assert _until(lambda: not _alive(stage), 60), (tmp_path / "merge.log").read_text()
        assert "is gone: stopping" in (tmp_path / "merge.log").read_text()
    finally:
        if _alive(stage):
            _kill(stage)


def test_a_launch_with_a_host_that_cannot_be_reached_fails_by_name_and_leaves_nothing_running(tmp_path, default_model_dir):
    """The default --remote runs ssh in batch mode with a connect timeout: a host that cannot be
    reached (192.0.2.1 is TEST-NET-1, routed nowhere) ends the launch with ssh's own words from
    the stage's log, instead of a launch that waits out its whole ready timeout (ssh's default
    waited for the network's own TCP timeout, minutes here; a password prompt waited for ever)."""
    import shutil

    import pytest

    if shutil.which("ssh") is None:
        pytest.skip("needs the ssh client, which the default --remote runs")
    model, _ = make_tiny_model(tmp_path / "tiny", default_model_dir)
    env = {**os.environ, "SPECSOT_HOME": str(fresh_home(tmp_path / "home"))}
    cmd = [sys.executable, "-c", "from specsot_mq.cli.app import main; main()", "launch", "--model", str(model),
           "--dtype", "fp32", "--draft", "none", "--devices", "192.0.2.1#0,127.0.0.1#cpu", "--run", "unreachable",
           "--base-port", str(_free_port())]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 2, out.stderr
    assert "exited while starting" in out.stderr, out.stderr  # then ssh's own words, which vary by network
    assert "Traceback" not in out.stderr
    assert _until(lambda: not _stages_of(str(model)), 30), _stages_of(str(model))
    log = Path(re.search(r"its\s+log\s+\((\S+)\)\s+ends", out.stderr)[1])  # kept for a look, named
    assert log.exists()
    shutil.rmtree(log.parent)


@pytest.mark.parametrize("died", [False, True])
def test_a_run_leaves_no_folder_behind_unless_a_stage_died_then_its_logs_stay(tmp_path, died):
    """The run's folder (sockets, logs) goes when the launcher stops; where a stage died, the
    folder stays, and the report's log path names a file that is there."""
    from specsot_mq.devices import parse_devices
    from specsot_mq.sot.scheduler import default_profiles_path, load_profiles
    from specsot_mq.stages.launch import Launcher, plan_run

    run_dir = tmp_path / "run"
    spec = plan_run(parse_devices("127.0.0.1#cpu"), load_profiles(default_profiles_path()), "p2p", run_dir)
    launcher = Launcher(spec, run_dir, restart=False)
    for stage in launcher.stages.values():  # stand-ins for the stages: one that lives, or one that dies
        stage.command = ["sh", "-c", "echo dying; exit 3" if died and stage.name == "merge" else "sleep 30"]
    launcher.start()
    assert _until(lambda: launcher.stages["merge"].proc.poll() is not None, 10) if died else True
    reports = launcher.check()
    launcher.stop()
    if died:
        assert len(reports) == 1 and reports[0].endswith(f"log: {run_dir / 'merge.log'}"), reports
        assert (run_dir / "merge.log").read_text() == "dying\n"
    else:
        assert not reports and not run_dir.exists()


def test_waiting_for_stages_says_which_ones_it_waits_for(tmp_path):
    """Stages that never say ready (none was started: no gateway answers) are named while the
    launch waits, range servers left out (they say nothing), then the timeout names the logs."""
    import asyncio
    from types import SimpleNamespace

    import pytest

    from specsot_mq.errors import SpecSotError
    from specsot_mq.stages.launch import wait_ready

    spec = SimpleNamespace(client_address=f"ipc://{tmp_path}/nobody", ranges={"range0": {}})
    stage = SimpleNamespace(proc=None)
    launcher = SimpleNamespace(spec=spec, keys=None, run_dir=tmp_path,
                               stages={"gateway": stage, "skeleton": stage, "range0": stage})  # fmt: skip
    said = []
    with pytest.raises(SpecSotError, match=f"not ready after 2 s; logs are in {tmp_path}"):
        asyncio.run(wait_ready(launcher, timeout=2, say=said.append, say_after=0))
    assert said and said[0].startswith("waiting for 2 of 2 stages to say ready")
    assert said[0].endswith(f"): gateway, skeleton; their logs are in {tmp_path}")


def test_a_remote_stage_that_ends_before_its_keys_are_written_is_reported_by_name(tmp_path, monkeypatch, default_model_dir):
    """Over tcp each stage reads the run's keys on stdin. A remote command that had already ended
    (ssh to a host that refused at once) made that write a BrokenPipeError, which the command line
    turned into a silent exit 1, its local stages left running. Here every remote command has
    ended before the write, whatever the machine's speed."""
    import asyncio

    import pytest

    from specsot_mq.errors import SpecSotError
    from specsot_mq.stages import launch as launch_module
    from specsot_mq.stages.launch import LaunchOptions, start_topology, wait_ready

    model, _ = make_tiny_model(tmp_path / "tiny", default_model_dir)
    real_popen = subprocess.Popen

    def popen_remote_ended(cmd, **kwargs):
        proc = real_popen(cmd, **kwargs)
        if cmd[0] == "sh":  # the remote command (a local stage runs python directly)
            proc.wait()
        return proc

    monkeypatch.setattr(launch_module.subprocess, "Popen", popen_remote_ended)
    options = LaunchOptions(devices="192.0.2.1#0,127.0.0.1#cpu", model=str(model), dtype="fp32", draft="none",
                            remote="exit 3 # {host} {command}", base_port=_free_port())  # fmt: skip
    launcher, _ = start_topology(options)
    try:
        with pytest.raises(SpecSotError, match="exited while starting"):
            asyncio.run(wait_ready(launcher, timeout=120))
    finally:
        launcher.stop()
    assert not _stages_of(str(model))  # the local stages went with the launch
    assert launcher.keep_logs and (launcher.run_dir / "gateway.log").exists()  # its logs stay for a look...
    shutil.rmtree(launcher.run_dir)  # ...which this test does not need
