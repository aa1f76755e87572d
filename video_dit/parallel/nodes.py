"""A multi-node job's hosts, the environment its ranks get, and its node agents (the launcher's
multi-node path, `train/launcher.py`).

    job_hosts(args)     the hosts in rank order with their rank slots: DeepSpeed's hostfile with its
                        --include / --exclude / --num_nodes / --num_gpus (DeepSpeed's own parser), or
                        the Slurm allocation (`--launcher slurm`: SLURM_JOB_NODELIST)
    carried_env(...)    what every rank gets on every node, whatever the host's own environment
    Ssh / Srun          how a command reaches the nodes: one ssh per host, or one srun for all
    NodeRun             the node agents (`parallel/node.py`): each gets the job's spec on stdin, its
                        output is relayed prefixed with its host; closing stdin stops them

Why our own agents and not DeepSpeed's pdsh runner: on a signal that runner stops the remote side with
`pdsh ... pkill -f "<python> -u -m deepspeed.launcher.launch"`, a pattern that matches every job
started from the same interpreter on those hosts (an unrelated job on node2 was killed by it); it
forwards only a few variable prefixes (TORCH_EXTENSIONS_DIR and OMP_NUM_THREADS never reached the
ranks); and a node whose interpreter was missing left the other waiting in the rendezvous for 30
minutes. Each node still runs DeepSpeed's own per-node launcher (`deepspeed.launcher.launch`, the
command that runner sends), so the ranks' environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*) is
DeepSpeed's.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from video_dit.devices import DeviceError, launcher_option
from video_dit.parallel.preflight import describe_exit

# Variables carried to every rank, by prefix (DeepSpeed's runner carries PYTHON, MLFLOW, UCX and MV2 and
# the lines of .deepspeed_env; these add what changes a rank's numerics, threads, compiled ops, network
# and caches). CUDA_VISIBLE_DEVICES is each node's own (DeepSpeed's launcher sets it from the hostfile).
CARRIED_PREFIXES = ("VIDEO_DIT_", "OMP_", "MKL_", "KMP_", "TORCH_", "PYTORCH_", "NCCL_", "GLOO_", "CUDA_", "NVIDIA_",
                    "TRITON_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "DS_", "DEEPSPEED_", "PYTHON", "MLFLOW", "UCX",
                    "MV2", "WANDB_")
NOT_CARRIED = ("CUDA_VISIBLE_DEVICES", "VIDEO_DIT_JOB")
DEEPSPEED_ENV_FILE = os.environ.get("DS_ENV_FILE", ".deepspeed_env")  # DeepSpeed's name for it (runner.py)
SSH_ARGS_VAR = "VIDEO_DIT_SSH_ARGS"  # extra ssh options, e.g. "-F ~/.ssh/cluster_config -i KEY"
CONNECT_S = 10      # ssh ConnectTimeout
ALIVE_S, ALIVE_COUNT = 5, 3  # ssh ServerAlive*: a node unreachable mid-run is noticed within ~15 s
FAILURE_WINDOW_S = 5.0  # after a node agent fails, how long the others get to end on their own
STOP_WAIT_S = 10.0  # after closing the agents' stdin: how long they get to kill their ranks and exit


@dataclass
class Hosts:
    """The job's hosts in rank order (host i runs ranks sum(slots of hosts < i) ...) and their slots
    (local device ids), as DeepSpeed's `world_info`; `source` says where they came from."""

    slots: OrderedDict
    source: str

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    @property
    def ranks(self) -> int:
        return sum(len(s) for s in self.slots.values())

    @property
    def ranks_per_node(self) -> int:
        return max(len(s) for s in self.slots.values())


def job_hosts(args: list[str], local_slots: int) -> Hosts:
    """The hosts of a multi-node launch. `--hostfile`: DeepSpeed's hostfile, --include / --exclude /
    --num_nodes / --num_gpus applied by DeepSpeed's own functions (each node's launcher reads the same
    `world_info`). `--launcher slurm`: the allocation's nodes (`scontrol show hostnames`), each with
    --num_gpus slots, else `local_slots` (this node's visible GPUs, or the CPU ranks a node gets)."""
    from deepspeed.launcher.runner import apply_num_nodes_and_gpus, fetch_hostfile, parse_inclusion_exclusion

    num_gpus = int(launcher_option(args, "--num_gpus") or -1)
    if launcher_option(args, "--launcher") == "slurm":
        if launcher_option(args, "--hostfile") is not None:
            raise DeviceError("--launcher slurm takes its hosts from the Slurm allocation: leave --hostfile out")
        names = slurm_nodes()
        per = num_gpus if num_gpus > 0 else local_slots
        return Hosts(OrderedDict((h, list(range(per))) for h in names), "the Slurm allocation")
    path = launcher_option(args, "--hostfile")
    if path is None:
        raise DeviceError("several nodes are given by --hostfile FILE (DeepSpeed's `node1 slots=8` lines), or by "
                          "--launcher slurm inside a Slurm allocation")
    try:
        pool = fetch_hostfile(path)
    except ValueError as exc:  # DeepSpeed's message names the line
        raise DeviceError(f"--hostfile {path}: {exc}") from exc
    if not pool:
        raise DeviceError(f"--hostfile {path}: no such file, or no `host slots=N` lines")
    include, exclude = launcher_option(args, "--include") or "", launcher_option(args, "--exclude") or ""
    try:
        active = parse_inclusion_exclusion(pool, include, exclude)
    except ValueError as exc:
        raise DeviceError(f"--include/--exclude: {exc}") from exc
    active = apply_num_nodes_and_gpus(active, int(launcher_option(args, "--num_nodes") or -1), num_gpus)
    return Hosts(OrderedDict(active), f"--hostfile {path}")


def slurm_nodes(environ=os.environ) -> list[str]:
    """The allocation's node names in Slurm's order (`scontrol show hostnames $SLURM_JOB_NODELIST`)."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise DeviceError("--launcher slurm runs inside a Slurm allocation (sbatch launch/slurm.sh, or salloc): "
                          "SLURM_JOB_NODELIST is not set here")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    except FileNotFoundError as exc:
        raise DeviceError("--launcher slurm: scontrol (Slurm's client) is not on PATH") from exc
    except subprocess.CalledProcessError as exc:
        raise DeviceError(f"--launcher slurm: scontrol show hostnames {nodelist}: {exc.stderr.strip()}") from exc
    return out.stdout.split()


def deepspeed_env_files(cwd: Path) -> dict:
    """KEY=VALUE lines of DeepSpeed's `.deepspeed_env` in the home folder, then the working folder
    (DeepSpeed's runner reads the same files; the later one wins)."""
    found = {}
    for folder in (Path.home(), cwd):
        path = folder / DEEPSPEED_ENV_FILE
        if path.is_file():
            for line in path.read_text().splitlines():
                if "=" in line and not line.lstrip().startswith("#"):
                    key, value = line.split("=", 1)
                    found[key.strip()] = value.strip()
    return found


def carried_env(environ: dict, decided: dict, cwd: Path) -> dict:
    """The variables every rank gets on every node: this environment's `CARRIED_PREFIXES` ones, the
    `.deepspeed_env` files, and what the launcher decided for all ranks (`decided`: threads, the
    extensions folder), so that a rank's settings do not depend on the host it lands on."""
    env = {k: v for k, v in environ.items() if k.startswith(CARRIED_PREFIXES) and k not in NOT_CARRIED}
    env.update(deepspeed_env_files(cwd))
    env.update(decided)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def world_info(slots: OrderedDict) -> str:
    """DeepSpeed's `--world_info` (base64 JSON of host -> local device ids), its own encoder."""
    from deepspeed.launcher.runner import encode_world_info

    return encode_world_info(slots)


def comm_op(device: str, environ=os.environ) -> dict | None:
    """Where a CPU job's ranks look for DeepSpeed's communication op (`parallel/ops.py`): the carried
    TORCH_EXTENSIONS_DIR, else torch's per-user default folder (`torch.utils.cpp_extension`'s rule:
    ~/.cache/torch_extensions/py<version>_<accelerator>); None where no op is built (GPU ranks)."""
    if device != "cpu":
        return None
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return None
    accel = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
             f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    folder = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{accel}"
    return {"dir": environ.get("TORCH_EXTENSIONS_DIR"), "build_folder": folder, "op": builder.NAME}


def agent_command(root: str, python: str) -> str:
    """The shell command that starts a node agent (`parallel/node.py`) in this checkout."""
    return f"cd {shlex.quote(root)} && exec {shlex.quote(python)} -u -m video_dit.parallel.node"


class Ssh:
    """One `ssh HOST COMMAND` per host, without a terminal or a password prompt; `port` (--ssh_port) and
    $VIDEO_DIT_SSH_ARGS (e.g. `-F FILE`) added."""

    per_host = True
    reach_fix = ("every host must accept `ssh HOST` from this one by the hostfile's name, with a key and no "
                 "password prompt (ssh-copy-id HOST; accept its host key once: ssh HOST true)")

    def __init__(self, port: str | None = None, environ=os.environ):
        self.port = port
        self.extra = shlex.split(environ.get(SSH_ARGS_VAR, ""))

    def argv(self, host: str, command: str) -> list[str]:
        return ["ssh", "-T", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_S}",
                "-o", f"ServerAliveInterval={ALIVE_S}", "-o", f"ServerAliveCountMax={ALIVE_COUNT}",
                *(["-p", str(self.port)] if self.port else []), *self.extra, host, command]

    def describe(self, code: int, tail: str) -> str:
        if code == 255:  # ssh's own failure, or the remote command killed by a signal
            return f"ssh ended with 255: unreachable, or its node agent killed ({tail or 'no message'})"
        return describe_exit(code)


class Srun:
    """One `srun` step over all hosts, one task (a node agent) per node; with `--input=all` srun hands
    every task the same stdin, and its end of file."""

    per_host = False
    reach_fix = "check the allocation's nodes (sinfo; scontrol show node NAME) and srun there"

    def __init__(self, environ=os.environ):
        cpus = environ.get("SLURM_CPUS_ON_NODE")
        self.cpus = [f"--cpus-per-task={cpus}"] if cpus else []  # the agent's ranks get the node's CPUs

    def argv(self, hosts: list[str], command: str, stdin_all: bool = False) -> list[str]:
        n = len(hosts)
        return ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", f"--nodelist={','.join(hosts)}",
                "--label", "--kill-on-bad-exit=1", *self.cpus, *(["--input=all"] if stdin_all else []),
                "sh", "-c", command]

    def describe(self, code: int, tail: str) -> str:
        return describe_exit(code) + (f" ({tail})" if tail else "")


class NodeRun:
    """The job's node agents, running. `start()` sends each its spec; `wait()` returns when every agent
    has ended, or as soon as one fails (the others are then stopped); `stop()` closes their stdin (each
    kills its own ranks and exits) and waits for them, then kills what is left of ssh / srun."""

    def __init__(self, transport, hosts: list[str], command: str, specs: list[dict], out=None):
        self.transport, self.hosts, self.command, self.specs = transport, hosts, command, specs
        self.out = out if out is not None else sys.stdout.buffer
        self.procs: list[subprocess.Popen] = []
        self.labels: list[str] = []
        self.tails: list[str] = []
        self.srun_errors: list[str] = []
        self.relays: list[threading.Thread] = []
        self.lock = threading.Lock()
        self.failures: list[tuple[str, str]] = []  # (host, what happened), the likely cause first

    def start(self) -> None:
        if self.transport.per_host:
            argvs = [(h, self.transport.argv(h, self.command), spec) for h, spec in zip(self.hosts, self.specs)]
        else:
            argvs = [("srun", self.transport.argv(self.hosts, self.command, stdin_all=True), self.specs[0])]
        for label, argv, spec in argvs:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # not in the terminal's group: Ctrl-C reaches us only
            proc.stdin.write(json.dumps(spec).encode() + b"\n")
            proc.stdin.flush()
            self.procs.append(proc)
            self.labels.append(label)
            self.tails.append("")
            relay = threading.Thread(target=self._relay, args=(len(self.procs) - 1,), daemon=True)
            relay.start()
            self.relays.append(relay)

    def _relay(self, i: int) -> None:
        """Copy agent i's output to ours, each line prefixed with its host (srun labels its own)."""
        prefix = b"" if self.labels[i] == "srun" else self.labels[i].encode() + b": "
        for line in iter(self.procs[i].stdout.readline, b""):
            with self.lock:
                self.out.write(prefix + line)
                self.out.flush()
            text = line.decode(errors="replace").strip()
            if text:
                self.tails[i] = text
            if text.startswith("srun: error: ") and ": task " in text:
                self.srun_errors.append(text)

    def wait(self, poll_s: float = 0.05) -> int:
        """0 when every agent ended with 0; else the likeliest cause's code, after the other agents got up
        to `FAILURE_WINDOW_S` to end on their own (a rank's death on one node makes its peers fail too,
        and whichever node's launcher notices first should not hide what happened; the wait ends as
        soon as an agent shows a first cause, `_cause_seen`), then were stopped."""
        while True:
            codes = [p.poll() for p in self.procs]
            if any(c not in (None, 0) for c in codes):
                break
            if all(c == 0 for c in codes):
                self._drain()
                return 0
            time.sleep(poll_s)
        end = time.monotonic() + FAILURE_WINDOW_S
        while any(p.poll() is None for p in self.procs) and time.monotonic() < end and not self._cause_seen():
            time.sleep(poll_s)
        bad = [(i, p.returncode) for i, p in enumerate(self.procs) if p.returncode not in (None, 0)]
        self.stop()  # the agents still running: stopped by us, not failed
        for i, code in bad:
            if self.labels[i] == "srun":
                self.failures.append(self._srun_failure(code))
            else:
                self.failures.append((self.labels[i], self.transport.describe(code, self.tails[i])))
        # what happened first, most likely: a rank killed by a signal, then a lost node, then any other
        order = sorted(range(len(bad)), key=lambda k: (0 if "killed by" in self.failures[k][1] else
                                                       1 if "ssh ended" in self.failures[k][1] else 2))
        self.failures = [self.failures[k] for k in order]
        self._drain()
        return bad[order[0]][1]

    def _cause_seen(self) -> bool:
        """Whether an agent already ended the way a first cause ends: a rank killed by a signal, or ssh's
        255 (a lost node). A plain error code is often a peer's reaction to another node's failure."""
        for p in self.procs:
            code = p.poll()
            if code is not None and (code == 255 or "killed by" in describe_exit(code)):
                return True
        return False

    def _drain(self, timeout: float = 2.0) -> None:
        """Wait (bounded) until the ended agents' last output is relayed: the launcher's closing line
        must come after it."""
        end = time.monotonic() + timeout
        for relay in self.relays:
            relay.join(max(0.0, end - time.monotonic()))

    def _srun_failure(self, code: int) -> tuple[str, str]:
        """The node srun names in its error line ("srun: error: node2: task 1: Exited with exit code 247")."""
        if self.srun_errors:  # the first task that failed
            host, _, rest = self.srun_errors[0][len("srun: error: "):].partition(": task ")
            what = rest.split(": ", 1)[-1]
            last = what.rsplit(" ", 1)[-1]
            return host, describe_exit(int(last)) if "exit code" in what and last.isdigit() else what
        return "srun", describe_exit(code)

    def stop(self) -> None:
        """Close every agent's stdin (each kills its own process group), wait up to `STOP_WAIT_S` for
        them to end, then SIGKILL the ssh / srun processes themselves (by pid) that are left."""
        for p in self.procs:
            try:
                p.stdin.close()
            except (BrokenPipeError, OSError):
                pass
        end = time.monotonic() + STOP_WAIT_S
        while any(p.poll() is None for p in self.procs) and time.monotonic() < end:
            time.sleep(0.02)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
