"""`./launch/train.sh [CONFIG] [DeepSpeed launcher args]`: validate the job, then run its ranks under a
parent that owns them, so that a signal to this one process ends the whole job, on every node.

    train.sh (bash: --help, the .venv set-up) --exec--> python -m video_dit.train.launcher CONFIG [ARGS]
      1. validation and the `prepare:` stages (`video_dit.train.validate`), in this process, then the
         memory plan of the ranks about to start (`deepspeed.memory_check`): exit 2
      2. the ranks (`devices.placement`, which the memory plan of step 1 counts too): every visible
         GPU of this node (named by id under CUDA_VISIBLE_DEVICES, which DeepSpeed's runner would
         otherwise drop), else 2 CPU ranks with the cores split between them; a user's --num_gpus /
         --include is passed on (a --num_gpus under CUDA_VISIBLE_DEVICES as --include)
      3. the rendezvous port: --master_port if given (refused when in use here), else 29500, or a
         free port when 29500 is taken (logged)
      4. DeepSpeed's runner (`deepspeed.launcher.runner` -> `deepspeed.launcher.launch` -> ranks) in
         a process group of its own (`parallel/supervise.py`); this process waits for it and exits
         with its code, or with the code a rank recorded when it ended the job on purpose
         (`train/outcome.py`)
      5. SIGINT (Ctrl-C), SIGTERM (`kill PID`, `timeout`, a scheduler) or SIGHUP (a closed terminal)
         to this process: the group is killed at once; SIGKILL of this process, which no handler
         sees: a watchdog child kills the group (`Supervisor`)
      6. every end but success prints one line: what ended it, after which step, the last complete
         checkpoint and how to resume; exit 128 + the signal, or the job's code

Several nodes (`--hostfile FILE`, DeepSpeed's hostfile; or `--launcher slurm` inside a Slurm
allocation), `run_nodes`:
      0. the hosts (`parallel/nodes.py`: DeepSpeed's hostfile rules, or the allocation's nodes)
      1. the pre-flight (`parallel/preflight.py`), before validation and before any rank: every node
         reachable, the same checkout, interpreter and packages, the comm op, the shared training
         folder, the rendezvous address and each node's interface; exit 2 in seconds naming the
         host, what is missing and how to fix it
      2. validation and the memory plan as on one host
      3. one node agent per node (`parallel/node.py`; over ssh, or one srun), each given the job's spec
         on stdin: the environment every rank gets (`nodes.carried_env`: threads, extensions folder,
         the job's variables, plus the node's GLOO/NCCL_SOCKET_IFNAME), then DeepSpeed's per-node
         launcher in a process group of its own; output relayed prefixed with the host
      4. the job ends when every agent has; the first agent to fail (a rank's death on its node, its
         node unreachable: ssh exits 255 within ~15 s) stops the others
      5. a signal to this process, or any end but success: every agent's stdin is closed, each kills
         its own process group (nothing is matched by name), this process returns once they are gone
         and prints the same one line as on one host. SIGKILL of this process closes the same pipes.

Why: train.sh used to `exec` DeepSpeed's runner, which forwards signals only for multi-node PDSH
jobs; a `kill` reached the runner alone, and its launcher and ranks trained on to the end (holding
the rendezvous port, so the next launch failed with EADDRINUSE). DeepSpeed's own launcher, on a
signal, terminates each rank, which under Ctrl-C (the terminal signals every process of the
foreground group) printed a KeyboardInterrupt traceback per rank. Here the ranks are not in the
terminal's foreground group, and the group is killed with SIGKILL: no rank prints anything, and
nothing is lost that a kill at any other moment would not lose (every checkpoint, export and cache
entry is written to a temporary name and renamed, so the last complete checkpoint stays intact).
On several nodes DeepSpeed's pdsh runner stopped remote ranks with a `pkill -f` pattern that also
killed other jobs (`parallel/nodes.py` says why we start the nodes ourselves).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from video_dit.data import DataError
from video_dit.devices import CPU_RANKS, DeviceError, free_port, launcher_option, visible_gpus
from video_dit.devices import placement as rank_placement
from video_dit.parallel import nodes
from video_dit.parallel.preflight import PreflightError, check_nodes, describe_exit
from video_dit.parallel.process import exit_now
from video_dit.parallel.supervise import SIGNALS, Supervisor
from video_dit.train import checkpoint as ckpt
from video_dit.train import outcome
from video_dit.train.config import parse_job, read_yaml
from video_dit.train.validate import memory_check, summary_line, validate_file
from video_dit.typed_config import ConfigError

__all__ = ["Supervisor", "main"]  # Supervisor lives in parallel/supervise.py; tests start it from here

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PORT = 29500  # DeepSpeed's (and torch.distributed's) default rendezvous port
# DeepSpeed runner options a multi-node launch takes: those the launcher reads itself, and those passed
# on to DeepSpeed's per-node launcher (`deepspeed.launcher.launch`) on every node
NODES_OPTIONS = {"--hostfile", "--include", "--exclude", "--num_nodes", "--num_gpus", "--master_addr",
                 "--master_port", "--ssh_port", "--launcher"}
NODES_FLAGS = {"--no_ssh_check", "--force_multi"}  # accepted, nothing to do: the pre-flight checks ssh
PASSED_OPTIONS = {"--enable_each_rank_log", "--bind_core_list", "--log_level"}
PASSED_FLAGS = {"--bind_cores_to_rank", "--quiet", "-q"}


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
    return ended_line(f"interrupted ({signal.Signals(sig).name})", job)


def ended_line(what: str, job) -> str:
    """The one line every end but success prints: `what` ended it, after which step, its last complete
    checkpoint, how to resume."""
    return (f"[video_dit] {what} after step {last_step(job.out_dir)} of {job.process.train.steps}; "
            f"{ckpt.resume_hint(job.out_dir / 'checkpoints')}")


def is_multinode(args: list[str]) -> bool:
    return launcher_option(args, "--hostfile") is not None or launcher_option(args, "--launcher") is not None


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
    if is_multinode(argv):
        return run_nodes(config, argv, place, log)
    job = validated(config, argv, place, log)
    if isinstance(job, int):
        return job
    try:  # 3.
        args, _ = choose_port(argv, log=log)
    except PortInUse as exc:
        log(f"[video_dit] error: {exc}")
        return 2
    env = dict(os.environ, **place.env, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.runner", *place.runner(args),
           str(ROOT / "launch" / "train.py"), "--config", config]
    outcome.clear(job.out_dir)
    sup = Supervisor(cmd, env=env, cwd=ROOT)
    sup.start()  # 4.-5.
    code = sup.wait()
    if sup.signal is not None:
        log(f"\n{interrupted_line(sup.signal, job)}")
        return code
    if code != 0:  # 6.
        code = outcome.recorded(job.out_dir) or code  # the rank that ended the job said why (train/outcome.py)
        log(f"\n{ended_line(f'ended ({describe_exit(code)})', job)}")
    return code


def validated(config: str, argv: list[str], place, log):
    """The validated job (prepare: stages run, the memory plan of `place`'s ranks printed and applied),
    or the exit code: 2 naming the key, 130 when interrupted."""
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
    return job


def node_options(argv: list[str]) -> list[str]:
    """The user's options that DeepSpeed's per-node launcher takes, to pass on; `DeviceError` for a
    runner option a multi-node launch does not support."""
    passed, i = [], 0
    while i < len(argv):
        name, _, value = argv[i].partition("=")
        takes_value = name in NODES_OPTIONS or name in PASSED_OPTIONS
        if takes_value and not value:
            if i + 1 >= len(argv):
                raise DeviceError(f"{name} needs a value")
            value = argv[i + 1]
            i += 1
        if name == "--launcher" and value not in ("pdsh", "ssh", "slurm"):
            raise DeviceError(f"--launcher {value}: the nodes are started over ssh (the default) or srun "
                              "(--launcher slurm); accepted: ssh, slurm")
        if name in PASSED_OPTIONS:
            passed.append(f"{name}={value}")
        elif name in PASSED_FLAGS:
            passed.append(name)
        elif name not in NODES_OPTIONS and name not in NODES_FLAGS:
            raise DeviceError(f"{argv[i]}: not an option of a multi-node launch; accepted: "
                              f"{', '.join(sorted(NODES_OPTIONS | NODES_FLAGS | PASSED_OPTIONS | PASSED_FLAGS))}")
        i += 1
    return passed


@dataclass
class NodesReady:
    """What a multi-node launch's pre-flight found: the hosts, how to reach them, the rendezvous
    (address, port), each host's interface variables, the options for DeepSpeed's per-node launcher."""

    hosts: nodes.Hosts
    transport: object
    master_addr: str
    port: int
    interfaces: dict
    passed: list
    place: object


def preflight_nodes(config: str, argv: list[str], place, log) -> NodesReady | int:
    """Steps 0 and 1 of "Several nodes" (module docstring): the hosts, then the pre-flight of every node.
    Returns what it found, or exit code 2 (the reason logged: a bad option or hostfile, a problem on a
    node naming the host and the fix)."""
    slurm = launcher_option(argv, "--launcher") == "slurm"
    try:  # 0. the hosts
        passed = node_options(argv)
        hosts = nodes.job_hosts(argv, local_slots=len(visible_gpus()) or CPU_RANKS)
        first = parse_job(read_yaml(config), config)  # its training folder, for the pre-flight
    except DeviceError as exc:
        log(f"[video_dit] error: {exc}")
        return 2
    except ConfigError as exc:
        log(f"config error in {config}: {exc}")
        return 2
    transport = nodes.Srun() if slurm else nodes.Ssh(port=launcher_option(argv, "--ssh_port"))
    master_addr = launcher_option(argv, "--master_addr") or hosts.names[0]
    given_port = launcher_option(argv, "--master_port")
    log(f"[video_dit] pre-flight: {len(hosts.names)} nodes ({', '.join(hosts.names)}, from {hosts.source}) over "
        f"{'srun' if slurm else 'ssh'}, rendezvous {master_addr}")
    start = time.monotonic()
    try:  # 1.
        interfaces, port, notes = check_nodes(
            transport, hosts.names, root=str(ROOT), python=sys.executable, master_addr=master_addr,
            port=int(given_port or DEFAULT_PORT), port_given=given_port is not None, folder=first.out_dir,
            ext=nodes.comm_op(place.device, os.environ))
    except PreflightError as exc:
        log("[video_dit] pre-flight failed, no rank started:\n  " + "\n  ".join(str(exc).splitlines()))
        return 2
    except KeyboardInterrupt:
        log("[video_dit] interrupted during the pre-flight, before any rank started")
        return 128 + signal.SIGINT
    for note in notes:
        log(f"[video_dit] {note}")
    log(f"[video_dit] pre-flight: every node OK in {time.monotonic() - start:.1f} s; interfaces "
        + ", ".join(f"{h} {e.get('GLOO_SOCKET_IFNAME', 'as set')}" for h, e in interfaces.items()))
    return NodesReady(hosts, transport, master_addr, port, interfaces, passed,
                      replace(place, ranks=hosts.ranks, nodes=len(hosts.names)))


def run_nodes(config: str, argv: list[str], place, log) -> int:
    """A job on several nodes (module docstring, "Several nodes"): pre-flight, validation, one node
    agent per node, the end. Returns the exit code."""
    ready = preflight_nodes(config, argv, place, log)  # 0.-1.
    if isinstance(ready, int):
        return ready
    hosts, transport, master_addr, port, place = (ready.hosts, ready.transport, ready.master_addr, ready.port,
                                                  ready.place)
    job = validated(config, argv, place, log)  # 2.
    if isinstance(job, int):
        return job
    tag = f"{job.name}-{secrets.token_hex(4)}"
    env = nodes.carried_env(os.environ, place.env, ROOT)  # 3.
    launch = [sys.executable, "-u", "-m", "deepspeed.launcher.launch",
              f"--world_info={nodes.world_info(hosts.slots)}", f"--master_addr={master_addr}",
              f"--master_port={port}", *ready.passed]
    script = [str(ROOT / "launch" / "train.py"), "--config", str(Path(config).resolve())]
    spec = {"tag": tag, "hosts": hosts.names, "env": env, "node_env": ready.interfaces, "launch": launch,
            "script": script, "cwd": str(ROOT)}
    specs = [{**spec, "node": i} for i in range(len(hosts.names))] if transport.per_host else [spec]
    log(f"[video_dit] job {tag}: {hosts.ranks} ranks on {len(hosts.names)} nodes; every rank gets "
        + ", ".join(f"{k}={env[k]}" for k in ("OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR") if k in env)
        + f" and {len(env)} carried variables in all")
    outcome.clear(job.out_dir)
    run = nodes.NodeRun(transport, hosts.names, nodes.agent_command(str(ROOT), sys.executable), specs)
    got = []

    def on_signal(signum, frame):
        if not got:
            got.append(signum)
            run.stop()  # 5. every agent kills its own ranks; returns once they are gone

    previous = {s: signal.signal(s, on_signal) for s in SIGNALS}
    try:
        run.start()
        if got:  # a signal while the agents were being started: stop those started after it too
            run.stop()
        code = run.wait()  # 4.
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if got:
        log(f"\n{interrupted_line(got[0], job)}")
        return 128 + got[0]
    if code != 0:
        code = outcome.recorded(job.out_dir) or code
        what = "; ".join(f"{host}: {why}" for host, why in run.failures)
        log(f"\n{ended_line(f'ended ({what})', job)}")
    return code


if __name__ == "__main__":
    exit_now(main())  # the job has ended: nothing is left open here but stdout and stderr
