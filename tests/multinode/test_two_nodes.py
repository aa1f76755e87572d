"""Two nodes as a user meets them: `./launch/train.sh CONFIG --hostfile H --master_addr node1` over ssh
and `sbatch launch/slurm.sh CONFIG` under a real Slurm, on the two namespace hosts of cluster.py (own
addresses, host names, /etc/hosts and sshd; one file system).

One module fixture (`runs`) serves every test:
  reference  the job (tiny LoRA, ZeRO-2, 6 steps, checkpoints at 2, 4, 6) on one host with two ranks
             (tests/ranks.py, no launcher), 1 thread per rank; beside it, three launches the pre-flight
             refuses: node1's own name on 127.0.1.1 with --master_addr node1 (train.sh, and `video-dit
             plan --hostfile`), and node2 without the launcher's .venv (an sshd that has it hidden)
  A  ssh, 1 rank per node; VIDEO_DIT_FAULT=kill_rank1_at_step:3 in the launcher's environment: rank 1,
     on node2, SIGKILLs itself in step 3 (it can only if the variable was carried to node2)
  B  the same command: resumes from step 2; VIDEO_DIT_FAULT=stall_rank1_at_step:5 keeps rank 1 alive
     but stuck in step 5; once checkpoint 4 exists, the ranks' environments are read on both nodes
     and SIGTERM goes to the launcher's pid
  C  `sbatch launch/slurm.sh` (srun, ranks placed from SLURM_*): resumes from 4 and ends at 6 (over ssh
     where Slurm is not installed or cannot run: then the Slurm test is skipped with the reason)
All along node2's own name is on 127.0.1.1 in its /etc/hosts (Debian's default, which made gloo
advertise loopback) and an unrelated DeepSpeed job runs on node2 from the same interpreter, with the
command line DeepSpeed's pdsh runner stops remote ranks by (`pkill -f "<python> -u -m
deepspeed.launcher.launch"`).
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

import cluster as cl
import helpers
import ranks

pytestmark = [pytest.mark.multinode, pytest.mark.multirank]
ROOT = cl.ROOT
STEPS = 6
ENDED_S = 60  # checkpoint 2 (rank 1 dies in the step after it) to the launcher's exit
STOPPED_S = 10  # SIGTERM to the launcher's exit (every rank of both nodes gone by then)
REFUSED_S = 20  # a launch to its pre-flight's exit 2 (measured 3-4 s on 2 busy cores)
CARRIED = ("OMP_NUM_THREADS", "TORCH_EXTENSIONS_DIR", "PYTHONPATH", "VIDEO_DIT_FAULT", "VIDEO_DIT_JOB")


def job(root: Path, name: str) -> Path:
    # memory_check off: the plan (tested elsewhere) imports peft in the launcher, ~3 s per launch
    return helpers.write_job(root, name, steps=STEPS, save_every=2, keep=5, lr=1e-2, timeout_s=60,
                             save={"resume": "auto"}, deepspeed={"memory_check": "off"})


def pdsh_kill_pattern(python: str) -> str:
    """The pattern DeepSpeed's pdsh runner hands `pkill -f` on every node when it stops a job
    (deepspeed/launcher/multinode_runner.py, PDSHRunner.get_cmd: the launch command's first four words,
    each followed by a backslash, joined by spaces, the last two characters cut), as a Python regex."""
    words = [python, "-u", "-m", "deepspeed.launcher.launch"]
    shell = " ".join(w + "\\" for w in words)[:-2]
    return re.escape(shell.replace("\\ ", " "))


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def environ(pid: int) -> dict:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)


def latest(out: Path) -> int:
    try:
        return int((out / "checkpoints" / "latest").read_text().strip().split("_")[1])
    except (OSError, IndexError, ValueError):
        return 0


def wait_until(condition, proc, log: Path, timeout: float = 240):
    end = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the launch ended early (rc {proc.returncode}):\n{log.read_text()[-4000:]}"
        assert time.monotonic() < end, log.read_text()[-4000:]
        time.sleep(0.05)


def job_tag(log: Path) -> str | None:
    found = re.search(r"\[video_dit\] job (\S+): ", log.read_text())
    return found.group(1) if found else None


def launch(cluster, cfg: Path, log: Path, *, fault: str | None = None, ssh_config: Path | None = None,
           plan: bool = False):
    """The user's command on node1: ./launch/train.sh CONFIG --hostfile H --master_addr node1 (`plan`:
    `video-dit plan CONFIG` with the same options, through the interpreter train.sh runs)."""
    hostfile = cluster.tmp / "hostfile"
    hostfile.write_text("node1 slots=1\nnode2 slots=1\n")
    env = ranks.rank_env(**({"VIDEO_DIT_FAULT": fault} if fault else {}))
    env["VIDEO_DIT_SSH_ARGS"] = f"-F {ssh_config or cluster.ssh_config}"
    command = [cluster.python, "-m", "video_dit.cli", "plan"] if plan else ["bash", str(ROOT / "launch/train.sh")]
    return cluster.run_in("node1", [*command, str(cfg), "--hostfile", str(hostfile), "--master_addr", "node1"],
                          env=env, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def finish(proc, log: Path, timeout: float) -> tuple[int, float]:
    start = time.monotonic()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"no exit within {timeout} s:\n{log.read_text()[-4000:]}")
    return proc.returncode, time.monotonic() - start


def sbatch(cluster, env: dict, argv: list[str], log: Path, timeout: float = 300) -> tuple[int, str]:
    """`sbatch --nodes=2 ARGV` from node1, waited for (`scontrol` polled: `sbatch --wait` notices the end
    up to 10 s late); (the job's exit code, what sbatch and scontrol said)."""
    def slurm(*args):
        return subprocess.run([cl.tool("ip"), "netns", "exec", cluster.ns["node1"], *args], capture_output=True,
                              text=True, env=env, cwd=ROOT)

    sent = slurm(cl.tool("sbatch"), "--parsable", "--nodes=2", f"--output={log}", *argv)
    assert sent.returncode == 0, sent.stderr
    job_id = sent.stdout.strip().split(";")[0]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        shown = slurm(cl.tool("scontrol"), "show", "job", job_id, "-o").stdout
        state = re.search(r"JobState=(\S+)", shown)
        if state and state.group(1) not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            code = re.search(r"ExitCode=(\d+):(\d+)", shown)
            return int(code.group(1)), shown
        time.sleep(0.1)
    slurm(cl.tool("scancel"), job_id)
    pytest.fail(f"Slurm job {job_id} did not end within {timeout} s:\n{log.read_text()[-4000:]}")


@pytest.fixture(scope="module")
def runs(cluster, launcher_python, tmp_path_factory):
    root = tmp_path_factory.mktemp("two_nodes")
    helpers.make_world(root, count=6)
    cfg, ref_cfg = job(root, "two"), job(root, "one")
    out = root / "out" / "two"
    times, logs = {}, {name: root / f"{name}.log" for name in ("A", "B", "C", "loopback", "plan", "no_venv", "other")}
    cluster.write_hosts("node2", loopback_name=True)
    slurm_why = cl.slurm_unavailable()
    if slurm_why is None:
        try:
            cluster.slurm_start()  # its daemons come up while the reference runs
        except (OSError, subprocess.SubprocessError) as exc:
            slurm_why = f"Slurm's daemons could not be started here: {exc}"

    t = time.monotonic()  # the reference: one host, two ranks, the same threads per rank (in the background)
    reference, prefix = ranks.start_jobs(root, [{"config": str(ref_cfg), "resume": "none", "run": True}], 2)
    try:
        return _launches(cluster, launcher_python, root, cfg, out, times, logs, slurm_why, reference, prefix, t)
    finally:
        for proc, _ in reference:  # our own children, outside the namespaces: by pid
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _launches(cluster, launcher_python, root, cfg, out, times, logs, slurm_why, reference, prefix, t):
    """The rest of `runs` (module docstring), the reference already running."""
    refused = {}  # meanwhile, the launches the pre-flight refuses (no rank starts)
    cluster.write_hosts("node1", loopback_name=True)
    try:
        start = time.monotonic()
        p = launch(cluster, cfg, logs["loopback"])
        refused["loopback"] = (finish(p, logs["loopback"], 120)[0], time.monotonic() - start)
        start = time.monotonic()  # `video-dit plan` runs the same pre-flight before its plan
        p = launch(cluster, cfg, logs["plan"], plan=True)
        refused["plan"] = (finish(p, logs["plan"], 120)[0], time.monotonic() - start)
    finally:
        cluster.write_hosts("node1")
    if cl.venv_of(launcher_python) is not None:
        start = time.monotonic()
        p = launch(cluster, cfg, logs["no_venv"], ssh_config=cluster.ssh_config_no_venv)
        refused["no_venv"] = (finish(p, logs["no_venv"], 120)[0], time.monotonic() - start)
    times.update({f"pre-flight refusal: {k}": v[1] for k, v in refused.items()})
    codes, ref_logs = ranks.finish(reference, prefix, timeout=600)
    assert codes == [0, 0], ref_logs[-4000:]
    times["reference, one host, 2 ranks (with the refusals beside it)"] = time.monotonic() - t

    # the unrelated job on node2: DeepSpeed's launcher from the same interpreter, with a sleeping "rank"
    sleeper = root / "sleeper.py"
    sleeper.write_text("import time\ntime.sleep(3600)\n")
    info = base64.urlsafe_b64encode(json.dumps({"localhost": [0]}).encode()).decode()
    other = cluster.run_in("node2", [launcher_python, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={info}",
                                     "--master_addr=127.0.0.1", "--master_port=29999", str(sleeper)],
                           env=ranks.rank_env(), cwd=root, stdout=open(logs["other"], "w"), stderr=subprocess.STDOUT)

    t = time.monotonic()  # A: rank 1 (node2) kills itself in step 3
    a = launch(cluster, cfg, logs["A"], fault="kill_rank1_at_step:3")
    wait_until(lambda: latest(out) >= 2, a, logs["A"])  # rank 1 dies in the next step
    rc_a, a_end_s = finish(a, logs["A"], 300)
    times["A: start to the end after rank 1's SIGKILL"] = time.monotonic() - t
    times["A: checkpoint 2 (rank 1 dies in the next step) to the launcher's exit"] = a_end_s
    tag_a = job_tag(logs["A"])
    left_a = cluster.job_processes(tag_a) if tag_a else ["no job tag in the log"]

    t = time.monotonic()  # B: resumes; rank 1 stuck in step 5; SIGTERM once checkpoint 4 exists
    b = launch(cluster, cfg, logs["B"], fault="stall_rank1_at_step:5")
    wait_until(lambda: latest(out) >= 4 and job_tag(logs["B"]), b, logs["B"])
    tag_b = job_tag(logs["B"])
    rank_env = {}
    end = time.monotonic() + 30
    while len(rank_env) < 2 and time.monotonic() < end:  # one rank per node, read while they run
        for host in ("node1", "node2"):
            for pid in cluster.job_processes(tag_b, host):
                if "launch/train.py" in cmdline(pid):
                    rank_env[host] = {k: environ(pid).get(k) for k in CARRIED + ("GLOO_SOCKET_IFNAME",)}
        time.sleep(0.05)
    times["B: start to checkpoint 4"] = time.monotonic() - t
    sent = time.monotonic()
    os.kill(b.pid, signal.SIGTERM)  # the launcher's pid (ip netns exec and train.sh exec into it)
    rc_b, _ = finish(b, logs["B"], 60)
    b_stop_s = time.monotonic() - sent
    left_b = cluster.job_processes(tag_b)
    times["B: SIGTERM to the launcher's exit"] = b_stop_s

    t = time.monotonic()  # C: to the end, under Slurm where it runs
    if slurm_why is None:
        try:
            env = {**ranks.rank_env(), **cluster.slurm_wait()}
        except RuntimeError as exc:  # installed, but its daemons cannot run here: said by the Slurm test
            slurm_why = f"Slurm's daemons did not come up here: {str(exc)[-1500:]}"
    if slurm_why is None:
        rc_c, c_out = sbatch(cluster, env, [str(ROOT / "launch/slurm.sh"), str(cfg), "--num_gpus", "1"], logs["C"])
    else:
        c = launch(cluster, cfg, logs["C"])
        rc_c, _ = finish(c, logs["C"], 300)
        c_out = ""
    times["C: relaunch to the end"] = time.monotonic() - t

    other_alive = other.poll() is None and not cl.zombie(other.pid)
    other_cmd = cmdline(other.pid) if other_alive else ""
    print("\n[multinode] " + "; ".join(f"{k} {v:.1f} s" for k, v in times.items()))
    return {"out": out, "ref": root / "out" / "one", "logs": {k: v.read_text() if v.is_file() else "" for k, v in
                                                             logs.items()},
            "rc": {"A": rc_a, "B": rc_b, "C": rc_c}, "left": {"A": left_a, "B": left_b}, "a_end_s": a_end_s,
            "b_stop_s": b_stop_s, "rank_env": rank_env, "refused": refused, "other_alive": other_alive,
            "other_cmd": other_cmd, "slurm_why": slurm_why, "c_out": c_out, "tag_b": tag_b, "times": times,
            "python": launcher_python}


def test_two_nodes_give_the_losses_of_one_host(runs):
    """Steps 1-6 over the three launches (two ends, two resumes) equal the one-host run bit for bit."""
    assert runs["rc"]["C"] == 0, runs["logs"]["C"][-4000:] + runs["c_out"]
    two, one = helpers.losses(runs["out"]), helpers.losses(runs["ref"])
    assert sorted(one) == list(range(1, STEPS + 1)) and sorted(two) == sorted(one), (two, one)
    assert two == one, {s: (two[s], one[s]) for s in one if two[s] != one[s]}


def test_every_rank_gets_the_jobs_environment(runs, cluster):
    """The carried variables reach node2's rank as node1's (threads, extensions folder, the job's own,
    its tag); each node's gloo interface is its own veth, not the loopback its host name maps to."""
    env = runs["rank_env"]
    assert set(env) == {"node1", "node2"}, env
    for key in CARRIED:
        assert env["node1"][key] == env["node2"][key] is not None, (key, env)
    assert env["node1"]["OMP_NUM_THREADS"] == "1" and env["node2"]["VIDEO_DIT_FAULT"] == "stall_rank1_at_step:5"
    assert env["node2"]["VIDEO_DIT_JOB"] == runs["tag_b"]
    assert (env["node1"]["GLOO_SOCKET_IFNAME"], env["node2"]["GLOO_SOCKET_IFNAME"]) == (f"{cluster.prefix}x",
                                                                                         f"{cluster.prefix}y")


def test_a_remote_ranks_death_ends_the_job_with_the_summary_line(runs):
    a = runs["logs"]["A"]
    assert runs["rc"]["A"] == 256 - signal.SIGKILL, a[-4000:]  # DeepSpeed's launcher: sys.exit(-9)
    assert runs["a_end_s"] < ENDED_S
    assert runs["left"]["A"] == [], runs["left"]["A"]
    line = re.search(r"\[video_dit\] ended \(node2: a rank was killed by SIGKILL \(exit 247\)[^\n]*\) after step "
                     r"\d of 6; last checkpoint \S*step_000000002 \(step 2\); relaunch the same command to resume "
                     r"from it", a)
    assert line, a[-4000:]


def test_sigterm_stops_both_nodes_and_only_this_job(runs):
    b = runs["logs"]["B"]
    assert re.search(r"resumed from \S*step_000000002 at step 2\b", b), b[-4000:]
    assert runs["rc"]["B"] == 128 + signal.SIGTERM and runs["b_stop_s"] < STOPPED_S, (runs["b_stop_s"], b[-3000:])
    assert runs["left"]["B"] == [], runs["left"]["B"]  # nothing of the job on either node once it returned
    assert b.rstrip().endswith("[video_dit] interrupted (SIGTERM) after step 4 of 6; last checkpoint "
                               f"{runs['out']}/checkpoints/step_000000004 (step 4); relaunch the same command to "
                               "resume from it"), b[-2000:]
    # the unrelated job on node2 lives on, and DeepSpeed's pdsh runner would have killed it: its
    # command line matches the pattern that runner gives `pkill -f` on every node
    assert runs["other_alive"]
    assert re.search(pdsh_kill_pattern(runs["python"]), runs["other_cmd"]), runs["other_cmd"]


def test_under_slurm_the_job_resumes_and_ends(runs):
    if runs["slurm_why"]:
        pytest.skip(f"no Slurm here: {runs['slurm_why']}")
    c = runs["logs"]["C"]
    assert runs["rc"]["C"] == 0, c[-4000:] + runs["c_out"]
    assert "from the Slurm allocation) over srun" in c and re.search(r"resumed from \S*step_000000004 at step 4", c)
    assert latest(runs["out"]) == STEPS


@pytest.mark.parametrize("case", ["loopback", "plan", "no_venv"])
def test_the_preflight_refuses_in_seconds(runs, case, cluster):
    if case not in runs["refused"]:
        pytest.skip(f"{runs['python']} is not in a virtual environment: nothing to hide from node2")
    log = runs["logs"][case]
    rc, seconds = runs["refused"][case]
    assert rc == 2 and seconds < REFUSED_S, (rc, seconds, log[-3000:])
    assert "[video_dit] pre-flight failed, no rank started:" in log and "[video_dit] job " not in log
    assert "memory plan" not in log
    if case in ("loopback", "plan"):  # plan: `video-dit plan --hostfile` refuses as train.sh does
        assert re.search(r"node1: --master_addr node1 resolves to 127\.0\.1\.1 \(loopback\) here.*give --master_addr "
                         r"as node1's address", log), log
    else:
        problems = log.split("no rank started:")[1]
        assert f"node2: no interpreter {runs['python']}" in problems and "node1:" not in problems, log
