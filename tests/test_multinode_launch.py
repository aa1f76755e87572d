"""The multi-node launch's parts with stand-ins, fast and without namespaces (the real two-host runs over
ssh and Slurm: tests/multinode/):

- the node agent (`parallel/node.py`): the ranks' environment, the node index from the spec or from
  SLURMD_NODENAME (srun's rank mapping), and its stop: closing its stdin kills its own process group
  and nothing else, a process with the very same command line lives on; SIGKILL of the agent too
- `NodeRun` (`parallel/nodes.py`) over a local stand-in for ssh: a node whose ranks fail ends the job
  at once, names that node and what happened, and stops the other node's agent
- the pre-flight's judgement of the nodes' answers (`preflight.problems`), each failure naming the
  host, what is wrong and the fix; the probe's own answer on this machine
- the environment carried to every rank, the options a multi-node launch takes
- `Supervisor.stop` returns once its group is gone, not after a wait on the leader's zombie
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import pytest

from video_dit.devices import DeviceError
from video_dit.parallel import nodes, preflight
from video_dit.parallel.supervise import Supervisor, group_alive
from video_dit.train import launcher

ROOT = Path(__file__).resolve().parents[1]

# a stand-in for DeepSpeed's per-node launcher: records its argv and the variables a rank would read,
# starts a "rank" grandchild, and both sleep (or, with --fail CODE, it exits with CODE after a moment)
LAUNCH = r"""
import json, os, subprocess, sys, time
out = sys.argv[1]
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
keys = ("VIDEO_DIT_JOB", "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "HOST_OWN")
json.dump({"argv": sys.argv[2:], "env": {k: os.environ.get(k) for k in keys}, "pids": [os.getpid(), rank.pid]},
          open(out + ".tmp", "w"))
os.replace(out + ".tmp", out)
if "--fail" in sys.argv:
    time.sleep(0.3)
    sys.exit(int(sys.argv[sys.argv.index("--fail") + 1]))
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] not in "ZX"


def spec(tmp: Path, hosts=("node1", "node2"), node=None) -> dict:
    """A job spec whose "DeepSpeed launcher" is the LAUNCH stand-in, writing <tmp>/<node index>.json
    (the index comes from the --node_rank the agent adds)."""
    return {"tag": "job-1234", "hosts": list(hosts), "cwd": str(ROOT), "node": node,
            "env": {"OMP_NUM_THREADS": "3", "HOST_OWN": "carried"},
            "node_env": {h: {"GLOO_SOCKET_IFNAME": f"eth-{h}"} for h in hosts},
            "launch": [sys.executable, "-c", LAUNCH, str(tmp / "launch")],
            "script": ["train.py", "--config", "job.yaml"]}


def start_agent(the_spec: dict, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "video_dit.parallel.node"], cwd=ROOT, stdin=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, start_new_session=True)
    proc.stdin.write(json.dumps(the_spec).encode() + b"\n")
    proc.stdin.flush()
    return proc


def wait_file(path: Path, timeout: float = 30) -> dict:
    end = time.monotonic() + timeout
    while not path.is_file():
        assert time.monotonic() < end, f"{path} never written"
        time.sleep(0.02)
    return json.loads(path.read_text())


def reap_session(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@pytest.mark.parametrize("how", ["stdin closed", "SIGKILL"])
def test_a_node_agent_stops_exactly_its_own_processes(tmp_path, how):
    the_spec = spec(tmp_path, node=1)
    # an unrelated job: the very command line the agent's launcher runs (what a `pkill -f` would match)
    twin = subprocess.Popen([sys.executable, "-c", LAUNCH, str(tmp_path / "twin")], start_new_session=True)
    agent = start_agent(the_spec)
    try:
        mine = wait_file(tmp_path / "launch")
        theirs = wait_file(tmp_path / "twin")
        assert mine["argv"] == ["--node_rank=1", "train.py", "--config", "job.yaml"]
        # the job's variables, the node's own interface, the job's tag
        assert mine["env"] == {"VIDEO_DIT_JOB": "job-1234", "OMP_NUM_THREADS": "3", "GLOO_SOCKET_IFNAME": "eth-node2",
                               "HOST_OWN": "carried"}
        assert all(alive(p) for p in mine["pids"] + theirs["pids"])
        start = time.monotonic()
        if how == "stdin closed":
            agent.stdin.close()  # what the launcher does to stop the job (and what its death does)
            assert agent.wait(timeout=10) == 128 + signal.SIGHUP
        else:
            os.kill(agent.pid, signal.SIGKILL)  # no handler: the agent's watchdog kills the group
            agent.wait(timeout=10)
        end = time.monotonic() + 5
        while any(alive(p) for p in mine["pids"]) and time.monotonic() < end:
            time.sleep(0.02)
        assert not any(alive(p) for p in mine["pids"]), f"still alive after {time.monotonic() - start:.1f} s"
        assert all(alive(p) for p in theirs["pids"])
    finally:
        reap_session(twin)
        reap_session(agent)
        for p in wait_file(tmp_path / "launch")["pids"] + wait_file(tmp_path / "twin")["pids"]:
            if alive(p):
                os.kill(p, signal.SIGKILL)


def test_under_srun_each_node_finds_its_rank_from_its_slurm_node_name(tmp_path):
    """srun hands every node the same spec (`node` None): the node rank is the place of SLURMD_NODENAME in
    the job's host list (the allocation's, in `scontrol show hostnames` order), and DeepSpeed's launcher
    gets it as --node_rank, with that node's own variables."""
    agents = {}
    try:
        for name in ("gpu-b7", "gpu-a3"):  # started in the other order than they are listed
            node_dir = tmp_path / name
            node_dir.mkdir()
            agents[name] = start_agent(spec(node_dir, hosts=("gpu-a3", "gpu-b7")), env={"SLURMD_NODENAME": name})
        seen = {name: wait_file(tmp_path / name / "launch") for name in agents}
        assert seen["gpu-a3"]["argv"][0] == "--node_rank=0" and seen["gpu-b7"]["argv"][0] == "--node_rank=1"
        assert seen["gpu-b7"]["env"]["GLOO_SOCKET_IFNAME"] == "eth-gpu-b7"
        for a in agents.values():
            a.stdin.close()
            a.wait(timeout=10)
    finally:
        for a in agents.values():
            reap_session(a)
    # outside Slurm, with no node named, the agent refuses naming what it looked for
    lost = subprocess.run([sys.executable, "-m", "video_dit.parallel.node"], cwd=ROOT, capture_output=True, text=True,
                          input=json.dumps(spec(tmp_path, hosts=("gpu-a3",))) + "\n", timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "SLURMD_NODENAME": "login1"})
    assert lost.returncode == 1 and "cannot tell which of the job's hosts ['gpu-a3'] this is" in lost.stderr
    argv = nodes.Srun(environ={"SLURM_CPUS_ON_NODE": "16"}).argv(["gpu-a3", "gpu-b7"], "CMD", stdin_all=True)
    assert argv[:6] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=gpu-a3,gpu-b7",
                        "--label"]
    assert {"--kill-on-bad-exit=1", "--cpus-per-task=16", "--input=all"} <= set(argv) and argv[-3:] == ["sh", "-c",
                                                                                                      "CMD"]


class LocalShell(nodes.Ssh):
    """ssh's stand-in: the command runs here, as ssh would run it on the host."""

    def argv(self, host, command):
        return ["sh", "-c", command]


@pytest.mark.parametrize("code, what", [(247, "a rank was killed by SIGKILL (exit 247)"),
                                        (255, "ssh ended with 255: unreachable, or its node agent killed")])
def test_a_failing_node_ends_the_job_and_is_named(tmp_path, code, what):
    """node2's "DeepSpeed launcher" exits 247 (a rank SIGKILLed: sys.exit(-9)), or its "ssh" ends with 255
    (a node lost); node1's runs on until the launcher stops it. The job ends within seconds, node1's
    processes are gone, node2 is named with what happened."""
    specs = []
    for i, host in enumerate(("node1", "node2")):
        (tmp_path / host).mkdir()
        s = spec(tmp_path / host, node=i)
        if host == "node2":
            s["launch"] = [*s["launch"], "--fail", str(code)]
        specs.append(s)
    out = open(tmp_path / "relayed", "wb")
    run = nodes.NodeRun(LocalShell(), ["node1", "node2"], nodes.agent_command(str(ROOT), sys.executable), specs,
                        out=out)
    start = time.monotonic()
    run.start()
    ended = run.wait()
    took = time.monotonic() - start
    node1 = wait_file(tmp_path / "node1" / "launch")
    assert ended == code and len(run.failures) == 1 and run.failures[0][0] == "node2", run.failures
    assert run.failures[0][1].startswith(what)
    assert took < nodes.FAILURE_WINDOW_S, took  # a first cause seen: no wait for node1 to fail too
    assert not any(alive(p) for p in node1["pids"])
    assert all(p.poll() is not None for p in run.procs)


def answer(**changes) -> dict:
    """A node's probe answer that passes, with `changes` merged in."""
    a = {"node": 1, "python": "/c/.venv/bin/python", "python_version": "3.11.7", "video_dit": "/c/video_dit",
         "packages": {"torch": "2.13.0", "deepspeed": "0.19.8"}, "commit": "abc123", "changes": "d1",
         "ext": {"library": "/x/op.so", "built": True, "compiler": "/usr/bin/c++"},
         "marker": {"read": "tok", "wrote": "/t/m.1"},
         "rendezvous": {"addresses": ["10.0.0.1"], "error": None, "source": "10.0.0.2", "iface": "eth0", "local": None,
                        "port_free": None}}
    for k, v in changes.items():
        a[k] = {**a[k], **v} if isinstance(v, dict) and isinstance(a.get(k), dict) else v
    return a


REFERENCE = {"python": "/c/.venv/bin/python", "python_version": "3.11.7",
             "packages": {"torch": "2.13.0", "deepspeed": "0.19.8"}, "commit": "abc123", "changes": "d1",
             "marker_token": "tok"}


def judge(a2: dict | None, errors=None, **kw) -> list[str]:
    first = answer(node=0, rendezvous={"source": "10.0.0.1", "local": True, "port_free": True})
    found = {0: first, **({1: a2} if a2 is not None else {})}
    return preflight.problems(["node1", "node2"], found, REFERENCE, root="/c", master_addr="node1", port=29500,
                              port_given=kw.get("port_given", False), transport_errors=errors or {}, fix_reach="FIX")


@pytest.mark.parametrize("a2, expected", [
    (answer(), None),
    (None, "node2: not reachable (ssh exit 255: ssh: connect to host node2 port 22: Connection refused); FIX"),
    ({"missing": "checkout"}, "node2: no folder /c (this checkout)"),
    ({"missing": "python"}, "node2: no interpreter /c/.venv/bin/python (every node runs the launcher's); create it "
                            "there: ssh node2 'cd /c && bash -c \"source launch/_env.sh && vd_python\"'"),
    (answer(video_dit="/elsewhere/video_dit"),
     "node2: /c/.venv/bin/python imports video_dit from /elsewhere/video_dit, not from this checkout (/c)"),
    (answer(packages={"torch": "2.12.0"}), "node2: other package versions: torch 2.12.0 (here 2.13.0)"),
    (answer(commit="fff999"), "node2: the checkout is at commit fff999 (here abc123)"),
    (answer(changes="other"), "node2: the checkout has other uncommitted changes than here"),
    (answer(ext={"built": False, "compiler": None}), "node2: DeepSpeed's communication op is not built (/x/op.so) and "
                                                     "there is no C++ compiler"),
    (answer(marker={"read": None, "read_error": "No such file or directory"}),
     "node2: the training folder is not the launcher's (a marker written there by the launcher reads No such file"),
    (answer(rendezvous={"addresses": ["127.0.1.1"], "source": "127.0.1.1", "iface": "lo"}),
     "node2: --master_addr node1 resolves to 127.0.1.1 (loopback) here"),
    (answer(rendezvous={"error": "does not resolve (Name or service not known)"}),
     "node2: --master_addr node1 does not resolve (Name or service not known)"),
])
def test_the_preflight_names_the_host_the_problem_and_the_fix(a2, expected):
    errors = {1: "ssh exit 255: ssh: connect to host node2 port 22: Connection refused"} if a2 is None else {}
    found = judge(a2, errors)
    if expected is None:
        assert found == []
    else:
        assert len(found) == 1 and found[0].startswith(expected), found


def test_the_first_host_must_hold_the_rendezvous_address():
    first = answer(node=0, rendezvous={"source": "10.0.0.1", "local": False, "port_free": True})
    found = preflight.problems(["node1"], {0: first}, REFERENCE, root="/c", master_addr="login", port=29500,
                               port_given=False, transport_errors={}, fix_reach="")
    assert found == ["node1: --master_addr login (10.0.0.1) is not an address of node1, the first host, where rank 0 "
                     "runs the rendezvous store; give the first host's address"]
    busy = answer(node=0, rendezvous={"source": "10.0.0.1", "local": True, "port_free": False})
    found = preflight.problems(["node1"], {0: busy}, REFERENCE, root="/c", master_addr="node1", port=29501,
                               port_given=True, transport_errors={}, fix_reach="")
    assert found == ["node1: --master_port 29501 is in use here; pass another port, or leave it out to get a free one"]


def test_the_probe_answers_about_this_machine(tmp_path):
    """The probe's real answer here, through its own command line (what each node runs), on 127.0.0.1:
    this checkout's interpreter and packages, the marker read and written, loopback flagged."""
    (tmp_path / ".m").write_text("tok")
    the_spec = {"root": str(ROOT), "hosts": ["here"], "node": 0, "master_addr": "127.0.0.1", "master_port": 29500,
                "ext": {"dir": str(tmp_path / "ext"), "build_folder": "unused", "op": "some_op"},
                "marker": {"dir": str(tmp_path), "name": ".m"}}
    done = subprocess.run(["sh", "-c", preflight.remote_command(str(ROOT), sys.executable, the_spec)], cwd="/",
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    a = preflight.parse_answers(done.stdout, ["here"], node=0)[0]
    assert a["python"] == sys.executable and a["video_dit"] == str(ROOT / "video_dit")
    assert a["packages"] == preflight.software(str(ROOT))["packages"] and a["packages"]["torch"] is not None
    assert a["marker"]["read"] == "tok" and (tmp_path / ".m.0").is_file()
    assert a["ext"]["library"] == str(tmp_path / "ext" / "some_op" / "some_op.so") and not a["ext"]["built"]
    r = a["rendezvous"]
    assert r["addresses"] == ["127.0.0.1"] and r["iface"] == "lo" and r["local"] is True
    assert preflight.rendezvous_problems(r, "127.0.0.1", 29500, False, True, "here")[0].startswith(
        "--master_addr 127.0.0.1 resolves to 127.0.0.1 (loopback)")
    # a missing interpreter is answered by the shell, before any Python
    done = subprocess.run(["sh", "-c", preflight.remote_command(str(ROOT), "/nowhere/python", the_spec)],
                          capture_output=True, text=True, timeout=60)
    assert preflight.parse_answers(done.stdout, ["here"], node=0) == {0: {"missing": "python"}}
    # srun labels its tasks' lines and each answer names its node
    text = f"1: {preflight.MISSING} python gpu-b7\n0: {preflight.TAG} {json.dumps({'node': 0, 'x': 1})}\n"
    assert preflight.parse_answers(text, ["gpu-a3", "gpu-b7"]) == {0: {"node": 0, "x": 1}, 1: {"missing": "python"}}


def test_every_rank_gets_the_same_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no .deepspeed_env of this machine's user
    (tmp_path / ".deepspeed_env").write_text("MY_JOB_FLAG=on\n# a comment\n")
    environ = {"OMP_NUM_THREADS": "8", "TORCH_EXTENSIONS_DIR": "/c/.venv/torch_extensions", "NCCL_DEBUG": "INFO",
               "VIDEO_DIT_FAULT": "x", "CUDA_VISIBLE_DEVICES": "0,1", "VIDEO_DIT_JOB": "old", "HOME": "/root",
               "PATH": "/usr/bin", "PYTHONPATH": "/c"}
    env = nodes.carried_env(environ, {"OMP_NUM_THREADS": "2"}, tmp_path)
    assert env == {"OMP_NUM_THREADS": "2", "TORCH_EXTENSIONS_DIR": "/c/.venv/torch_extensions", "NCCL_DEBUG": "INFO",
                   "VIDEO_DIT_FAULT": "x", "PYTHONPATH": "/c", "MY_JOB_FLAG": "on", "PYTHONUNBUFFERED": "1"}


def test_the_options_of_a_multinode_launch():
    assert launcher.node_options(["--hostfile", "h", "--master_addr=node1", "--enable_each_rank_log", "logs",
                                  "--bind_cores_to_rank", "--ssh_port", "2222"]) == [
        "--enable_each_rank_log=logs", "--bind_cores_to_rank"]
    with pytest.raises(DeviceError, match="--launcher openmpi: the nodes are started over ssh"):
        launcher.node_options(["--hostfile", "h", "--launcher", "openmpi"])
    with pytest.raises(DeviceError, match="--module: not an option of a multi-node launch"):
        launcher.node_options(["--hostfile", "h", "--module"])
    hosts = nodes.Hosts(OrderedDict([("node1", [0, 1]), ("node2", [0])]), "test")
    assert (hosts.ranks, hosts.ranks_per_node, hosts.names) == (3, 2, ["node1", "node2"])


def test_the_hostfile_rules_are_deepspeeds(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text("node1 slots=2\nnode2 slots=2\nnode3 slots=2\n")
    hosts = nodes.job_hosts(["--hostfile", str(path), "--exclude", "node2", "--num_gpus", "1"], local_slots=2)
    assert hosts.slots == OrderedDict([("node1", [0]), ("node3", [0])])
    with pytest.raises(DeviceError, match="--launcher slurm runs inside a Slurm allocation"):
        nodes.slurm_nodes(environ={})


def test_supervisor_stop_returns_once_the_group_is_gone():
    """The leader is this process's child: until reaped it is a zombie member of its group, which
    `os.killpg(pgid, 0)` still finds (the launcher once waited its full grace period on it)."""
    sup = Supervisor([sys.executable, "-c", "import subprocess, sys, time; "
                      "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"])
    sup.start()
    time.sleep(0.5)
    start = time.monotonic()
    sup.stop()
    assert time.monotonic() - start < 2.0 and not group_alive(sup.proc.pid)
    sup.wait()


def test_plan_with_a_hostfile_takes_its_ranks_from_it(tmp_path):
    from video_dit.commands import plan

    parser = __import__("argparse").ArgumentParser()
    plan.add_arguments(parser)
    args = parser.parse_args(["job.yaml", "--hostfile", "h", "--master_addr", "node1", "--num_gpus", "4"])
    assert plan.node_args(args) == ["--hostfile", "h", "--master_addr", "node1", "--num_gpus", "4"]
    assert plan.node_args(parser.parse_args(["job.yaml"])) == []
    with pytest.raises(plan.PlanError, match="--hostfile / --launcher slurm place the ranks"):
        plan.node_args(parser.parse_args(["job.yaml", "--hostfile", "h", "--gpus", "8"]))
