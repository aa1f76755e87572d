"""The pre-flight of a multi-node job: every node checked, in seconds, before any rank starts
(`./launch/train.sh ... --hostfile` and `--launcher slurm`, `video-dit plan ... --hostfile`).

    launcher ──ssh host (or one srun for all)──> sh: this checkout's folder? its interpreter?
                                                 └─> python -m video_dit.parallel.preflight probe SPEC
                                                       prints one `VIDEO_DIT_PREFLIGHT {json}` line
    launcher: `problems(...)` compares every node's answer with its own; each problem names the host,
              what is wrong and how to fix it; train.sh exits 2 listing them all

What is checked, per node (`probe`):
  reach       ssh by the hostfile's name (BatchMode: no password prompt), or srun, starts a command
  checkout    this repository at the same path, at the same commit with the same uncommitted changes
  python      the launcher's interpreter path exists there, imports `video_dit` from this checkout,
              with the same Python and the same versions of the packages the ranks use
  comm op     (CPU ranks) DeepSpeed's communication op already built in the extensions folder the
              ranks will use, or a C++ compiler to build it (a warning: 15-90 s more at start)
  folder      the training folder writable and the same file system: a marker the launcher wrote is
              read there, and one written there is read by the launcher
  rendezvous  --master_addr resolves, to no loopback address, and (first host, where rank 0 and the
              store run) to an address of that host whose port is free; the interface each node
              reaches it by (its GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, `interface_env`)

Why each (issue 49, under DeepSpeed's pdsh runner): a node without the interpreter made the first
node's rank wait in the rendezvous for the collective timeout (30 minutes by default); a host whose
own name maps to 127.0.1.1 (Debian's /etc/hosts) made gloo advertise a loopback address (the other
node failed in 3 s, this one hung for ~150 s); an extensions folder not carried made every node
compile the op (88 s, with a compiler).

The probe side is standard library only (it runs before anything is known to work on that node).
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import importlib.metadata
import ipaddress
import json
import os
import random
import shlex
import shutil
import socket
import secrets
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

TAG = "VIDEO_DIT_PREFLIGHT"
MISSING = "VIDEO_DIT_PREFLIGHT_MISSING"
# the packages whose versions must agree across nodes: what the ranks compute and communicate with
PACKAGES = ("torch", "deepspeed", "numpy", "transformers", "safetensors", "peft", "einops", "optimum-quanto",
            "av", "pillow", "pyyaml")
SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's (primary) IPv4 address
PROBE_TIMEOUT_S = 60  # every node's answer (ssh ConnectTimeout is 10 s; srun may wait for the nodes)


class PreflightError(RuntimeError):
    """Problems found on the nodes; the message lists each (host: what; fix)."""


# ---------------------------------------------------------------- the probe (runs on each node)


def remote_command(root: str, python: str, spec: dict) -> str:
    """The shell command a node runs: checks that need no Python first (the checkout, the interpreter),
    each answered by a marker line, then the probe. `spec` travels as base64 JSON (no shell quoting)."""
    arg = base64.urlsafe_b64encode(json.dumps(spec).encode()).decode()
    node = '"${SLURMD_NODENAME:-}"'
    return (f"cd {shlex.quote(root)} 2>/dev/null || {{ echo {MISSING} checkout {node}; exit 0; }}; "
            f"[ -x {shlex.quote(python)} ] || {{ echo {MISSING} python {node}; exit 0; }}; "
            f"exec {shlex.quote(python)} -m video_dit.parallel.preflight probe {arg}")


def software(root: str) -> dict:
    """What must be equal on every node: the interpreter, where `video_dit` comes from, package
    versions, the checkout's commit and uncommitted changes."""
    found = {"python": sys.executable, "python_version": sys.version.split()[0]}
    try:
        import video_dit
        found["video_dit"] = str(Path(video_dit.__file__).resolve().parent)
    except ImportError as exc:  # the checkout is there but broken
        found["video_dit"] = None
        found["import_error"] = str(exc)
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    found["packages"] = versions
    found["commit"], found["changes"] = checkout_state(root)
    return found


def checkout_state(root: str) -> tuple[str | None, str | None]:
    """(commit, sha256 of `git diff HEAD`) of the checkout at `root`; (None, None) without git."""
    git = shutil.which("git")
    if git is None:
        return None, None
    head = subprocess.run([git, "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return None, None
    diff = subprocess.run([git, "-C", root, "diff", "HEAD", "--binary"], capture_output=True)
    return head.stdout.strip(), hashlib.sha256(diff.stdout).hexdigest()[:16]


def interface_addresses() -> dict[str, str]:
    """IPv4 address -> interface name, for this host's interfaces (their primary addresses)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
            found[socket.inet_ntoa(packed[20:24])] = name
    return found


def rendezvous(master_addr: str, port: int, first: bool) -> dict:
    """How this node reaches `master_addr`: its addresses, the local address and interface a
    connection leaves by, and (`first`: rank 0's host) whether it is this host's and the port free."""
    out = {"addresses": [], "error": None, "source": None, "iface": None, "local": None, "port_free": None,
           "hostname": socket.gethostname(), "hostname_addresses": []}
    try:
        out["hostname_addresses"] = sorted({a[4][0] for a in socket.getaddrinfo(out["hostname"], None, socket.AF_INET)})
    except OSError:
        pass
    try:
        infos = socket.getaddrinfo(master_addr, port, socket.AF_INET, socket.SOCK_STREAM)
    except OSError as exc:
        out["error"] = f"does not resolve ({exc.strerror or exc})"
        return out
    out["addresses"] = list(dict.fromkeys(a[4][0] for a in infos))
    first_addr = out["addresses"][0]  # what torch's store client connects to first
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((first_addr, port))  # no packet: the kernel picks the route and source address
            out["source"] = s.getsockname()[0]
        except OSError as exc:
            out["error"] = f"{first_addr} is not reachable from here ({exc.strerror or exc})"
            return out
    own = interface_addresses()
    out["iface"] = own.get(out["source"])
    if out["iface"] is None and shutil.which("ip"):  # a secondary address: ask iproute2
        listed = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
        for line in listed.splitlines():
            parts = line.split()
            if len(parts) > 3 and parts[3].split("/")[0] == out["source"]:
                out["iface"] = parts[1]
    if first:
        out["local"] = first_addr in own or out["source"] == first_addr
        out["port_free"] = port_free(port)
        if not out["port_free"]:
            out["free_port"] = free_port()
    return out


def port_free(port: int) -> bool:
    """Whether the rendezvous store could bind `port` on every address here."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port free here now, drawn below the kernel's ephemeral range (as `devices.free_port`: a port of
    that range can be taken by any outgoing connection before the store binds it)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    rng = random.SystemRandom()
    for _ in range(64 if low - 20000 >= 1000 else 0):
        port = rng.randrange(20000, low)
        if port_free(port):
            return port
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def extensions(ext: dict | None) -> dict | None:
    """Whether DeepSpeed's communication op is built where this node's ranks will look for it (the
    carried TORCH_EXTENSIONS_DIR, else torch's per-user default), and the C++ compiler that could."""
    if not ext:
        return None
    root = ext.get("dir")
    if not root:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
        root = os.path.join(os.path.realpath(os.path.join(cache, "torch_extensions")), ext["build_folder"])
    library = Path(root) / ext["op"] / f"{ext['op']}.so"
    return {"library": str(library), "built": library.is_file(), "compiler": shutil.which("c++") or shutil.which("g++")}


def marker(spec: dict | None, index: int) -> dict | None:
    """Read the launcher's marker in the training folder, write this node's beside it."""
    if not spec:
        return None
    out = {"read": None, "wrote": None}
    folder = Path(spec["dir"])
    try:
        out["read"] = (folder / spec["name"]).read_text()
    except OSError as exc:
        out["read_error"] = exc.strerror or str(exc)
    mine = folder / f"{spec['name']}.{index}"
    try:
        mine.write_text(socket.gethostname())
        out["wrote"] = str(mine)
    except OSError as exc:
        out["write_error"] = exc.strerror or str(exc)
    return out


def probe(spec: dict) -> dict:
    """Everything this node can say about itself for the job `spec` describes."""
    index = spec.get("node")
    if index is None:  # srun: one spec for all nodes
        index = spec["hosts"].index(os.environ.get("SLURMD_NODENAME", ""))
    return {"node": index, "slurm_node": os.environ.get("SLURMD_NODENAME"), **software(spec["root"]),
            "ext": extensions(spec.get("ext")), "marker": marker(spec.get("marker"), index),
            "rendezvous": rendezvous(spec["master_addr"], spec["master_port"], index == 0)}


# ---------------------------------------------------------------- the launcher's side


def describe_exit(code: int) -> str:
    """A node agent's exit code in words. DeepSpeed's launcher exits with a failed rank's code, a
    signal's as 256 - N (sys.exit of the negative return code)."""
    if code >= 192 and 256 - code < 65:
        try:
            return f"a rank was killed by {signal.Signals(256 - code).name} (exit {code})"
        except ValueError:
            pass
    return f"exit code {code}"


def run_commands(transport, hosts: list[str], command_of, timeout: float) -> tuple[dict, dict]:
    """Run `command_of(i)` on every host at once (srun: `command_of(None)` on all); returns (host index
    -> output, host index -> why it gave none) (srun: output under index None)."""
    outputs, errors = {}, {}
    if not transport.per_host:
        argv = transport.argv(hosts, command_of(None))
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return {}, {i: f"srun gave no answer within {timeout:.0f} s" for i in range(len(hosts))}
        except FileNotFoundError:
            return {}, {i: "srun is not on PATH" for i in range(len(hosts))}
        outputs[None] = proc.stdout
        if proc.returncode != 0:
            errors.update({i: f"srun: {last_line(proc.stderr)}" for i in range(len(hosts))})
        return outputs, errors
    argvs = [transport.argv(h, command_of(i)) for i, h in enumerate(hosts)]
    try:
        procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                  text=True, start_new_session=True) for argv in argvs]
    except FileNotFoundError:
        return {}, {i: f"{argvs[0][0]} is not installed on this host" for i in range(len(hosts))}
    end = time.monotonic() + timeout
    try:
        for i, proc in enumerate(procs):
            try:
                out, err = proc.communicate(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                errors[i] = f"no answer within {timeout:.0f} s"
                continue
            outputs[i] = out
            if proc.returncode != 0:
                errors[i] = f"{argvs[i][0]} exit {proc.returncode}: {last_line(err) or 'no message'}"
    finally:  # also on Ctrl-C: no probe left behind
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs, errors


def last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def parse_answers(text: str, hosts: list[str], node: int | None = None) -> dict[int, dict]:
    """node index -> its answer, from a probe command's output (one node's, `node` given, or every
    node's under srun: then each answer names its node)."""
    answers = {}
    for line in text.splitlines():
        at = line.find(TAG)  # past srun --label's "N: " prefix
        if at < 0:
            continue
        line = line[at:]
        if line.startswith(MISSING):
            parts = line.split()
            what, name = parts[1], (parts[2] if len(parts) > 2 else None)
            index = node if node is not None else (hosts.index(name) if name in hosts else None)
            if index is not None:
                answers[index] = {"missing": what}
        elif line.startswith(TAG + " "):
            found = json.loads(line[len(TAG) + 1:])
            answers[found["node"]] = found
    return answers


def problems(hosts: list[str], answers: dict[int, dict], reference: dict, *, root: str, master_addr: str,
             port: int, port_given: bool, transport_errors: dict[int, str], fix_reach: str) -> list[str]:
    """Every problem of the nodes' answers, one line each: `host: what; fix`. `reference` is the
    launcher's own `software()`: every node must match it."""
    out = []
    py = reference["python"]
    for i, host in enumerate(hosts):
        a = answers.get(i)
        if a is None:
            why = transport_errors.get(i) or "no answer"
            out.append(f"{host}: not reachable ({why}); {fix_reach}")
            continue
        if a.get("missing") == "checkout":
            out.append(f"{host}: no folder {root} (this checkout); every node needs it at the same path: a shared "
                       "folder, or the same clone at the same commit")
            continue
        if a.get("missing") == "python":
            out.append(f"{host}: no interpreter {py} (every node runs the launcher's); create it there: "
                       f"ssh {host} 'cd {root} && bash -c \"source launch/_env.sh && vd_python\"' (makes .venv), or "
                       "share the folder that holds it")
            continue
        out += [f"{host}: {p}" for p in software_problems(a, reference, root)]
        ext = a.get("ext")
        if ext and not ext["built"]:
            if ext["compiler"] is None:
                out.append(f"{host}: DeepSpeed's communication op is not built ({ext['library']}) and there is no C++ "
                           "compiler to build it; build it once where the folder is shared (python -m "
                           "video_dit.parallel.ops with the same TORCH_EXTENSIONS_DIR), or install g++ there")
        m = a.get("marker")
        if m is not None:
            if m.get("read_error") or m.get("read") != reference.get("marker_token"):
                out.append(f"{host}: the training folder is not the launcher's (a marker written there by the launcher "
                           f"reads {m.get('read_error') or repr(m.get('read'))} on {host}); put training_folder on a "
                           "file system every node mounts at the same path")
            elif m.get("write_error"):
                out.append(f"{host}: cannot write in the training folder ({m['write_error']}); make it writable there")
        out += [f"{host}: {p}" for p in rendezvous_problems(a["rendezvous"], master_addr, port, port_given, i == 0,
                                                              hosts[0])]
    return out


def software_problems(a: dict, ref: dict, root: str) -> list[str]:
    out = []
    if a.get("video_dit") is None:
        out.append(f"{a['python']} cannot import video_dit ({a.get('import_error')}); reinstall it there")
    elif not a["video_dit"].startswith(str(Path(root).resolve())):
        out.append(f"{a['python']} imports video_dit from {a['video_dit']}, not from this checkout ({root}); "
                   "the nodes would run other code")
    if a["python_version"] != ref["python_version"]:
        out.append(f"Python {a['python_version']} (here {ref['python_version']}); use the same .venv everywhere")
    differ = [f"{n} {a['packages'].get(n)} (here {v})" for n, v in ref["packages"].items() if a["packages"].get(n) != v]
    if differ:
        out.append(f"other package versions: {', '.join(differ)}; install the same versions (or share the .venv)")
    if ref["commit"] and a["commit"] and a["commit"] != ref["commit"]:
        out.append(f"the checkout is at commit {a['commit'][:12]} (here {ref['commit'][:12]}); check out the same "
                   "commit on every node")
    elif ref["changes"] and a["changes"] and a["changes"] != ref["changes"]:
        out.append("the checkout has other uncommitted changes than here; make the nodes' files equal")
    return out


def rendezvous_problems(r: dict, master_addr: str, port: int, port_given: bool, first: bool, first_host: str) -> list:
    if r["error"]:
        return [f"--master_addr {master_addr} {r['error']}; give an address every node reaches"]
    out = []
    loop = [a for a in r["addresses"] if ipaddress.ip_address(a).is_loopback]
    if loop:
        out.append(f"--master_addr {master_addr} resolves to {', '.join(loop)} (loopback) here (a host's own name on "
                   "127.0.1.1 is Debian's /etc/hosts default): this node would reach the rendezvous, and its ranks "
                   "would listen, on an address no other node reaches; give --master_addr as "
                   f"{first_host}'s address on the network the nodes share, or map {master_addr} to that address "
                   "in this node's /etc/hosts")
    elif r["iface"] is None:
        out.append(f"the address {r['source']} this node reaches {master_addr} from belongs to no interface listed "
                   "here; set GLOO_SOCKET_IFNAME (CPU) / NCCL_SOCKET_IFNAME (GPU) yourself")
    if first and not loop:
        if not r["local"]:
            out.append(f"--master_addr {master_addr} ({r['addresses'][0]}) is not an address of {first_host}, the "
                       "first host, where rank 0 runs the rendezvous store; give the first host's address")
        elif not r["port_free"] and port_given:
            out.append(f"--master_port {port} is in use here; pass another port, or leave it out to get a free one")
    return out


def check_nodes(transport, hosts: list[str], *, root: str, python: str, master_addr: str, port: int,
                port_given: bool, folder: Path, ext: dict | None) -> tuple[dict, int, list[str]]:
    """The pre-flight: `probe` on every host at once through `transport` (`nodes.Ssh` / `nodes.Srun`),
    a marker in the training `folder` both ways. Returns ({host: its interface variables}, the
    rendezvous port, notes for the log); `PreflightError` listing every problem found."""
    token = secrets.token_hex(8)
    name = f".video_dit_preflight_{token}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(token)
    except OSError as exc:
        raise PreflightError(f"this host: the training folder {folder} cannot be written ({exc.strerror or exc})")
    spec = {"root": root, "hosts": hosts, "master_addr": master_addr, "master_port": port, "ext": ext,
            "marker": {"dir": str(folder), "name": name}}
    try:
        outputs, errors = run_commands(transport, hosts, lambda i: remote_command(root, python, {**spec, "node": i}),
                                       PROBE_TIMEOUT_S)
        answers = {}
        for i, text in outputs.items():
            answers.update(parse_answers(text, hosts, node=i))
        found = problems(hosts, answers, {**software(root), "marker_token": token}, root=root,
                         master_addr=master_addr, port=port, port_given=port_given, transport_errors=errors,
                         fix_reach=transport.reach_fix)
        for i, a in answers.items():  # what each node wrote, read here
            if (a.get("marker") or {}).get("wrote") and not (folder / f"{name}.{i}").is_file():
                found.append(f"{hosts[i]}: a file it wrote in the training folder is not seen on this host; put "
                             "training_folder on a file system every node mounts at the same path")
    finally:
        for f in folder.glob(f"{name}*"):
            f.unlink(missing_ok=True)
    if found:
        raise PreflightError("\n".join(found))
    notes = []
    first = answers[0]["rendezvous"]
    if not first["port_free"]:
        notes.append(f"port {port} is in use on {hosts[0]}; the ranks meet on port {first['free_port']} instead")
        port = first["free_port"]
    for i, a in answers.items():
        ext_found = a.get("ext")
        if ext_found and not ext_found["built"]:
            notes.append(f"{hosts[i]}: DeepSpeed's communication op is not built ({ext_found['library']}): its ranks "
                         "will compile it at start (15-90 s)")
    return {hosts[i]: interface_env(answers[i]) for i in sorted(answers)}, port, notes


def interface_env(answer: dict, environ=os.environ) -> dict:
    """The socket interface variables for one node's ranks (its interface towards the store), unless
    the user set them: gloo would otherwise pick the address its host name resolves to, which may be
    loopback; NCCL's `=name` means exactly that interface."""
    iface = answer["rendezvous"]["iface"]
    env = {}
    if iface and "GLOO_SOCKET_IFNAME" not in environ:
        env["GLOO_SOCKET_IFNAME"] = iface
    if iface and "NCCL_SOCKET_IFNAME" not in environ:
        env["NCCL_SOCKET_IFNAME"] = f"={iface}"
    return env


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "probe":
        print("usage: python -m video_dit.parallel.preflight probe SPEC (run by the launcher on each node)",
              file=sys.stderr)
        return 2
    spec = json.loads(base64.urlsafe_b64decode(argv[1]))
    print(f"{TAG} {json.dumps(probe(spec))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
