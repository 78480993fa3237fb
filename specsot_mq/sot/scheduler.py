"""Branch scheduling: spread a plan's points over devices, longest processing time first (LPT).

The time model is simple on purpose. A device decodes the points it holds together, up to
max_parallel at once with the rest queued behind them, at `compute` tokens per second in total; so
a device's predicted time is the sum of its points' lengths divided by its compute. max_parallel
does not enter the prediction (queued points keep the batch full, and a full batch is what compute
measures); the branch stage uses it as its batch size. A point's length is its predicted_tokens,
or default_tokens where the skeleton predicted none.

LPT: take the points longest first (equal lengths: the earlier point first) and give each to the
device that would finish soonest with it (its time so far plus this point's length over its
compute; equal times: the device listed first). This is the classic greedy for machines of
different speeds, within a factor of two of the best possible finishing time.

Device profiles live in devices.json at the repository root (see default_profiles_path):
{"profiles": {"cpu": {"compute": 1095.2, "memory_gb": 25.3, "bandwidth_gb_s": 58.5, "max_parallel": 8}, ...},
 "devices": {"127.0.0.1#cpu": "cpu", "10.0.0.2#0": "h100"}}
(`python benchmarks/device_profile.py --device cuda --name h200 --write devices.json` measures one.)
A device "ip#gpu" takes the profile it is mapped to under "devices", else "cpu" for "ip#cpu" and
"cuda" for "ip#N".
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from specsot_mq.errors import SpecSotError
from specsot_mq.sot.parser import Point

PROFILE_FIELDS = ("compute", "memory_gb", "bandwidth_gb_s", "max_parallel")


@dataclass(slots=True)
class DeviceProfile:
    """What the scheduler knows about one device (or, in a profile table, one kind of device)."""

    name: str  # the device ("10.0.0.2#0"), or the profile's name ("h100") in a profile table
    compute: float  # decode throughput, tokens/s over all its branches together; any consistent unit
    memory_gb: float  # accelerator (or host) memory
    bandwidth_gb_s: float  # memory bandwidth, which bounds decode speed
    max_parallel: int  # most branches it decodes at once (its batch size)

    def __post_init__(self):
        if not self.compute > 0 or self.max_parallel < 1:
            raise SpecSotError(f"device '{self.name}' needs a positive compute and max_parallel of at least 1")


@dataclass(slots=True)
class Assignment:
    """The points one device expands."""

    device: str  # the device's name, as in --devices
    point_indices: list[int]  # Point.index of each of its points, in the order to start them (longest first)
    predicted_seconds: float  # predicted time to expand all of them


def schedule(points: list[Point], devices: list[DeviceProfile], default_tokens: int = 64) -> list[Assignment]:
    """One Assignment per device, in device order, spreading the points longest first (see above)."""
    names = [device.name for device in devices]
    for name in names:
        if names.count(name) > 1:
            raise SpecSotError(f"device '{name}' is listed twice: name each device once in --devices")
    if points and not devices:
        raise SpecSotError("there are no devices to expand the points on: pass at least one with --devices")
    if default_tokens < 1:
        raise SpecSotError(f"default_tokens must be at least 1 (got {default_tokens})")
    assignments = [Assignment(device.name, [], 0.0) for device in devices]
    tokens = [0] * len(devices)
    lengths = [point.predicted_tokens or default_tokens for point in points]
    for n in sorted(range(len(points)), key=lambda n: -lengths[n]):  # stable: equal lengths keep plan order
        finish = [(tokens[d] + lengths[n]) / device.compute for d, device in enumerate(devices)]
        best = finish.index(min(finish))  # the first of equal times
        tokens[best] += lengths[n]
        assignments[best].point_indices.append(points[n].index)
        assignments[best].predicted_seconds = finish[best]
    return assignments


def default_profiles_path() -> Path:
    """devices.json at the repository root, or SpecSotError when this install has none."""
    path = Path(__file__).resolve().parents[2] / "devices.json"
    if not path.is_file():
        raise SpecSotError(f"no devices.json at {path}: pass --devices-file with a JSON file of device profiles")
    return path


def load_profiles(path: str | Path) -> dict[str, DeviceProfile]:
    """Profiles by name, plus one entry per device mapped under "devices" (named after the device).

    Every mistake in the file (not JSON, a missing or unknown field, a number that is not positive,
    a device mapped to an unknown profile) raises SpecSotError naming the file, the entry and the fix.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise SpecSotError(f"devices file {path} does not exist: pass --devices-file with an existing file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecSotError(f"devices file {path} cannot be read ({exc}): check its permissions") from None
    except json.JSONDecodeError as exc:
        raise SpecSotError(f"devices file {path} is not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(data, dict) or not isinstance(data.get("profiles"), dict) or not data["profiles"]:
        raise SpecSotError(f"devices file {path} needs a \"profiles\" object naming at least one profile")
    unknown = sorted(set(data) - {"profiles", "devices"})
    if unknown:
        raise SpecSotError(
            f"devices file {path} has an unknown key '{unknown[0]}': use only \"profiles\" and \"devices\""
        )
    profiles = {name: _profile(path, name, fields) for name, fields in data["profiles"].items()}
    devices = data.get("devices", {})
    if not isinstance(devices, dict):
        raise SpecSotError(f"devices file {path}: \"devices\" must map device names (ip#gpu) to profile names")
    resolved = dict(profiles)
    for device, profile in devices.items():
        if "#" not in device:
            raise SpecSotError(f"devices file {path}: device '{device}' is not of the form ip#gpu (e.g. 127.0.0.1#0)")
        if profile not in profiles:
            raise SpecSotError(
                f"devices file {path}: device '{device}' uses profile '{profile}', which is not one of "
                f"{', '.join(sorted(profiles))}: add it under \"profiles\" or fix the name"
            )
        resolved[device] = dataclasses.replace(profiles[profile], name=device)
    return resolved


def _profile(path: Path, name: str, fields: object) -> DeviceProfile:
    """One validated profile from its JSON object."""
    where = f"devices file {path}: profile '{name}'"
    if "#" in name:
        raise SpecSotError(f"{where} has a '#' in its name: profile names are kinds (cpu, cuda, h100), not devices")
    if not isinstance(fields, dict):
        raise SpecSotError(f"{where} must be an object with {', '.join(PROFILE_FIELDS)}")
    for key in fields:
        if key not in PROFILE_FIELDS:
            raise SpecSotError(f"{where} has an unknown field '{key}': use only {', '.join(PROFILE_FIELDS)}")
    for key in PROFILE_FIELDS:
        if key not in fields:
            raise SpecSotError(f"{where} is missing '{key}': give it {', '.join(PROFILE_FIELDS)}")
        value = fields[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise SpecSotError(f"{where}: '{key}' must be a number, not {json.dumps(value)}")
        if value <= 0:
            raise SpecSotError(f"{where}: '{key}' must be positive, not {value}")
    if fields["max_parallel"] != int(fields["max_parallel"]):
        raise SpecSotError(f"{where}: 'max_parallel' must be a whole number, not {fields['max_parallel']}")
    return DeviceProfile(name, float(fields["compute"]), float(fields["memory_gb"]),
                         float(fields["bandwidth_gb_s"]), int(fields["max_parallel"]))
