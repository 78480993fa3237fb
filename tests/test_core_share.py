"""The core board of one host's CPU device stages (core_share.py): shares by busy stages, a stage
that turns busy waits until the others give cores back, and restarts and runs stay apart."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from specsot_mq.core_share import CoreShare


def board(tmp_path, members=2, cores=8):
    path = tmp_path / "board"
    return [CoreShare(path, i, members, cores) for i in range(members)]


def test_a_stage_busy_alone_takes_every_core_and_busy_stages_split_them(tmp_path):
    a, b, c = board(tmp_path, members=3, cores=8)
    assert a.take() == 8
    a.idle()
    assert b.take() == 8  # a gave its cores back
    c.board[2 * c.index] = 1  # c has work
    assert b.take() == 4  # b's next step
    assert c.take() == 4
    a.board[2 * a.index] = 1  # a has work again: three busy stages
    assert [b.take(), c.take(), a.take()] == [2, 2, 2]


def test_shares_follow_the_busy_stages_at_each_step(tmp_path):
    a, b = board(tmp_path, cores=8)
    a.max_wait_s = b.max_wait_s = 0.05
    assert a.take() == 8
    b.board[2 * b.index] = 1  # b has work (marked, holding nothing yet)
    assert a.take() == 4  # a's next step: its share shrinks
    assert b.take() == 4  # a holds 4: room for b's 4 at once
    b.idle()
    assert a.take() == 8  # b is out of work: a grows back at its next step


def test_a_stage_that_turns_busy_waits_for_the_cores_another_still_holds(tmp_path):
    a, b = board(tmp_path, cores=2)
    b.max_wait_s = 3600.0  # b waits for a however slowly this test runs
    assert a.take() == 2  # a runs a step on both cores
    got = {}
    waiter = threading.Thread(target=lambda: got.update(share=b.take()))
    waiter.start()
    while not b.board[2 * b.index]:  # until b has marked itself busy and waits
        time.sleep(0.001)
    time.sleep(0.2)  # a's step goes on: b must not start beside it on cores a holds
    assert "share" not in got
    assert a.take() == 1  # a's next step sees b busy and gives a core back
    waiter.join()
    assert got["share"] == 1


def test_a_stuck_holder_is_not_waited_for_long_and_a_restart_clears_its_place(tmp_path):
    path = tmp_path / "board"
    a, b = CoreShare(path, 0, 2, 2), CoreShare(path, 1, 2, 2)
    assert a.take() == 2  # then a's process dies without giving its cores back
    b.max_wait_s = 0.0  # its wait for a's cores runs out at once
    assert b.take() == 1
    b.idle()
    CoreShare(path, 0, 2, 2)  # a's stage restarts: its place is cleared
    assert b.take() == 2


def test_boards_are_per_run_and_host(tmp_path):
    paths = {CoreShare.board_path(run, host) for run in ("ipc:///a/client.sock", "ipc:///b/client.sock")
             for host in ("127.0.0.1", "10.0.0.2")}  # fmt: skip
    assert len(paths) == 4
    assert CoreShare.board_path("r", "h") == CoreShare.board_path("r", "h")
    with pytest.raises(ValueError, match="index 2 is not one of 2 members"):
        CoreShare(tmp_path / "board", 2, 2, 4)


def test_a_stage_whose_process_died_holding_cores_is_not_waited_for(tmp_path):
    """A stage killed mid-step keeps its place marked busy until its restart clears it; the others
    see its process gone (a zombie its launcher has not reaped yet, then reaped) and take every
    core at once, where they would otherwise wait out max_wait_s at every step until the restart."""
    path = tmp_path / "board"
    survivor = CoreShare(path, 0, 2, 2)
    survivor.max_wait_s = 3600.0
    code = ("import pathlib, sys, time; from specsot_mq.core_share import CoreShare; "
            "print(CoreShare(pathlib.Path(sys.argv[1]), 1, 2, 2).take(), flush=True); time.sleep(600)")
    child = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "2"  # it holds both cores
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while state(child.pid) != "Z":  # (until the kill has landed: a zombie, not reaped)
            assert time.monotonic() < deadline, "the killed child never became a zombie"
            time.sleep(0.01)
        got = {}
        taker = threading.Thread(target=lambda: got.update(share=survivor.take()), daemon=True)
        taker.start()
        taker.join(60)
        assert got == {"share": 2}, "the survivor waited for a dead stage's cores"
    finally:
        child.kill()
        child.wait()
    survivor.idle()
    assert survivor.take() == 2  # reaped: gone from /proc


def state(pid: int) -> str:
    """A process's state letter in Linux's process table (R, S, Z, ...)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]
