"""The launcher that owns the ranks (video_dit/train/launcher.py), with stand-in ranks (fast): a signal
to its process ends the whole process group (SIGINT, SIGTERM: one line, exit 128 + signal; SIGKILL:
the watchdog does it), the rendezvous port is checked, `train.sh --help` prints our usage only.
The same through real DeepSpeed ranks: tests/faults/test_launcher_signals.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# a stand-in for DeepSpeed's runner: it starts a "rank" (a grandchild, as launch.py does) and both sleep
RUNNER = r"""
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(f"{rank.pid}\n")
time.sleep(600)
"""
PARENT = r"""
import sys
sys.path.insert(0, sys.argv[1])
from video_dit.train.launcher import Supervisor
sup = Supervisor([sys.executable, "-c", sys.argv[2], sys.argv[3]])
sup.start()
print(sup.proc.pid, flush=True)
sys.exit(sup.wait())
"""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=["TERM", "INT", "KILL"])
def test_a_signal_to_the_launcher_ends_every_process_it_started(tmp_path, sig):
    pidfile = tmp_path / "rank.pid"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(ROOT), RUNNER, str(pidfile)],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        runner = int(parent.stdout.readline())
        for _ in range(200):
            if pidfile.is_file() and pidfile.read_text().endswith("\n"):
                break
            time.sleep(0.05)
        rank = int(pidfile.read_text())
        assert _alive(runner) and _alive(rank)
        # the ranks are not in the launcher's (the terminal's foreground) process group: Ctrl-C reaches
        # the launcher only, never a rank
        assert os.getpgid(rank) == runner != os.getpgid(parent.pid)
        parent.send_signal(sig)  # the launcher's PID, not its process group
        code = parent.wait(timeout=10)
        end = time.monotonic() + 3
        while (_alive(runner) or _alive(rank)) and time.monotonic() < end:
            time.sleep(0.05)
        assert not _alive(runner) and not _alive(rank)
        assert code == (-signal.SIGKILL if sig == signal.SIGKILL else 128 + sig)
    finally:
        for pid in (parent.pid,):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_rendezvous_port(monkeypatch):
    from video_dit.train import launcher

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert launcher.port_in_use(port)
        with pytest.raises(launcher.PortInUse, match=f"--master_port {port} is in use on this machine"):
            launcher.choose_port(["--master_port", str(port)])
        # no port given and the default taken: another one, said in the log
        monkeypatch.setattr(launcher, "DEFAULT_PORT", port)
        lines = []
        args, chosen = launcher.choose_port(["--foo"], log=lines.append)
        assert chosen != port and args == ["--foo", "--master_port", str(chosen)] and not launcher.port_in_use(chosen)
        assert lines == [f"[video_dit] port {port} is in use (another job on this machine?); the ranks meet on "
                         f"port {chosen} instead"]
    # a free port given is kept; multi-node jobs are left alone (the rendezvous is on another machine)
    assert launcher.choose_port(["--master_port", str(chosen)]) == (["--master_port", str(chosen)], chosen)
    assert launcher.choose_port(["--hostfile", "hosts"])[0] == ["--hostfile", "hosts"]


def test_a_master_port_in_use_exits_2_naming_it(monkeypatch, capsys):
    """The launcher's own exit for a given port in use: 2, one line naming the port, before any rank starts
    (the job's checks before it are stubbed: a real job's are tests/test_bad_input.py's)."""
    from types import SimpleNamespace

    from video_dit.train import launcher

    monkeypatch.setattr(launcher, "validate_file", lambda *a, **k: SimpleNamespace(for_ranks=lambda ranks: None))
    monkeypatch.setattr(launcher, "memory_check", lambda *a, **k: None)
    monkeypatch.setattr(launcher, "summary_line", lambda *a: "[video_dit] job summary")
    monkeypatch.setattr(launcher, "Supervisor", None)  # no rank may start
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert launcher.main(["job.yaml", "--master_port", str(port)]) == 2
    assert f"[video_dit] error: --master_port {port} is in use on this machine" in capsys.readouterr().err


def test_placement_keeps_the_users_choice(monkeypatch):
    from video_dit.train import launcher

    assert launcher.placement(["--num_gpus", "4"]) == ([], {})
    assert launcher.placement(["--include=localhost:0,1"]) == ([], {})
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    ranks, env = launcher.placement([])
    assert ranks == ["--num_gpus", "2"] and env == {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}


@pytest.mark.parametrize("args", [["--help"], ["configs/demo_i2v_tiny.yaml", "-h"]])
def test_train_sh_help_is_our_usage_and_runs_nothing(tmp_path, args):
    # no python on PATH: anything beyond the usage (the .venv set-up, validation, DeepSpeed) would fail
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", str(ROOT / "launch/train.sh"), *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=30)
    assert proc.returncode == 0 and proc.stderr == ""
    out = proc.stdout
    assert out.startswith("Usage: ./launch/train.sh [CONFIG.yaml]")
    for part in ("model.name_or_path", "network", "datasets[]", "train ", "deepspeed", "metrics.jsonl",
                 "checkpoints/", "samples/", "<training_folder>/<name>/", "--hostfile"):
        assert part in out, part
    assert "deepspeed.launcher" not in out and "usage: deepspeed" not in out.lower()
