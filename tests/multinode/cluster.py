"""Two hosts on one machine, for the multi-node tests: two Linux network namespaces joined by a veth pair
(addresses in 10.213.N.0/24 that exist only inside them), each with its own host name (a UTS namespace
per daemon), its own /etc/hosts (`ip netns exec` binds /etc/netns/<ns>/hosts over it) and an sshd;
the file system is the machine's, so the checkout, its .venv and the training folder are at the same
paths on both, as on a cluster with a shared folder. Optionally a real Slurm: one munged, slurmctld on
node1 and one slurmd per host.

    node1 (ns <p>a, 10.213.N.1)  ── veth ──  node2 (ns <p>b, 10.213.N.2)
      sshd :22                                  sshd :22
      slurmctld, slurmd node1                   slurmd node2
                                                sshd :2222 with the launcher's .venv hidden (a tmpfs
                                                over it, in that sshd's own mount namespace)

Nothing leaves the namespaces: both veth ends are created inside them, no route or address is added
outside. Every daemon is a child of this process; `close()` kills, by process id, every process whose
network namespace is one of ours (the daemons, whatever the tests started over ssh or srun) and the
processes this harness started, then deletes the namespaces and the files it wrote under /etc/netns.
Names carry this process's id (`vdmn<pid>`), so concurrent runs on one machine do not meet.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("ip", "unshare", "sshd", "ssh", "ssh-keygen")
SLURM_TOOLS = ("slurmctld", "slurmd", "srun", "sbatch", "scontrol", "scancel", "sinfo", "munged")


def tool(name: str) -> str | None:
    return shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)),
                                      None)


def unavailable() -> str | None:
    """Why this machine cannot host the two namespaces (None when it can)."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    missing = [t for t in TOOLS if tool(t) is None]
    if missing:
        return f"missing {', '.join(missing)} (.ci/run installs openssh-server)"
    probe = f"vdmnprobe{os.getpid()}"
    made = subprocess.run([tool("ip"), "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed here: {made.stderr.strip()}"
    subprocess.run([tool("ip"), "netns", "del", probe], capture_output=True)
    return None


def slurm_unavailable() -> str | None:
    missing = [t for t in SLURM_TOOLS if tool(t) is None]
    return f"missing {', '.join(missing)} (.ci/run installs slurmctld, slurmd, slurm-client and munge)" if missing \
        else None


def venv_of(python: str) -> Path | None:
    """The virtual environment folder of `python` (the folder holding pyvenv.cfg), or None."""
    folder = Path(python).parent.parent
    return folder if (folder / "pyvenv.cfg").is_file() else None


class Cluster:
    """The two hosts (module docstring). `hosts` node1, node2; `run_in(host, argv)` starts a command on
    that host as a child of this process; `ssh_config` / `ssh_config_no_venv` for $VIDEO_DIT_SSH_ARGS."""

    def __init__(self, tmp: Path, python: str):
        self.tmp, self.python = Path(tmp), python
        self.prefix = f"vdmn{os.getpid() % 100000:05d}"
        self.ns = {"node1": f"{self.prefix}a", "node2": f"{self.prefix}b"}
        self.net = f"10.213.{os.getpid() % 250 + 1}"
        self.addr = {"node1": f"{self.net}.1", "node2": f"{self.net}.2"}
        self.children: list[subprocess.Popen] = []
        self.made_ns: list[str] = []
        self.etc_dirs: list[Path] = []
        self.slurm_conf: Path | None = None

    # ---------------------------------------------------------------- set-up

    def up(self) -> "Cluster":
        ip = tool("ip")
        for ns in self.ns.values():
            sh(ip, "netns", "add", ns)
            self.made_ns.append(ns)
        a, b = self.ns["node1"], self.ns["node2"]
        sh(ip, "link", "add", f"{self.prefix}x", "netns", a, "type", "veth", "peer", "name", f"{self.prefix}y",
           "netns", b)
        for host, ns, dev in (("node1", a, f"{self.prefix}x"), ("node2", b, f"{self.prefix}y")):
            sh(ip, "-n", ns, "addr", "add", f"{self.addr[host]}/24", "dev", dev)
            sh(ip, "-n", ns, "link", "set", dev, "up")
            sh(ip, "-n", ns, "link", "set", "lo", "up")
            folder = Path("/etc/netns") / ns
            folder.mkdir(parents=True)
            self.etc_dirs.append(folder)
            self.write_hosts(host)
        self._ssh_keys()
        for host in self.ns:
            self.daemon(host, [tool("sshd"), "-D", "-e", "-f", str(self.tmp / "sshd_config")], "sshd")
        venv = venv_of(self.python)
        if venv is not None:  # node2's second sshd: the launcher's .venv hidden under a tmpfs
            self.daemon("node2", [tool("sshd"), "-D", "-e", "-p", "2222", "-f", str(self.tmp / "sshd_config")],
                        "sshd_no_venv", before=f"mount -t tmpfs none {venv}")
        self.wait_ssh()
        return self

    def write_hosts(self, host: str, loopback_name: bool = False) -> None:
        """`host`'s /etc/hosts; `loopback_name`: its own name on 127.0.1.1 first (Debian's default). Written
        in place: the file an `ip netns exec` bound over /etc/hosts stays the same inode."""
        lines = ["127.0.0.1 localhost"]
        if loopback_name:
            lines.append(f"127.0.1.1 {host}")
        lines += [f"{self.addr[h]} {h}" for h in self.ns]
        with open(Path("/etc/netns") / self.ns[host] / "hosts", "w") as f:
            f.write("\n".join(lines) + "\n")

    def _ssh_keys(self) -> None:
        t = self.tmp
        sh(tool("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-f", str(t / "host_key"))
        sh(tool("ssh-keygen"), "-q", "-t", "ed25519", "-N", "", "-f", str(t / "id"))
        shutil.copy(t / "id.pub", t / "authorized_keys")
        (t / "sshd_config").write_text(textwrap.dedent(f"""\
            HostKey {t / 'host_key'}
            AuthorizedKeysFile {t / 'authorized_keys'}
            PidFile none
            UsePAM no
            StrictModes no
            PermitRootLogin prohibit-password
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            """))
        common = textwrap.dedent(f"""\
            Host *
              IdentityFile {t / 'id'}
              UserKnownHostsFile /dev/null
              StrictHostKeyChecking no
              LogLevel ERROR
            """)
        (t / "ssh_config").write_text(common)
        (t / "ssh_config_no_venv").write_text("Host node2\n  Port 2222\n" + common)

    @property
    def ssh_config(self) -> Path:
        return self.tmp / "ssh_config"

    @property
    def ssh_config_no_venv(self) -> Path:
        return self.tmp / "ssh_config_no_venv"

    def daemon(self, host: str, argv: list[str], name: str, before: str = "") -> subprocess.Popen:
        """`argv` on `host` as a child of this process, with the host's name (its own UTS namespace) and
        a private mount namespace holding a fresh /run (sshd's privilege-separation folder /run/sshd is
        made there, not on this machine), after the shell command `before`."""
        script = (f"hostname {host} && mount -t tmpfs -o mode=755 none /run && mkdir /run/sshd"
                  + (f" && {before}" if before else "") + ' && exec "$@"')
        log = open(self.tmp / f"{name}_{host}.log", "w")
        proc = subprocess.Popen([tool("ip"), "netns", "exec", self.ns[host], tool("unshare"), "--uts", "--mount",
                                 "--propagation", "private", "sh", "-c", script, name, *argv],
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.children.append(proc)
        return proc

    def run_in(self, host: str, argv: list[str], **kw) -> subprocess.Popen:
        """`argv` on `host` (its network namespace and /etc/hosts), a child of this process in a session of
        its own."""
        proc = subprocess.Popen([tool("ip"), "netns", "exec", self.ns[host], *argv], start_new_session=True, **kw)
        self.children.append(proc)
        return proc

    def wait_ssh(self, timeout: float = 30) -> None:
        end = time.monotonic() + timeout
        for host in self.ns:
            while True:
                done = subprocess.run([tool("ip"), "netns", "exec", self.ns["node1"], "ssh", "-F", str(self.ssh_config),
                                       "-o", "BatchMode=yes", host, "true"], capture_output=True, text=True)
                if done.returncode == 0:
                    break
                if time.monotonic() > end:
                    logs = "\n".join(p.read_text() for p in self.tmp.glob("sshd*.log"))
                    raise RuntimeError(f"sshd on {host} not reachable: {done.stderr}\n{logs}")
                time.sleep(0.1)

    # ---------------------------------------------------------------- Slurm

    def slurm_start(self) -> None:
        """munged (on this machine, its socket in our folder), slurmctld on node1 and a slurmd per host,
        started (`slurm_wait` waits for the nodes)."""
        t = self.tmp / "slurm"
        (t / "munge").mkdir(parents=True)
        os.chmod(t / "munge", 0o700)
        key = t / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        sock = t / "munge" / "socket"
        munged = subprocess.Popen([tool("munged"), "-F", "-f", f"--socket={sock}", f"--key-file={key}",
                                   f"--log-file={t / 'munge' / 'log'}", f"--pid-file={t / 'munge' / 'pid'}",
                                   f"--seed-file={t / 'munge' / 'seed'}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        self.children.append(munged)
        for host in self.ns:
            (t / f"spool.{host}").mkdir()
        (t / "state").mkdir()
        nodes = "\n".join(f"NodeName={h} NodeAddr={a} CPUs={os.cpu_count()} State=UNKNOWN"
                          for h, a in self.addr.items())
        self.slurm_conf = t / "slurm.conf"
        self.slurm_conf.write_text(textwrap.dedent(f"""\
            ClusterName=vdmn
            SlurmctldHost=node1({self.addr['node1']})
            AuthType=auth/munge
            AuthInfo=socket={sock}
            CredType=cred/munge
            SlurmUser=root
            SlurmdUser=root
            StateSaveLocation={t / 'state'}
            SlurmdSpoolDir={t}/spool.%n
            SlurmctldPidFile={t / 'slurmctld.pid'}
            SlurmdPidFile={t}/slurmd.%n.pid
            SlurmctldLogFile={t / 'slurmctld.log'}
            SlurmdLogFile={t}/slurmd.%n.log
            ProctrackType=proctrack/linuxproc
            TaskPlugin=task/none
            JobAcctGatherType=jobacct_gather/none
            AccountingStorageType=accounting_storage/none
            SchedulerType=sched/builtin
            SelectType=select/linear
            MpiDefault=none
            MailProg=/bin/true
            ReturnToService=2
            PropagateResourceLimits=NONE
            KillWait=5
            """) + nodes + "\nPartitionName=vd Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP\n")
        # no cgroup mounts are needed with proctrack/linuxproc and task/none, but slurmd loads its cgroup
        # plugin anyway; cgroup/v1 named explicitly initializes without touching any hierarchy
        (t / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        self.daemon("node1", [tool("slurmctld"), "-D", "-i", "-f", str(self.slurm_conf)], "slurmctld")
        for host in self.ns:
            self.daemon(host, [tool("slurmd"), "-D", "-N", host, "-f", str(self.slurm_conf)], "slurmd")

    def slurm_wait(self, timeout: float = 60) -> dict:
        """Wait until both nodes are idle; returns the variables Slurm's client commands need (SLURM_CONF)."""
        t = self.tmp / "slurm"
        env = dict(os.environ, SLURM_CONF=str(self.slurm_conf))
        end = time.monotonic() + timeout
        while True:
            info = subprocess.run([tool("ip"), "netns", "exec", self.ns["node1"], tool("sinfo"), "-h", "-o", "%T %D"],
                                  capture_output=True, text=True, env=env)
            if info.stdout.split() == ["idle", "2"]:
                return {"SLURM_CONF": str(self.slurm_conf)}
            if time.monotonic() > end:
                logs = "\n".join(p.read_text()[-2000:] for p in t.glob("*.log"))
                raise RuntimeError(f"Slurm did not come up: {info.stdout} {info.stderr}\n{logs}")
            time.sleep(0.2)

    # ---------------------------------------------------------------- processes

    def ns_inodes(self) -> set[int]:
        out = set()
        for ns in self.made_ns:
            try:
                out.add(os.stat(f"/run/netns/{ns}").st_ino)
            except OSError:
                pass
        return out

    def processes(self, host: str | None = None) -> list[int]:
        """Live processes in our namespaces (`host`'s only, when given)."""
        inodes = {os.stat(f"/run/netns/{self.ns[host]}").st_ino} if host else self.ns_inodes()
        found = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if os.stat(d / "ns" / "net").st_ino in inodes and not zombie(int(d.name)):
                    found.append(int(d.name))
            except OSError:  # gone meanwhile
                continue
        return found

    def job_processes(self, tag: str, host: str | None = None) -> list[int]:
        """Processes of the job `tag` on `host` (or both): its node agents and whatever has its tag in
        its environment (DeepSpeed's launcher, the ranks, what they started)."""
        found = []
        for pid in self.processes(host):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
                env = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            if b"video_dit.parallel.node" in cmd or f"VIDEO_DIT_JOB={tag}".encode() in env.split(b"\0"):
                found.append(pid)
        return found

    def close(self) -> None:
        """Kill (SIGKILL, by pid) every process in our namespaces and every child we started, then delete
        the namespaces and our /etc/netns folders."""
        for _ in range(3):  # a daemon may fork while we kill
            for pid in self.processes() + [p.pid for p in self.children if p.poll() is None]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for p in self.children:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            if not self.processes():
                break
            time.sleep(0.2)
        for ns in self.made_ns:
            subprocess.run([tool("ip"), "netns", "del", ns], capture_output=True)
        for folder in self.etc_dirs:
            shutil.rmtree(folder, ignore_errors=True)


def zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2] in "ZX"


def sh(*argv) -> None:
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv))}: {done.stderr.strip()}")
