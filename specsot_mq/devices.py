"""`--devices "ip#gpu,ip#gpu,..."`: the devices a run uses, each checked with one clear error."""

from __future__ import annotations

import dataclasses
import ipaddress
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specsot_mq.errors import SpecSotError

if TYPE_CHECKING:  # (annotations only: the command line imports this module for REMOTE at every start)
    from specsot_mq.sot.scheduler import DeviceProfile

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")

# How a stage starts on another host (launch's --remote): ssh in batch mode (no password or
# host-key prompt, which a launcher cannot answer) with a 10 s connect timeout, so that a host that
# cannot be reached fails by name within seconds.
REMOTE = "ssh -o BatchMode=yes -o ConnectTimeout=10 {host} {command}"


@dataclass(frozen=True, slots=True)
class Device:
    host: str  # an IP address or a resolvable host name
    slot: str  # a GPU number, or "cpu" ("cpu0", "cpu1"... name several CPU devices of one host)

    @property
    def name(self) -> str:
        return f"{self.host}#{self.slot}"

    @property
    def kind(self) -> str:
        """The devices.json profile the device falls back to when it is not mapped by name."""
        return "cpu" if self.slot.startswith("cpu") else "cuda"

    @property
    def torch_device(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.slot}"


def parse_devices(text: str, resolve: bool = True) -> list[Device]:
    """The devices named in a --devices value, in order."""
    items = [item.strip() for item in text.split(",")]
    if not text.strip() or any(not item for item in items):
        raise SpecSotError(f"--devices {text!r} has an empty entry: write e.g. 127.0.0.1#cpu,127.0.0.1#0")
    devices = []
    for item in items:
        host, sep, slot = item.rpartition("#")
        if not sep or not host:
            raise SpecSotError(f"device {item!r} is not of the form ip#gpu: write e.g. 127.0.0.1#0, or 127.0.0.1#cpu")
        if not slot.isdecimal() and not (slot.startswith("cpu") and (slot == "cpu" or slot[3:].isdecimal())):
            raise SpecSotError(f"device {item!r}: after '#' comes a GPU number, cpu, or cpu0, cpu1... "
                               f"(several CPU devices on one host), not {slot!r}")  # fmt: skip
        if resolve:
            _check_host(host, item)
        device = Device(host, slot)
        if device in devices:
            raise SpecSotError(f"device {item!r} is listed twice in --devices: name each device once")
        devices.append(device)
    return devices


def _check_host(host: str, item: str) -> None:
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    try:
        socket.getaddrinfo(host, None)
    except OSError:
        raise SpecSotError(f"device {item!r}: unknown host {host!r} (it does not resolve): use an IP address") from None


def device_profiles(devices: list[Device], profiles: dict[str, DeviceProfile]) -> list[DeviceProfile]:
    """Each device's profile from devices.json (load_profiles), as a copy named after the device:
    its own entry under "devices" first, else the profile of its kind ("cpu" or "cuda")."""
    found = []
    for d in devices:
        profile = profiles.get(d.name) or profiles.get(d.kind)
        if profile is None:
            raise SpecSotError(f"device '{d.name}' has no profile: add a \"{d.kind}\" profile or map the device "
                               "under \"devices\" in devices.json")  # fmt: skip
        found.append(dataclasses.replace(profile, name=d.name))
    return found


def is_local(host: str) -> bool:
    """Whether a host is this machine (its processes start directly, not over the remote command)."""
    if host in LOCAL_HOSTS:
        return True
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((host, 0))  # only an address of this machine (or namespace) can be bound
        return True
    except OSError:
        return False
