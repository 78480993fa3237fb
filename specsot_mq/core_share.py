"""The CPU device stages of one host share its cores by how many of them are busy.

A launch puts the skeleton stage and one branch stage per CPU device on a host, each a process
with its own model. A stage busy alone should run on every core; stages busy together should
split them, because OpenMP threads of two processes on the same cores slow each other down
several times over (benchmarks/HISTORY.md). So the stages of a host share a small board in
shared memory: for each stage, whether it has work and how many threads it holds. Before each
model step a stage marks itself busy, works out its share (`cores // busy stages`), and takes it
once the others hold no more than the rest: a stage still running a step on every core gives
them back at its next step, so a stage that turns busy waits at most one step of the other
instead of running beside it on too few cores. A stage whose process died (killed mid-step, its
place still marked until its restart clears it) is not counted: the board holds each stage's
process id. A waiting stage takes no core: runner.py bounds how long idle OpenMP threads spin.
A launch's range servers (--split layers) share a board of their own the same way.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import tempfile
import time
from pathlib import Path

PROC = Path("/proc/self/stat").exists()  # Linux's process table, which tells a zombie from a running process


class CoreShare:
    """One stage's place on its host's board: `take()` before a step, `idle()` when out of work."""

    max_wait_s = 1.0  # a stage whose process is gone is not waited for; a stuck one no longer than this

    def __init__(self, path: Path, index: int, members: int, cores: int):
        if not 0 <= index < members:
            raise ValueError(f"index {index} is not one of {members} members")
        self.path, self.index, self.members, self.cores = path, index, members, cores
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < 6 * members:
                os.ftruncate(fd, 6 * members)
            # byte 2i: stage i has work; byte 2i+1: threads it holds (0 while it waits or idles);
            # then 4 bytes a stage: its process id
            self.board = mmap.mmap(fd, 6 * members)
        finally:
            os.close(fd)  # the mapping keeps the memory
        self.idle()  # a restarted stage clears what its dead predecessor left
        self.board[self._pid_at(index) : self._pid_at(index) + 4] = os.getpid().to_bytes(4, "little")

    def take(self) -> int:
        """Mark this stage busy and return its share of the cores, waiting until the other stages
        hold no more than the rest (they give cores back at their next step)."""
        board, me = self.board, self.index
        board[2 * me] = 1
        board[2 * me + 1] = 0
        deadline = time.monotonic() + self.max_wait_s
        while True:
            # a stage whose process died holds nothing (it is not waited for until its restart)
            others = [i for i in range(self.members) if i != me and board[2 * i] and self._alive(i)]
            share = max(1, self.cores // (1 + len(others)))
            held = sum(board[2 * i + 1] for i in others)
            if held + share <= self.cores or time.monotonic() > deadline:
                board[2 * me + 1] = share
                return share
            time.sleep(0.0005)

    def _pid_at(self, i: int) -> int:
        return 2 * self.members + 4 * i

    def _alive(self, i: int) -> bool:
        """Whether stage i's process is running: not gone, nor a zombie its launcher has yet to
        reap (one that never wrote its id counts as running)."""
        pid = int.from_bytes(self.board[self._pid_at(i) : self._pid_at(i) + 4], "little")
        if pid == 0:
            return True
        if not PROC:
            return _signalable(pid)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                return f.read().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
        except FileNotFoundError:
            return False
        except (OSError, IndexError):
            return _signalable(pid)

    def idle(self) -> None:
        """This stage has no work: it holds no cores."""
        self.board[2 * self.index] = 0
        self.board[2 * self.index + 1] = 0

    @staticmethod
    def board_path(run_key: str, host: str) -> Path:
        """The board of one run's stages on one host: a file in shared memory where there is one
        (named after the run, so two launches on one host never share a board)."""
        folder = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        digest = hashlib.sha1(f"{run_key}|{host}".encode()).hexdigest()[:16]
        return folder / f"specsot-cores-{digest}"


def _signalable(pid: int) -> bool:
    """Whether a process of this id exists (where there is no /proc to read)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
