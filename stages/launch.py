"""Starting and watching a topology: one process per stage, local ones directly, remote ones through
a command template (devices.REMOTE by default: ssh in batch mode with a 10 s connect timeout, so
that a host that cannot be reached or asks for a password fails within seconds, by name), a run
file that clients attach to, a dead stage reported and restarted, and every process stopped on
exit.

Stages: gateway, skeleton, parse, schedule, one branch per device, merge (that is the ring order).
The skeleton decodes on the first device, and the stages without a device run on its host. All on
this machine: ipc sockets in the run folder; otherwise tcp from `base_port` up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specsot_mq.core_share import CoreShare
from specsot_mq.devices import REMOTE, Device, device_profiles, is_local, parse_devices
from specsot_mq.errors import SpecSotError
from specsot_mq.pull import resolve_model, specsot_home
from specsot_mq.sot.scheduler import DeviceProfile, default_profiles_path, load_profiles
from specsot_mq.stages.base import RunSpec, parse_overrides
from specsot_mq.transports import TOPOLOGIES


SPLITS = ("none", "layers")  # --split: the whole model on every device, or its layers over the devices
KV_SHIP = ("auto", "always", "never")  # --kv-ship: by the measured rule (kv_ship.py), or forced
MAX_RESTARTS, RESTART_WINDOW_S = 5, 120.0  # a stage that dies this often within the window is not restarted again


def runs_folder() -> Path:
    return specsot_home() / "runs"


@dataclass(slots=True)
class LaunchOptions:
    """What to start: where the stages run, what they decode with, and the SoT limits."""

    devices: str = "127.0.0.1#cpu"  # ip#gpu,... (#cpu for a CPU device); the skeleton runs on the first
    topology: str = "p2p"  # or "ring"
    model: str | None = None  # name or path (None: the default model)
    dtype: str = "auto"
    quantize: str = "auto"  # the weights: as shipped, int4, int8 or none (loader.load_model)
    draft: str | None = "auto"
    tree: dict = field(default_factory=dict)  # TreeParams fields given (the rest default)
    stages: list[str] = field(default_factory=list)  # stage swaps, "KIND=module.path:Class"
    remote: str = REMOTE  # runs {command} on another {host}
    devices_file: str | None = None  # device profiles (None: devices.json)
    max_points: int = 8
    point_tokens: int = 160
    skeleton_tokens: int = 128
    prompt_format: str = "sot"
    base_port: int = 5600  # first tcp port (multi-host runs)
    restart: bool = True  # restart a stage that dies
    threads: int | None = None  # torch threads of each CPU device stage (None: its share of its host's cores)
    prefix_cache_mb: int = 256  # each device stage's prefix store: a conversation's earlier turns computed once
    max_len: int = 2048  # each device stage's KV cache length (prompt + answer)
    split: str = "none"  # or "layers": the model's layers in ranges over the devices, sized by their memory
    replicas: int = 1  # --split layers: devices serving each range (the ranges are sized over the first 1/replicas)
    prefill_chunk: int = 128  # --split layers: tokens per piece of a pipelined prefill (0: one piece)
    kv_ship: str = "auto"  # branch stages ask each other for a conversation's earlier turns' KV (kv_ship.py): auto, always, never


def start_topology(options: LaunchOptions) -> tuple[Launcher, RunSpec]:
    """Plan a topology in a new run folder and start every stage; SpecSotError on a bad option."""
    from specsot_mq.sot.flow import SoTConfig

    sot = {"max_points": options.max_points, "point_tokens": options.point_tokens,
           "skeleton_tokens": options.skeleton_tokens, "prompt_format": options.prompt_format}  # fmt: skip
    sot["prompt_format"] = SoTConfig(**sot).prompt_format  # validates; a format file by its resolved path
    if options.prefix_cache_mb < 0:
        raise SpecSotError(f"--prefix-cache-mb must be 0 (off) or more, got {options.prefix_cache_mb}")
    if options.max_len < 1:
        raise SpecSotError(f"--max-len must be at least 1 token, got {options.max_len}")
    if options.split not in SPLITS:
        raise SpecSotError(f"--split must be one of {', '.join(SPLITS)}, not {options.split!r}")
    if options.replicas != 1 and options.split != "layers":
        raise SpecSotError("--replicas serves each layer range on several devices: it needs --split layers")
    if options.kv_ship not in KV_SHIP:
        raise SpecSotError(f"--kv-ship must be one of {', '.join(KV_SHIP)}, not {options.kv_ship!r}")
    if options.prefill_chunk < 0:
        raise SpecSotError(f"--prefill-chunk must be 0 (one piece) or more tokens, got {options.prefill_chunk}")
    profiles = load_profiles(options.devices_file or default_profiles_path())
    devices = parse_devices(options.devices)
    # pulled, or converted from a .gguf, once here before the stages start (the gateway, parse,
    # schedule and merge run on this host and read its tokenizer) rather than by the first of them;
    # a bad model name fails now. Remote hosts resolve it themselves.
    folder = resolve_model(options.model)
    ranges = split_ranges(devices, profiles, folder, options.replicas) if options.split == "layers" else None
    run_dir = Path(tempfile.mkdtemp(prefix="specsot-run-"))  # short: ipc socket paths have a length limit
    spec = plan_run(devices, profiles, options.topology, run_dir, options.base_port, options.threads, ranges,
                    model=options.model, dtype=options.dtype, quantize=options.quantize,
                    draft=options.draft, tree=options.tree, sot=sot,
                    overrides=parse_overrides(options.stages), prefix_cache_mb=options.prefix_cache_mb,
                    max_len=options.max_len, prefill_chunk=options.prefill_chunk, kv_ship=options.kv_ship)  # fmt: skip
    launcher = Launcher(spec, run_dir, remote=options.remote, restart=options.restart)
    launcher.start()
    return launcher, spec


def split_ranges(devices: list[Device], profiles: dict[str, DeviceProfile], folder: Path,
                 replicas: int = 1) -> list[tuple[int, int]]:  # fmt: skip
    """--split layers: each device's [first, last) layers, within its memory and by its compute in
    devices.json (split.layer_ranges): the first len(devices) / replicas devices take the ranges in
    order, and each later one serves the same range as the device that many places before it (its
    replica)."""
    from specsot_mq.config import ModelConfig
    from specsot_mq.split import layer_ranges, weight_bytes

    if replicas < 1 or len(devices) % replicas:
        raise SpecSotError(f"--replicas {replicas}: give a number of devices that it divides "
                           f"({len(devices)} in --devices)")  # fmt: skip
    n = len(devices) // replicas
    if n < 2:
        raise SpecSotError(f"--split layers needs at least {2 * replicas} devices in --devices (two ranges"
                           f"{f', each on {replicas} devices' if replicas > 1 else ''}), got {len(devices)}: "
                           "e.g. 127.0.0.1#cpu0,127.0.0.1#cpu1")  # fmt: skip
    if not all(is_local(d.host) for d in devices):
        raise SpecSotError("--split layers runs over the devices of this host for now: its range links are not "
                           "authenticated yet; use --split none across hosts")  # fmt: skip
    layer, embed, head = weight_bytes(folder)
    kinds = device_profiles(devices, profiles)
    budgets = [p.memory_gb * 1e9 for p in kinds]
    bounds = layer_ranges(ModelConfig.from_folder(folder).num_layers, int(layer), budgets[:n], embed, head,
                          [d.name for d in devices[:n]], [p.compute for p in kinds[:n]])  # fmt: skip
    for i in range(n, len(devices)):  # a replica's memory holds its range too
        first, last = bounds[i % n]
        need = (last - first) * layer + (embed if first == 0 else 0) + (head if i % n == n - 1 else 0)
        if need > budgets[i]:
            raise SpecSotError(f"{devices[i].name}'s layers {first}:{last} (a replica) need {need / 2**20:.0f} MB, more "
                               f"than its memory budget ({budgets[i] / 2**20:.0f} MB): raise it in devices.json")  # fmt: skip
    return [bounds[i % n] for i in range(len(devices))]


def plan_run(devices: list[Device], profiles: dict[str, DeviceProfile], topology: str, run_dir: Path,
             base_port: int = 5600, stage_threads: int | None = None, ranges: list[tuple[int, int]] | None = None,
             **options) -> RunSpec:  # fmt: skip
    """The RunSpec of a topology over these devices (options: RunSpec fields such as model, sot).
    A CPU device stage runs `stage_threads` torch threads if given, else its share of the cores of
    the host it runs on (counted there, by the stage itself: a remote host may have more or fewer
    than this one): a stage busy alone takes all of them, busy stages split them (core_share.py).
    `ranges` (--split layers): each device's layers, served by a range server on it; the skeleton
    and one branch stage, on the first device's host, then run the model through them (one
    thread each, unless stage_threads says otherwise)."""
    if topology not in TOPOLOGIES:
        raise SpecSotError(f"--topology must be one of {', '.join(TOPOLOGIES)}, not {topology!r}")
    if not devices:
        raise SpecSotError("--devices names no device: give at least one, e.g. 127.0.0.1#cpu")
    first = devices[0]
    branched = devices[:1] if ranges else devices
    if ranges is not None and len(ranges) != len(devices):
        raise SpecSotError(f"{len(ranges)} layer ranges for {len(devices)} devices: give one per device")
    branch_names = [f"branch@{d.name}" for d in branched]
    kinds = {"gateway": "gateway", "skeleton": "skeleton", "parse": "parse", "schedule": "schedule",
             **dict.fromkeys(branch_names, "branch"), "merge": "merge"}  # fmt: skip
    hosts = {name: first.host for name in kinds} | {f"branch@{d.name}": d.host for d in branched}
    dev = {"skeleton": first.name} | {f"branch@{d.name}": d.name for d in branched}
    served = {f"range@{d.name}": (d, bounds) for d, bounds in zip(devices, ranges or [])}
    hosts |= {name: d.host for name, (d, _) in served.items()}
    local = all(is_local(host) for host in hosts.values())
    port = iter(range(base_port, 65536) if base_port >= 1 else ())

    def address(name: str) -> str:
        if local:
            return f"ipc://{run_dir}/{_safe(name)}.sock"
        number = next(port, None)
        if number is None:
            raise SpecSotError(f"--base-port {base_port} leaves too few tcp ports (1 to 65535) for every stage: choose "
                               "one such as 5600")  # fmt: skip
        return f"tcp://{hosts.get(name, first.host)}:{number}"

    table = {name: address(name) for name in kinds}
    if stage_threads is not None and (isinstance(stage_threads, bool) or stage_threads < 1):
        raise SpecSotError(f"--threads must be a whole number of at least 1, got {stage_threads!r}")
    # --threads fixes the stages' count; over --split layers the range servers compute (on a board
    # of their own), so the stages driving them hold no layers and run one thread, off the board
    fixed = stage_threads or (1 if ranges else None)
    threads = {name: fixed for name in dev if "#cpu" in dev[name]} if fixed else {}
    threads |= {name: stage_threads for name, (d, _) in served.items() if d.kind == "cpu"} if stage_threads else {}
    # Each branch's profile fields but its name (the stage is named after the device already).
    profs = {f"branch@{p.name}": {k: v for k, v in asdict(p).items() if k != "name"}
             for p in device_profiles(branched, profiles)}  # fmt: skip
    served = {name: {"layers": list(bounds), "address": address(name), "device": d.name}
              for name, (d, bounds) in served.items()}  # fmt: skip
    # Over tcp, every link is authenticated with the run's own CURVE keys (the launcher makes them).
    return RunSpec(topology, table, kinds, hosts, dev, profs, address("client"), threads=threads, curve=not local,
                   ranges=served, **options)  # fmt: skip


@dataclass
class StageProcess:
    name: str
    command: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    restarts: list[float] = field(default_factory=list)  # time.monotonic() of each restart


class Launcher:
    """Starts every stage of a RunSpec and keeps them running. The run's folder (its sockets and
    the stages' logs) goes when it stops, unless a stage died or would not start: then its logs
    stay where the reports said."""

    def __init__(self, spec: RunSpec, run_dir: Path, remote: str = REMOTE, restart: bool = True):
        self.spec, self.run_dir, self.remote, self.restart = spec, Path(run_dir), remote, restart
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.keep_logs = False  # set once a stage died or would not start
        self.keys = None  # the run's CURVE keys when its links are tcp: given to stages on stdin, to clients in the run file
        if spec.curve:
            import zmq

            public, secret = zmq.curve_keypair()
            self.keys = {"public": public.decode(), "secret": secret.decode()}
        self.stages = {name: StageProcess(name, self._command(name), self.run_dir / f"{_safe(name)}.log")
                       for name in [*spec.ranges, *spec.kinds]}  # fmt: skip

    def _command(self, name: str) -> list[str]:
        cmd = [sys.executable, "-m", "specsot_mq.stages.runner", "--name", name, "--spec", self.spec.to_json()]
        if name in self.spec.ranges:  # a range server of --split layers
            served, spec = self.spec.ranges[name], self.spec
            first, last = served["layers"]
            cmd = [sys.executable, "-m", "specsot_mq.remote_range", "--layers", f"{first}:{last}", "--bind",
                   served["address"], "--dtype", spec.dtype, "--quantize", spec.quantize, "--device",
                   parse_devices(served["device"], resolve=False)[0].torch_device]  # fmt: skip
            cmd += ["--model", spec.model] if spec.model else []
            if name in spec.threads:
                cmd += ["--threads", str(spec.threads[name])]
            elif "#cpu" in served["device"]:  # the host's CPU range servers share its cores (core_share.py)
                path, members = self._range_board(name)
                cmd += ["--board", f"{path}:{members.index(name)}:{len(members)}"]
        host = self.spec.hosts[name]
        if is_local(host):
            return cmd
        return ["sh", "-c", self.remote.format(host=host, command=shlex.join(cmd))]

    def _range_board(self, name: str) -> tuple[Path, list[str]]:
        """The core board that the CPU range servers on `name`'s host share (range servers run on
        the launcher's host: split_ranges), and their names."""
        spec = self.spec
        host = spec.hosts[name]
        members = [n for n, s in spec.ranges.items() if spec.hosts[n] == host and "#cpu" in s["device"]]
        return CoreShare.board_path(f"{spec.client_address}|ranges", host), members

    def start(self) -> None:
        try:
            for stage in self.stages.values():
                self._spawn(stage)
        except BaseException:  # none of those started outlives a launch that could not start them all
            self.stop()
            raise

    def _spawn(self, stage: StageProcess) -> None:
        log = open(stage.log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        stage.proc = subprocess.Popen(stage.command, stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.PIPE if self.keys else subprocess.DEVNULL, env=env,
                                      start_new_session=True)  # fmt: skip
        log.close()
        if self.keys:  # on stdin (a remote host's through the remote command): never on a command line
            try:
                stage.proc.stdin.write((json.dumps(self.keys) + "\n").encode())
                stage.proc.stdin.close()
            except BrokenPipeError:
                # it exited already (ssh to a host that refused at once): wait_ready and check
                # report it with its log. (Click turned this error into a silent exit 1 of the
                # whole launch, its other stages left running.)
                with contextlib.suppress(OSError):
                    stage.proc.stdin.close()

    def check(self) -> list[str]:
        """Report stages that exited since the last call (and restart them); returns the reports."""
        reports = []
        for stage in self.stages.values():
            code = stage.proc.poll() if stage.proc else None
            if code is None:
                continue
            why = f"signal {-code}" if code < 0 else f"exit code {code}"
            report = f"stage {stage.name} (pid {stage.proc.pid}) died: {why}; log: {stage.log_path}"
            now = time.monotonic()
            stage.restarts = [t for t in stage.restarts if now - t < RESTART_WINDOW_S]
            if self.restart and len(stage.restarts) < MAX_RESTARTS:  # a stage that keeps crashing stays down
                stage.restarts.append(now)
                self._spawn(stage)
                report += f"; restarted (pid {stage.proc.pid})"
            else:
                stage.proc = None
            reports.append(report)
            self.keep_logs = True
        return reports

    def pids(self) -> dict[str, int | None]:
        return {name: (s.proc.pid if s.proc else None) for name, s in self.stages.items()}

    def write_run_file(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        info = {"client_address": self.spec.client_address, "launcher_pid": os.getpid(), "run_dir": str(self.run_dir),
                "topology": self.spec.topology, "model": model_id(self.spec.model), "stages": self.pids(),
                "keys": self.keys}  # fmt: skip
        tmp = path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:  # it may hold the keys
            f.write(json.dumps(info, indent=1))
        tmp.replace(path)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM every stage, then SIGKILL what is still there after `grace` seconds; the run's
        folder goes too unless its logs are to stay (see the class)."""
        live = [s.proc for s in self.stages.values() if s.proc and s.proc.poll() is None]
        self.keep_logs |= any(s.proc and s.proc.poll() not in (None, 0) for s in self.stages.values())
        for proc in live:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in live:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        for stage in self.stages.values():
            stage.proc = None
        for board in {self._range_board(name)[0] for name in self.spec.ranges}:  # (the stages remove their own)
            board.unlink(missing_ok=True)
        if not self.keep_logs:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            return "\n".join(self.stages[name].log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


async def wait_ready(launcher: Launcher, timeout: float = 300.0, say: Callable[[str], None] | None = None,
                     say_after: float = 10.0) -> None:  # fmt: skip
    """Until every stage has said Ready; SpecSotError (with the log's tail) if one dies first.
    `say`: told which stages it still waits for, after `say_after` seconds and every 15 s after."""
    from specsot_mq.client import Client

    start = time.monotonic()
    deadline, due = start + timeout, start + say_after
    async with Client(launcher.spec.client_address, keys=launcher.keys) as client:
        while time.monotonic() < deadline:
            up: set[str] = set()
            try:
                status = await client.status(timeout=1.0)
                if status.ready:
                    return
                up = {s["stage"] for s in status.stages if s.get("up")}
            except SpecSotError:
                pass
            if say is not None and time.monotonic() >= due:
                stages = [n for n in launcher.stages if n not in launcher.spec.ranges]  # (range servers say nothing)
                waiting = [n for n in stages if n not in up]
                say(f"waiting for {len(waiting)} of {len(stages)} stages to say ready ({time.monotonic() - start:.0f} s "
                    f"of {timeout:.0f}): {', '.join(waiting)}; their logs are in {launcher.run_dir}")  # fmt: skip
                due += 15.0
            for stage in launcher.stages.values():
                if stage.proc is not None and stage.proc.poll() is not None:
                    launcher.keep_logs = True
                    raise SpecSotError(f"stage {stage.name} exited while starting; its log ({stage.log_path}) ends with:\n"
                                       f"{launcher.tail(stage.name)}")  # fmt: skip
            await asyncio.sleep(0.5)
    launcher.keep_logs = True
    raise SpecSotError(f"the stages were not ready after {timeout:.0f} s; logs are in {launcher.run_dir}")


def model_id(model: str | None) -> str:
    """The name a run's model goes by (the HTTP API's model id): a known name as it is, a
    folder by its own name."""
    from specsot_mq.pull import DEFAULT_MODEL

    return Path(model).name if model and os.sep in model else (model or DEFAULT_MODEL)


def read_run_file(path: Path) -> dict | None:
    """A live run's file, or None when there is none or its launcher is gone."""
    try:
        info = json.loads(Path(path).read_text())
        os.kill(info["launcher_pid"], 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _safe(name: str) -> str:
    return name.replace("#", "_").replace("@", "_").replace("/", "_")
