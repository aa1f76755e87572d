"""A command run in a process group of its own that ends when its owner does: the launcher's ranks on
one host (`train/launcher.py`) and each node's share of a multi-node job (`parallel/node.py`).

    Supervisor(cmd).start()   the command in a new process group (its pid is the group id), this
                              process's SIGINT / SIGTERM / SIGHUP handled, and a watchdog child
    Supervisor.stop()         SIGKILL to the group, then wait (bounded) until no live member is left
    Supervisor.wait()         the command's exit code (128 + the signal when one stopped it); the group
                              is gone when it returns
    group_alive(pgid)         whether a process group has a live (not zombie) member

The watchdog covers the case no handler sees, a SIGKILL of the owner: it is started with the signals
above ignored (dispositions survive exec) and blocks reading a pipe whose only writer is the owner;
the kernel closes that pipe when the owner dies, and the watchdog then kills the group.

Stopping kills the group by its id, the command's own pid: nothing else is matched, so another job
on the same host, even one started with the same command line, is never touched.

Standard library only: the per-node agent imports this before any rank exists (no torch import).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
GONE_WAIT_S = 10.0  # stop(): how long to wait for the killed group's members to be gone

WATCHDOG = r"""
import os, signal, sys
pgid = int(sys.argv[1])
sys.stdin.buffer.read()
try:
    os.killpg(pgid, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


def group_alive(pgid: int) -> bool:
    """Whether process group `pgid` has a member that is not a zombie. `os.killpg(pgid, 0)` counts
    zombies too: a killed group whose leader this process has not reaped yet, or whose orphans init
    has not reaped yet, looked alive, and the launcher waited its whole grace period (10 s) on it."""
    proc = Path("/proc")
    if not proc.is_dir():  # no procfs: the kernel's answer, zombies included
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


class Supervisor:
    """Runs `cmd` in a process group of its own and makes sure that group ends when this process
    does, or when `stop()` is called (from a signal handler or another thread)."""

    def __init__(self, cmd: list[str], env: dict | None = None, cwd: str | os.PathLike | None = None,
                 stdin=None):
        self.cmd, self.env, self.cwd, self.stdin = cmd, env, cwd, stdin
        self.signal: int | None = None
        self.proc: subprocess.Popen | None = None
        self.watchdog: subprocess.Popen | None = None

    def start(self) -> None:
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
        self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=self.cwd, stdin=self.stdin, **group)
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in SIGNALS}  # inherited by the watchdog
        try:
            self.watchdog = subprocess.Popen([sys.executable, "-c", WATCHDOG, str(self.proc.pid)],
                                             stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        for s in SIGNALS:
            signal.signal(s, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum
            self.stop()

    def stop(self) -> None:
        """SIGKILL to the group; returns once none of its members is alive (at most `GONE_WAIT_S`)."""
        pgid = self.proc.pid
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        end = time.monotonic() + GONE_WAIT_S
        while time.monotonic() < end:
            self.proc.poll()  # reap the leader: an unreaped leader is a zombie member of the group
            if not group_alive(pgid):
                return
            time.sleep(0.02)

    def wait(self) -> int:
        """The command's exit code, or 128 + the signal this process got; the group is gone after it."""
        code = self.proc.wait()
        self.stop()  # whatever the command left behind (nothing, normally)
        self.watchdog.stdin.close()  # the watchdog finds nothing left and exits
        self.watchdog.wait()
        for s in SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        return 128 + self.signal if self.signal is not None else code
