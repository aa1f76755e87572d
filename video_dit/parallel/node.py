"""One node's share of a multi-node job: `python -m video_dit.parallel.node`, started on every node by
the launcher (`train/launcher.py`) over ssh, or by `srun` on a Slurm allocation (`parallel/nodes.py`).

    launcher --ssh host / srun--> node agent (this, stdin: the job's spec, one JSON line)
                                    └─ own process group ─ deepspeed.launcher.launch --node_rank=i ─ ranks

1. The spec names the job's hosts in rank order, the environment every rank gets (`env`) and each
   node's own additions (`node_env`: its network interface), and DeepSpeed's per-node launcher
   command (`launch` + `script`); this node's index is `node` (ssh), else its Slurm node name's place
   in `hosts` (`SLURMD_NODENAME`, the name `scontrol show hostnames` lists; srun gives every task the
   same spec).
2. DeepSpeed's launcher (`deepspeed.launcher.launch --node_rank=i`) runs in a process group of its
   own with that environment, the job's tag in VIDEO_DIT_JOB (`Supervisor`).
3. The agent then reads its stdin until end of file. The launcher holds the other end (through ssh or
   srun) and closes it to stop the job; it also closes when the launcher, ssh or srun dies, however
   it dies. At end of file, or a signal (srun forwards its own), the agent kills its group, and only
   it: no command-line pattern, so another job on this node, even one started from the same
   checkout with the same command, is never touched.
4. The agent exits with DeepSpeed's launcher's code (a rank's failure ends it: it stops its node's
   other ranks), or 128 + the signal that stopped it.

Standard library only: nothing heavy is imported before the ranks start.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

from video_dit.parallel.supervise import Supervisor

STOPPED_BY_LAUNCHER = 128 + signal.SIGHUP  # exit code when the launcher's end of stdin closed


def node_index(spec: dict, environ=os.environ) -> int:
    """This node's place in the job's host list: the spec's `node` (one spec per node, ssh), else the
    Slurm node name's (`SLURMD_NODENAME`; srun sends every node the same spec)."""
    if spec.get("node") is not None:
        return int(spec["node"])
    name = environ.get("SLURMD_NODENAME")
    if name in spec["hosts"]:
        return spec["hosts"].index(name)
    raise SystemExit(f"[video_dit] node agent: cannot tell which of the job's hosts {spec['hosts']} this is "
                     f"(SLURMD_NODENAME={name!r}; started neither by the launcher's ssh nor by srun)")


def command(spec: dict, index: int) -> list[str]:
    """DeepSpeed's per-node launcher for node `index`: its options, `--node_rank`, the training script."""
    return [*spec["launch"], f"--node_rank={index}", *spec["script"]]


def environment(spec: dict, index: int, environ=os.environ) -> dict:
    """The ranks' environment on node `index`: this node's, the job's carried variables over it, then
    the node's own additions (its network interface), and the job's tag."""
    host = spec["hosts"][index]
    return {**environ, **spec["env"], **spec.get("node_env", {}).get(host, {}), "VIDEO_DIT_JOB": spec["tag"]}


def main() -> int:
    line = sys.stdin.buffer.readline()
    if not line.strip():
        print("[video_dit] node agent: no job spec on stdin (it is started by ./launch/train.sh)", file=sys.stderr)
        return 2
    spec = json.loads(line)
    index = node_index(spec)
    sup = Supervisor(command(spec, index), env=environment(spec, index), cwd=spec["cwd"],
                     stdin=open(os.devnull, "rb"))  # the ranks never hold the launcher's pipe
    sup.start()
    closed = threading.Event()

    def watch_stdin():
        sys.stdin.buffer.read()  # until end of file: the launcher closed its end, or is gone
        closed.set()
        sup.stop()

    threading.Thread(target=watch_stdin, daemon=True).start()
    code = sup.wait()
    if closed.is_set() and sup.signal is None and code != 0:
        return STOPPED_BY_LAUNCHER
    return code if code >= 0 else 128 - code  # DeepSpeed's launcher itself killed by a signal: 128 + it


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # not sys.exit: finalization aborted on the stdin watcher thread still blocked in read
