"""`./launch/train.sh [CONFIG] [DeepSpeed launcher args]`: validate the job, then run its ranks under a
parent that owns them, so that a signal to this one process ends the whole job.

    train.sh (bash: --help, the .venv set-up) --exec--> python -m video_dit.train.launcher CONFIG [ARGS]
      1. validation and the `prepare:` stages (`video_dit.train.validate`), in this process, then the
         memory plan of the ranks about to start (`deepspeed.memory_check`): exit 2
      2. the ranks (`devices.placement`, which the memory plan of step 1 counts too): every visible
         GPU of this node (named by id under CUDA_VISIBLE_DEVICES, which DeepSpeed's runner would
         otherwise drop), else 2 CPU ranks with the cores split between them; a user's --hostfile /
         --num_gpus / --include is passed on (a --num_gpus under CUDA_VISIBLE_DEVICES as --include)
      3. the rendezvous port: --master_port if given (refused when in use here), else 29500, or a
         free port when 29500 is taken (logged)
      4. DeepSpeed's runner (`deepspeed.launcher.runner` -> `deepspeed.launcher.launch` -> ranks) in
         a process group of its own; this process waits for it and exits with its code, or with the
         code a rank recorded when it ended the job on purpose (`train/outcome.py`)
      5. SIGINT (Ctrl-C), SIGTERM (`kill PID`, `timeout`, a scheduler) or SIGHUP (a closed terminal)
         to this process: the group is killed at once and one line says after which step the run
         stopped, its last complete checkpoint and how to resume; exit 128 + the signal.
      6. SIGKILL of this process, which no handler sees: a watchdog child blocks reading a pipe
         whose only writer is this process; the kernel closes it when this process dies, and the
         watchdog then kills the group.

Why: train.sh used to `exec` DeepSpeed's runner, which forwards signals only for multi-node PDSH
jobs; a `kill` reached the runner alone, and its launcher and ranks trained on to the end (holding
the rendezvous port, so the next launch failed with EADDRINUSE). DeepSpeed's own launcher, on a
signal, terminates each rank, which under Ctrl-C (the terminal signals every process of the
foreground group) printed a KeyboardInterrupt traceback per rank. Here the ranks are not in the
terminal's foreground group, and the group is killed with SIGKILL: no rank prints anything, and
nothing is lost that a kill at any other moment would not lose (every checkpoint, export and cache
entry is written to a temporary name and renamed, so the last complete checkpoint stays intact).
A multi-node job (--hostfile) first gets SIGINT on DeepSpeed's runner, whose PDSH handler stops the
remote ranks, and up to `GRACE_S` seconds before the local group is killed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from video_dit.data import DataError
from video_dit.devices import DeviceError, free_port, launcher_option
from video_dit.devices import placement as rank_placement
from video_dit.train import checkpoint as ckpt
from video_dit.train import outcome
from video_dit.train.validate import memory_check, summary_line, validate_file
from video_dit.typed_config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PORT = 29500  # DeepSpeed's (and torch.distributed's) default rendezvous port
GRACE_S = 10.0        # multi-node: how long DeepSpeed's runner gets to stop the remote ranks
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

# The watchdog: started with SIGINT/SIGTERM/SIGHUP ignored (dispositions survive exec), it reads its
# stdin until EOF, i.e. until the launcher is gone, then kills the ranks' process group.
WATCHDOG = r"""
import os, signal, sys, time
pgid, runner, grace = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
sys.stdin.buffer.read()
def alive():
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
if grace > 0 and alive():
    try:
        os.kill(runner, signal.SIGINT)
    except ProcessLookupError:
        pass
    end = time.monotonic() + grace
    while alive() and time.monotonic() < end:
        time.sleep(0.1)
try:
    os.killpg(pgid, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


def port_in_use(port: int) -> bool:
    """Whether a socket on this machine listens on `port` (what the rank-0 TCP store would bind)."""
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers do not count
            try:
                s.bind((addr, port))
            except OSError:
                return True
    return False


def choose_port(args: list[str], log=print) -> tuple[list[str], int | None]:
    """`args` with a usable `--master_port`, and the port. A given port that is in use is an error
    (`PortInUse`); without one, 29500, or a free port when 29500 is taken. Multi-node jobs
    (--hostfile) are left alone: the rendezvous runs on another machine."""
    given = launcher_option(args, "--master_port")
    if launcher_option(args, "--hostfile") is not None:
        return args, int(given) if given else None
    if given is not None:
        if port_in_use(int(given)):
            raise PortInUse(f"--master_port {given} is in use on this machine: another job (or the ranks of one "
                            "that was killed) holds it. Pass another port, or leave --master_port out to get a "
                            "free one")
        return args, int(given)
    port = DEFAULT_PORT
    if port_in_use(port):
        port = free_port()
        log(f"[video_dit] port {DEFAULT_PORT} is in use (another job on this machine?); the ranks meet on port "
            f"{port} instead")
    return [*args, "--master_port", str(port)], port


class PortInUse(RuntimeError):
    pass


def placement(args: list[str]) -> tuple[list[str], dict]:
    """(DeepSpeed runner arguments choosing the ranks, environment changes), `devices.placement`'s:
    the user's choice, else every visible GPU (by id under CUDA_VISIBLE_DEVICES), else 2 CPU ranks
    with the OMP threads split between them. `DeviceError` for GPUs asked for and not found."""
    place = rank_placement(args)
    return list(place.runner_args), place.env


def last_step(out_dir: Path) -> int:
    """The last step metrics.jsonl records (0 when none)."""
    path = Path(out_dir) / "metrics.jsonl"
    step = 0
    if path.is_file():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # the line a killed rank was writing
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                step = max(step, row["step"])
    return step


def interrupted_line(sig: int, job) -> str:
    """One line for a run stopped by `sig`: after which step, its last checkpoint, how to resume."""
    name = signal.Signals(sig).name
    return (f"[video_dit] interrupted ({name}) after step {last_step(job.out_dir)} of {job.process.train.steps}; "
            f"{ckpt.resume_hint(job.out_dir / 'checkpoints')}")


class Supervisor:
    """Runs `cmd` in a process group of its own and makes sure that group ends when this process does
    (see the module docstring, steps 4-6). `grace_s` > 0 (multi-node): SIGINT to the runner first."""

    def __init__(self, cmd: list[str], env: dict | None = None, cwd: str | os.PathLike | None = None,
                 grace_s: float = 0.0):
        self.cmd, self.env, self.cwd, self.grace_s = cmd, env, cwd, grace_s
        self.signal: int | None = None
        self.proc: subprocess.Popen | None = None
        self.watchdog: subprocess.Popen | None = None

    def start(self) -> None:
        group = {"process_group": 0} if sys.version_info >= (3, 11) else {"start_new_session": True}
        self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=self.cwd, **group)
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in SIGNALS}  # inherited by the watchdog
        try:
            self.watchdog = subprocess.Popen(
                [sys.executable, "-c", WATCHDOG, str(self.proc.pid), str(self.proc.pid), str(self.grace_s)],
                stdin=subprocess.PIPE, close_fds=True)
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
        """End the group: SIGINT to the runner and a grace period (multi-node), then SIGKILL."""
        pgid = self.proc.pid
        if self.grace_s > 0 and self._alive(pgid):
            try:
                self.proc.send_signal(signal.SIGINT)
            except ProcessLookupError:
                pass
            end = time.monotonic() + self.grace_s
            while self._alive(pgid) and time.monotonic() < end:
                time.sleep(0.1)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    @staticmethod
    def _alive(pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False

    def wait(self) -> int:
        """The runner's exit code, or 128 + the signal this process got; the group is gone after it."""
        code = self.proc.wait()
        self.stop()  # whatever the runner left behind (nothing, normally)
        self.watchdog.stdin.close()  # the watchdog finds nothing left and exits
        self.watchdog.wait()
        for s in SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        return 128 + self.signal if self.signal is not None else code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    config = "configs/demo_i2v_tiny.yaml"
    if argv and not argv[0].startswith("-"):
        config = argv.pop(0)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731

    try:  # 2. where the ranks go (the plan of step 1 counts these); a GPU asked for and not found exits 2
        place = rank_placement(argv)
    except DeviceError as exc:
        log(f"[video_dit] error: {exc}")
        return 2
    try:  # 1. before any rank: a bad job exits 2 naming the key
        job = validate_file(config, do_prepare=True, log=log)
        job.for_ranks(place.ranks)  # train.global_batch_size splits over the ranks about to start
        memory_check(job, argv, log=log)
    except (ConfigError, DataError) as exc:
        log(f"config error in {config}: {exc}")
        return 2
    except KeyboardInterrupt:
        log("[video_dit] interrupted during the set-up, before any rank started")
        return 128 + signal.SIGINT
    log(summary_line(config, job))
    if place.note:
        log(f"[video_dit] {place.note}")
    try:  # 3.
        args, _ = choose_port(argv, log=log)
    except PortInUse as exc:
        log(f"[video_dit] error: {exc}")
        return 2
    env = dict(os.environ, **place.env, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", *place.runner(args),
           str(ROOT / "launch" / "train.py"), "--config", config]
    multi_node = launcher_option(argv, "--hostfile") is not None
    outcome.clear(job.out_dir)
    sup = Supervisor(cmd, env=env, cwd=ROOT, grace_s=GRACE_S if multi_node else 0.0)
    sup.start()  # 4.-6.
    code = sup.wait()
    if code != 0 and sup.signal is None and outcome.recorded(job.out_dir) is not None:
        code = outcome.recorded(job.out_dir)  # the rank that ended the job said why (train/outcome.py)
    if sup.signal is not None:
        log(f"\n{interrupted_line(sup.signal, job)}")
    return code


if __name__ == "__main__":
    sys.exit(main())
