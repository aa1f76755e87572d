"""`./launch/gpu_check.sh`: one command that checks this checkout on a machine with a GPU.

    ./launch/gpu_check.sh [--only NAMES] [--skip NAMES] [--total S] [--budget NAME=S] [--steps N] [-v]
    python -m video_dit.bench.gpu_check ...            # the same, with this Python (gpu_check.sh finds one)

Steps (`STEPS`), each a command of its own with a time budget; one that fails or runs out of time
does not stop the others:

    env        the machine: GPU, driver (nvidia-smi, else NVML; the CUDA version it supports, from torch),
               torch, CUDA, cuDNN, DeepSpeed, triton and the other packages' versions, the attention backends
               and fused kernels usable here. No CUDA device: exit 2 with torch's words; a package missing:
               exit 2 naming it
    gpu_tests  `pytest -m "gpu and not slow" -q tests` (its JUnit XML: passed / failed / skipped, the failures'
               names; the slow gpu test is the embedded default, which the demo step runs)
    demo       the embedded default: `python -m video_dit.train.launcher` on configs/demo_i2v_tiny.yaml
               (what ./launch/train.sh runs, without its set-up, which would create .venv and pip-install
               when the packages come from PYTHONPATH), its DiT run in a fresh folder of the work
               directory (in output/ a finished run would be resumed: nothing trained). Its data and tiny
               VAE stay where the embedded default keeps them (data/demo, output/demo_i2v_tiny/tiny_vae);
               where they are missing, its prepare stages (CPU only) start right after step 1, overlapping
               the gpu tests. Its wall time and the demo checker's verdicts (step 0: none pass; the last
               step: all pass)
    dit, vae, precision, train, plan
               `video-dit bench --suite NAME --device cuda --json FILE` (train: `--steps N`; dit,
               train and plan get a `--budget` a little under their step's, so they end in time with their figures)

The budgets (`STEPS`; `--budget NAME=S`) are caps; `--total` (default 470 s) bounds the whole run: a step
gets at most what is left, and one that would get under `MIN_STEP_S` is not started (status "timeout").
At the end: one summary table, and every figure as JSON in `docs/bench/gpu_check_<gpu>_<UTC time>.json`
and `docs/bench/gpu_check_latest.json` (layout: docs/bench/README.md); each step's full output stays in
the work directory. Exit 0 when every step that ran passed, 1 when one failed or ran out of time, 2
when torch sees no CUDA device or a package is missing. Bench targets not met are reported in the
table, not failures: a step fails when its command does.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "[gpu-check]"
TOTAL_S = 470.0  # the issue's 8 minutes on one H200, less the shell's start (its torch checks) and the report
MIN_STEP_S = 10.0  # a step that would get less is not started
HEARTBEAT_S = 30.0
KILL_GRACE_S = 10.0  # SIGTERM (the launcher stops its ranks), then SIGKILL
SCHEMA = 1
DEMO_CONFIG = "configs/demo_i2v_tiny.yaml"
DEMO_VAE = "output/demo_i2v_tiny/tiny_vae/tiny_vae.safetensors"  # the embedded default's prepare.tiny_vae

# import name -> distribution name: what the package and its checks need (pyproject's dependencies + dev)
REQUIRED = {"torch": "torch", "deepspeed": "deepspeed", "transformers": "transformers", "peft": "peft",
            "diffusers": "diffusers", "safetensors": "safetensors", "optimum.quanto": "optimum-quanto",
            "av": "av", "imageio": "imageio", "einops": "einops", "yaml": "pyyaml", "tqdm": "tqdm",
            "PIL": "pillow", "numpy": "numpy", "matplotlib": "matplotlib", "pytest": "pytest"}
VERSIONS = ("torch", "deepspeed", "triton", "diffusers", "transformers", "peft", "safetensors", "optimum-quanto", "av",
            "numpy", "pytest", "flash-attn", "flash_attn_3", "sageattention")


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    budget_s: float  # the default cap: an estimate from the H200 figures (docs/bench/README.md), not a measurement


STEPS = (  # 470 s in all: 8 minutes with the shell's start and the report
    Step("env", "environment", 10),
    Step("gpu_tests", "gpu tests (pytest -m 'gpu and not slow')", 95),
    Step("demo", "embedded default (demo_i2v_tiny)", 120),
    Step("dit", "bench dit", 50),
    Step("vae", "bench vae", 20),
    Step("precision", "bench precision", 15),
    Step("train", "bench train (one-GPU jobs)", 120),
    Step("plan", "bench plan", 40),
)
BENCHES = ("dit", "vae", "precision", "train", "plan")
SUITE_SLACK_S = {"dit": 20, "train": 25, "plan": 10}  # under the step's budget: the bench's start-up and JSON


# ---------------------------------------------------------------- running a command with a budget


@dataclass
class Outcome:
    returncode: int | None  # None: killed at its time limit
    seconds: float
    log: Path

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class Running:
    """A command started in its own process group, its output (stdout + stderr) copied to `log` (and
    the console when `verbose`)."""

    def __init__(self, argv: list[str], log: Path, cwd: Path = ROOT, env: dict | None = None, verbose: bool = False):
        self.start, self.log = time.monotonic(), log
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)

        def copy():
            try:
                for line in self.proc.stdout:
                    self._out.write(line)
                    self._out.flush()
                    if verbose:
                        sys.stdout.write("    " + line.decode(errors="replace"))
                        sys.stdout.flush()
            except ValueError:  # the log was closed under it: a process outside the group kept the pipe open
                return

        self._reader = threading.Thread(target=copy, daemon=True)
        self._reader.start()

    def wait(self, timeout: float, label: str = "") -> Outcome:
        """Wait up to `timeout` seconds from now, a line every `HEARTBEAT_S` saying it still runs; then
        the group gets SIGTERM, and SIGKILL after `KILL_GRACE_S`."""
        until = time.monotonic() + timeout
        code = None
        while True:
            left = until - time.monotonic()
            if left <= 0:
                break
            try:
                code = self.proc.wait(timeout=min(left, HEARTBEAT_S))
                break
            except subprocess.TimeoutExpired:
                print(f"{PREFIX}   ... {label} still running, {time.monotonic() - self.start:.0f} s", flush=True)
        if code is None:
            self.stop()
        return Outcome(code, time.monotonic() - self.start, self.log)

    def stop(self) -> None:
        _stop(self.proc)
        self._reader.join(timeout=5)
        self._out.close()

    def running(self) -> bool:
        return self.proc.poll() is None


def run_command(argv: list[str], timeout: float, log: Path, cwd: Path = ROOT, env: dict | None = None,
                label: str = "", verbose: bool = False) -> Outcome:
    """Run `argv` to its end or for `timeout` seconds (`Running`)."""
    run = Running(argv, log, cwd, env, verbose)
    out = run.wait(timeout, label)
    run.stop()
    return out


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ---------------------------------------------------------------- step 1: the machine


def driver_version(run: Callable = subprocess.run) -> dict:
    """The NVIDIA driver: nvidia-smi's, else NVML's (pynvml), else None with where it looked."""
    try:
        proc = run(["nvidia-smi", "--query-gpu=driver_version,name,memory.total", "--format=csv,noheader,nounits"],
                   capture_output=True, text=True, timeout=15, check=False)
        line = proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else ""
        if line:
            version, name, memory = (x.strip() for x in line.split(","))
            return {"version": version, "source": "nvidia-smi", "name": name, "memory_mib": int(float(memory))}
        why = f"nvidia-smi exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[:200]}"
    except FileNotFoundError:
        why = "nvidia-smi not found"
    except (subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        why = f"nvidia-smi: {type(exc).__name__}: {exc}"
    try:
        import pynvml  # optional: NVML's Python binding, where installed

        pynvml.nvmlInit()
        version = pynvml.nvmlSystemGetDriverVersion()
        return {"version": version.decode() if isinstance(version, bytes) else version, "source": "NVML"}
    except Exception as exc:  # noqa: BLE001 - not installed, or no driver: said in the record
        why += f"; NVML: {type(exc).__name__}"
    return {"version": None, "source": why}


def package_versions(names=VERSIONS) -> dict:
    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def missing_modules(required: dict = REQUIRED, find=importlib.util.find_spec) -> list[str]:
    """The distributions of `required` whose module cannot be found by this Python."""
    missing = []
    for module, dist in required.items():
        try:
            found = find(module) is not None
        except (ImportError, ValueError):  # a dotted name whose parent package is absent
            found = False
        if not found:
            missing.append(dist)
    return missing


def repo_commit(root: Path = ROOT) -> dict:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return {"commit": None}
    if head.returncode != 0:
        return {"commit": None}
    return {"commit": head.stdout.strip(), "modified_files": len(dirty.stdout.splitlines())}


def probe_environment() -> dict:
    """What this Python sees of the machine (run as `--_env` in a process of its own, so the checking
    process itself never initialises CUDA: the GPU stays the steps')."""
    import torch  # here, not at the top: the parent process must not hold a CUDA context

    env = {"python": platform.python_version(), "executable": sys.executable, "platform": platform.platform(),
           "torch": torch.__version__, "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
           "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "pythonpath": os.environ.get("PYTHONPATH"),
           "packages": package_versions(), "missing": missing_modules(), **repo_commit()}
    if not env["cuda_available"]:
        try:
            torch.cuda.init()
            env["cuda_error"] = "torch.cuda.is_available() is False (torch.cuda.init() raised nothing)"
        except Exception as exc:  # noqa: BLE001 - torch's own words are the message
            env["cuda_error"] = f"{type(exc).__name__}: {exc}"
        return env
    env["gpus"] = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        env["gpus"].append({"index": i, "name": p.name, "memory_mib": p.total_memory // 2 ** 20,
                            "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count})
    env["gpu"] = env["gpus"][0]["name"]
    env["cudnn"] = torch.backends.cudnn.version()
    env["driver"] = driver_version()
    api = getattr(torch._C, "_cuda_getDriverVersion", None)  # what the driver supports, e.g. 13000: CUDA 13.0
    if api is not None:
        v = api()
        env["driver"]["cuda_driver_api"] = f"{v // 1000}.{v % 1000 // 10}"
    try:
        from video_dit import kernels
        from video_dit.models import attention

        env["attention_backends"] = {b: attention.available(b) for b in attention.BACKENDS}
        env["fused_kernels"] = kernels.status()
    except Exception as exc:  # noqa: BLE001 - a package that does not import shows in the record, not as a crash
        env["video_dit_error"] = f"{type(exc).__name__}: {exc}"
    return env


def no_cuda_message(env: dict) -> str:
    return (f"torch sees no CUDA device: {env.get('cuda_error', '?')} (torch {env.get('torch')}, built "
            + (f"with CUDA {env['cuda']}" if env.get("cuda") else "without CUDA")
            + (f", CUDA_VISIBLE_DEVICES={env['cuda_visible_devices']!r}" if env.get("cuda_visible_devices") is not None
               else "")
            + f", python {env.get('executable')}). This check needs a GPU; on CPU run ./launch/test.sh and "
            "video-dit bench.")


def missing_message(missing: list[str]) -> str:
    return (f"missing packages for this Python: {', '.join(missing)}. Bring them without network as wheels "
            "(README, On a GPU machine: pip download on a machine with network, then pip install --no-index "
            "--target /tmp/site), or run with --allow-missing to see what runs without them.")


# ---------------------------------------------------------------- figures from each step's output


def parse_junit(path: Path) -> dict:
    """passed / failed / errors / skipped counts and the failing tests' names from pytest's JUnit XML."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname', '')}::{case.get('name', '')}".strip(":"))
    return {"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": counts["failures"], "errors": counts["errors"], "skipped": counts["skipped"],
            "failures": failed}


VERDICT = re.compile(r"step (\d+): (\d+)/(\d+) previews pass")


def parse_demo_checks(text: str) -> dict:
    """{step: {"pass": n, "of": m}} from the demo checker's report lines (the trainer's, or check-demo's)."""
    out = {}
    for m in VERDICT.finditer(text):
        out[int(m.group(1))] = {"pass": int(m.group(2)), "of": int(m.group(3))}
    return out


def demo_verdict(checks: dict) -> dict:
    """The expected picture: no preview passes at step 0 (a random DiT), every one at the last step."""
    if not checks:
        return {"met": False, "why": "no demo check report found"}
    first, last = min(checks), max(checks)
    out = {"first_step": first, "last_step": last, "first": checks[first], "last": checks[last]}
    out["met"] = (first == 0 and checks[first]["pass"] == 0 and last > 0
                  and checks[last]["pass"] == checks[last]["of"] > 0)
    return out


def metrics_figures(path: Path) -> dict:
    """Median step time, tokens/s and peak memory of the demo's `metrics.jsonl` (training rows)."""
    rows = []
    try:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if "step_time_s" in row:
                rows.append(row)
    except (OSError, json.JSONDecodeError):
        return {}
    if not rows:
        return {}
    return {"steps": len(rows), "median_step_s": statistics.median(r["step_time_s"] for r in rows),
            "median_tokens_per_s": statistics.median(r.get("tokens_per_s", 0.0) for r in rows),
            "peak_mem_gb": max(r.get("peak_mem_gb", 0.0) for r in rows), "last_loss": rows[-1].get("loss")}


def _get(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def bench_digest(suite: str, res: dict) -> dict:
    """The few figures of a suite's result that the summary shows (the JSON keeps the whole result)."""
    if suite == "dit":
        out = {k: res.get(k) for k in ("time_ratio", "mfu", "mfu_diffusers", "peak_ratio", "saved_ratio")}
        out["step_s"] = res.get("step_s")
        out["attention"] = {r["attention"]: r.get("time_ratio", r.get("skipped") or r.get("error"))
                            for r in res.get("rows", [])}
        out["levers"] = {r["lever"]: {k: r[k] for k in ("time_ratio", "compile_s", "error", "skipped") if k in r}
                         for r in res.get("levers", [])}
        return out
    if suite == "vae":
        return {k: res.get(k) for k in ("time_ratio", "memory_ratio", "max_abs_diff")}
    if suite == "precision":
        return {k: res.get(k) for k in ("velocity_ours_vs_diffusers", "velocity_ours_vs_pure",
                                        "lora_grad_ours_vs_diffusers", "lora_grad_ours_vs_pure")}
    if suite == "train":
        return {"jobs": [{k: j.get(k) for k in ("name", "step_s", "tokens_per_s", "mfu", "peak_bytes",
                                                "planned_over_measured", "step_s_all", "error")}
                         for j in _get(res, "jobs", "jobs") or []]}
    if suite == "plan":
        return {k: v for k, v in res.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {}


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def figures_line(name: str, rec: dict) -> str:
    """One short line of a step's figures for the summary table."""
    f = rec.get("figures") or {}
    if not f:
        return ""
    if name == "env":
        d = f.get("driver") or {}
        return (f"{f.get('gpu', '-')}, driver {d.get('version') or '-'}, torch {f.get('torch')}, CUDA {f.get('cuda')}, "
                f"DeepSpeed {_get(f, 'packages', 'deepspeed') or '-'}, triton {_get(f, 'packages', 'triton') or '-'}")
    if name == "gpu_tests":
        if "passed" not in f:
            return ""
        names = f["failures"]
        failed = f" ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})" if names else ""
        return f"{f['passed']} passed, {f['failed'] + f['errors']} failed, {f['skipped']} skipped{failed}"
    if name == "demo":
        checks = f.get("checks") or {}
        parts = [f"step {s}: {c['pass']}/{c['of']}" for s, c in sorted(checks.items(), key=lambda kv: int(kv[0]))]
        m = f.get("metrics") or {}
        if m:
            parts.append(f"{_f(m.get('median_step_s'), '.3f')} s/step")
        parts.append(f"VAE {f.get('vae_stage', '-')}")
        return ", ".join(parts)
    if name == "dit":
        levers = f.get("levers") or {}
        lv = "; ".join(f"{k} " + (_f(v.get("time_ratio"), ".2f") if "time_ratio" in v else "failed")
                       + (f" (compile {v['compile_s']:.0f} s)" if "compile_s" in v else "") for k, v in levers.items())
        return (f"ours/diffusers {_f(f.get('time_ratio'), '.3f')}, MFU {_f(f.get('mfu'), '.1%')}, "
                f"peak {_f(f.get('peak_ratio'), '.3f')}" + (f"; on/off: {lv}" if lv else ""))
    if name == "vae":
        return f"time {_f(f.get('time_ratio'), '.3f')}, memory {_f(f.get('memory_ratio'), '.3f')}"
    if name == "precision":
        return (f"velocity ours/diffusers {_f(f.get('velocity_ours_vs_diffusers'), '.3f')}, LoRA grad "
                f"{_f(f.get('lora_grad_ours_vs_diffusers'), '.3f')}")
    if name == "train":
        jobs = f.get("jobs") or []
        return "; ".join(f"{_f(j.get('step_s'), '.2f')} s {_f(j.get('mfu'), '.0%')} p/m "
                         f"{_f(j.get('planned_over_measured'), '.2f')}" if j.get("step_s") else "failed" for j in jobs)
    if name == "plan":
        return ", ".join(f"{k} {v:.3g}" for k, v in list(f.items())[:4])
    return ""


# ---------------------------------------------------------------- the steps


@dataclass
class Context:
    python: str
    work: Path
    env: dict  # the environment of every command
    verbose: bool
    steps: int  # train suite: steps per job
    probe: dict | None = None  # step 1's record of the machine
    prepare: Running | None = None  # the demo's prepare stages, started early (`start_demo_prepare`)


def _record(outcome: Outcome | None, argv: list[str] | None, **kw) -> dict:
    rec = {"command": " ".join(argv) if argv else None}
    if outcome is not None:
        rec.update(returncode=outcome.returncode, seconds=round(outcome.seconds, 2), log=str(outcome.log))
    rec.update(kw)
    return rec


def last_json(text: str) -> dict | None:
    """The last line of `text` that is a JSON object (a warning may follow it: stderr shares the log)."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def step_env(ctx: Context, timeout: float) -> dict:
    argv = [ctx.python, "-m", "video_dit.bench.gpu_check", "--_env"]
    out = run_command(argv, timeout, ctx.work / "env.log", env=ctx.env, label="env")
    probe = last_json(out.tail(200_000))
    if probe is None:
        return _record(out, argv, status="fail", reason=out.tail(2000))
    ctx.probe = probe
    return _record(out, argv, status="pass", figures=probe)


def step_gpu_tests(ctx: Context, timeout: float) -> dict:
    xml = ctx.work / "gpu_tests.xml"
    # the slow gpu test is the embedded default end to end, which the demo step runs itself
    argv = [ctx.python, "-m", "pytest", "-m", "gpu and not slow", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
            "tests"]
    out = run_command(argv, timeout, ctx.work / "gpu_tests.log", env=ctx.env, label="gpu tests",
                      verbose=ctx.verbose)
    figures = parse_junit(xml) if xml.exists() else {}
    if out.returncode is None:
        return _record(out, argv, status="timeout", figures=figures, reason=f"not finished in {timeout:.0f} s")
    if out.returncode == 5:
        return _record(out, argv, status="fail", figures=figures, reason="pytest collected no test marked gpu")
    status = "pass" if out.returncode == 0 else "fail"
    return _record(out, argv, status=status, figures=figures, reason=None if status == "pass" else out.tail(3000))


def demo_config(work: Path, root: Path = ROOT) -> Path:
    """The embedded default with its DiT run in `work/demo_output` (a fresh run: in output/ a finished
    one would be resumed, i.e. nothing trained); everything else, data and VAE paths included, as it is."""
    import yaml  # after the dependency check (a missing package is reported, not raised)

    raw = yaml.safe_load((root / DEMO_CONFIG).read_text())
    raw["config"]["process"][0]["training_folder"] = str(work / "demo_output")
    path = work / "demo_i2v_tiny.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def demo_prepared(root: Path = ROOT) -> bool:
    """Whether the embedded default's prepare stages have run here (data/demo and its tiny VAE)."""
    return (root / DEMO_VAE).exists() and (root / "data" / "demo").is_dir()


def start_demo_prepare(ctx: Context) -> None:
    """The demo's prepare stages (the demo data, the tiny VAE: CPU only, minutes on a fresh machine, then
    kept) in the background from now, so they overlap the gpu tests rather than eat the demo's budget."""
    argv = [ctx.python, "-m", "video_dit.bench.gpu_check", "--_prepare", str(demo_config(ctx.work))]
    ctx.prepare = Running(argv, ctx.work / "demo_prepare.log", env=ctx.env)
    print(f"{PREFIX}   the demo's data and tiny VAE are missing: made in the background from now "
          f"(CPU; {ctx.work / 'demo_prepare.log'})", flush=True)


def step_demo(ctx: Context, timeout: float) -> dict:
    started = time.monotonic()
    config = demo_config(ctx.work)
    figures = {"config": str(config), "vae_stage": "reused" if (ROOT / DEMO_VAE).exists() else "trained",
               "data": "reused" if (ROOT / "data" / "demo").is_dir() else "generated"}
    if ctx.prepare is not None:  # its prepare stages, started after step 1
        prep = ctx.prepare.wait(timeout, "the demo's prepare stages")
        ctx.prepare.stop()
        ctx.prepare = None
        figures["prepare"] = {"seconds": round(prep.seconds, 1), "returncode": prep.returncode, "log": str(prep.log),
                              "waited_s": round(time.monotonic() - started, 1)}
        figures["vae_stage"] = "trained (in the background from step 1)"
        if prep.returncode is None:
            return _record(None, None, status="timeout", seconds=round(time.monotonic() - started, 1),
                           figures=figures, reason=f"the demo's prepare stages (tiny VAE, CPU) did not finish in "
                           f"{prep.seconds:.0f} s; they are kept once done: run ./launch/gpu_check.sh --only demo "
                           "--total 900 --budget demo=880 once on this machine")
        if prep.returncode != 0:
            return _record(None, None, status="fail", seconds=round(time.monotonic() - started, 1), figures=figures,
                           reason=prep.tail(3000))
    argv = [ctx.python, "-m", "video_dit.train.launcher", str(config)]
    left = timeout - (time.monotonic() - started)
    out = run_command(argv, left, ctx.work / "demo.log", env=ctx.env, label="demo", verbose=ctx.verbose)
    figures["train_s"] = round(out.seconds, 1)
    text = out.tail(200_000)
    checks = parse_demo_checks(text)
    left = timeout - (time.monotonic() - started)
    figures["wall_s"] = round(time.monotonic() - started, 1)
    if out.returncode == 0 and not checks and left > MIN_STEP_S:  # the report comes from the checker itself then
        argv2 = [ctx.python, "-m", "video_dit.cli", "check-demo", str(config)]
        check = run_command(argv2, min(left, 60), ctx.work / "demo_check.log", env=ctx.env, label="check-demo")
        text = check.tail(100_000)
        checks = parse_demo_checks(text)
        figures["checked_by"] = "video-dit check-demo"
    figures["checks"] = {str(k): v for k, v in sorted(checks.items())}
    figures["verdict_lines"] = [line.strip() for line in text.splitlines() if VERDICT.search(line)]
    figures["verdict"] = demo_verdict(checks)
    figures["metrics"] = metrics_figures(ctx.work / "demo_output" / "demo_i2v_tiny" / "metrics.jsonl")
    seconds = round(time.monotonic() - started, 1)
    if out.returncode is None:
        return _record(out, argv, status="timeout", seconds=seconds, figures=figures,
                       reason=f"not finished in {timeout:.0f} s")
    if out.returncode != 0:
        return _record(out, argv, status="fail", seconds=seconds, figures=figures, reason=out.tail(3000))
    ok = figures["verdict"]["met"]
    return _record(out, argv, status="pass" if ok else "fail", seconds=seconds, figures=figures,
                   reason=None if ok else f"demo check: {figures['verdict']}")


def step_bench(suite: str, ctx: Context, timeout: float) -> dict:
    path = ctx.work / f"bench_{suite}.json"
    argv = [ctx.python, "-m", "video_dit.cli", "bench", "--suite", suite, "--device", "cuda", "--json", str(path)]
    if suite == "train":
        argv += ["--steps", str(ctx.steps)]
    if suite in SUITE_SLACK_S:
        argv += ["--budget", f"{max(timeout - SUITE_SLACK_S[suite], 5):.0f}"]
    out = run_command(argv, timeout, ctx.work / f"bench_{suite}.log", env=ctx.env, label=f"bench {suite}",
                      verbose=ctx.verbose)
    data = None
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError:
            data = None
    res = _get(data, "results", suite)
    rec = _record(out, argv, bench=data)
    if out.returncode is None:
        rec.update(status="timeout", reason=f"not finished in {timeout:.0f} s")
    elif out.returncode != 0 or not isinstance(res, dict):
        rec.update(status="fail", reason=out.tail(3000))
    elif "error" in res:
        rec.update(status="fail", reason=res["error"])
    else:
        rec.update(status="pass")
    if isinstance(res, dict):
        rec["figures"] = bench_digest(suite, res)
    return rec


RUNNERS: dict[str, Callable[[Context, float], dict]] = {
    "env": step_env, "gpu_tests": step_gpu_tests, "demo": step_demo,
    **{s: (lambda ctx, timeout, s=s: step_bench(s, ctx, timeout)) for s in BENCHES},
}


# ---------------------------------------------------------------- the report


def exit_code(steps: list[dict]) -> int:
    return 1 if any(s["status"] in ("fail", "timeout") for s in steps) else 0


def report(probe: dict | None, steps: list[dict], started: float, total_s: float, argv: list[str], work: Path) -> dict:
    """The JSON of a run (docs/bench/README.md): the machine, each step's record, the bench targets."""
    probe = probe or {}
    targets = []
    for s in steps:
        for row in _get(s, "bench", "summary") or []:
            targets.append(row)
    env_keys = ("gpu", "gpus", "driver", "torch", "cuda", "cudnn", "python", "executable", "platform", "packages",
                "missing", "attention_backends", "fused_kernels", "commit", "modified_files", "pythonpath")
    return {"schema": SCHEMA, "kind": "video_dit gpu_check",
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "wall_s": round(time.time() - started, 1), "total_budget_s": total_s,
            "command": " ".join(["./launch/gpu_check.sh", *argv]), "work_dir": str(work),
            "environment": {k: probe.get(k) for k in env_keys},
            "steps": steps, "targets": targets, "exit_code": exit_code(steps)}


def summary_table(rep: dict) -> str:
    env = rep["environment"]
    lines = [f"{PREFIX} summary: {env.get('gpu') or '-'}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
             f"DeepSpeed {_get(env, 'packages', 'deepspeed') or '-'}; {rep['wall_s']:.0f} s of "
             f"{rep['total_budget_s']:.0f} s",
             f"{'step':11}{'status':>8}{'time s':>8}{'budget':>8}  figures"]
    for s in rep["steps"]:
        t = _f(s.get("seconds"), ".0f")
        line = f"{s['name']:11}{s['status'].upper() if s['status'] != 'pass' else 'pass':>8}{t:>8}" \
               f"{_f(s.get('budget_s'), '.0f'):>8}  {figures_line(s['name'], s)}"
        if s["status"] not in ("pass",) and s.get("reason"):
            line += f"  [{str(s['reason']).strip().splitlines()[-1][:140]}]"
        lines.append(line)
    if rep["targets"]:
        lines.append(f"{'targets':11}{'suite':>8}  {'figure':52}{'value':>9}  {'target':10}{'met':>5}")
        for r in rep["targets"]:
            met = "-" if r.get("met") is None else ("yes" if r["met"] else "NO")
            lines.append(f"{'':11}{r['suite']:>8}  {r['figure']:52}{_f(r.get('value'), '.3f'):>9}  {r['target']:10}"
                         f"{met:>5}")
    return "\n".join(lines)


def json_name(gpu: str | None, started: float) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", (gpu or "unknown-gpu").lower()).strip("-")
    return f"gpu_check_{slug}_{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime(started))}.json"


def write_report(rep: dict, out_dir: Path, started: float) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / json_name(rep["environment"].get("gpu"), started)
    text = json.dumps(rep, indent=2, default=str)
    path.write_text(text)
    (out_dir / "gpu_check_latest.json").write_text(text)
    return path


# ---------------------------------------------------------------- main


def _names(text: str | None) -> list[str]:
    names = [x for x in (text or "").split(",") if x]
    bad = [n for n in names if n not in RUNNERS]
    if bad:
        raise SystemExit(f"{PREFIX} error: unknown step(s) {', '.join(bad)}; steps: {', '.join(RUNNERS)}")
    return names


def budgets(pairs: list[str]) -> dict[str, float]:
    out = {s.name: float(s.budget_s) for s in STEPS}
    for pair in pairs:
        name, _, value = pair.partition("=")
        if name not in out:
            raise SystemExit(f"{PREFIX} error: --budget {pair}: unknown step {name!r}; steps: {', '.join(out)}")
        try:
            out[name] = float(value)
        except ValueError:
            raise SystemExit(f"{PREFIX} error: --budget {pair}: expected NAME=SECONDS") from None
    return out


def main(argv: list[str] | None = None, runners: dict | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="launch/gpu_check.sh", description=__doc__.splitlines()[0])
    p.add_argument("--only", default=None, help=f"comma-separated steps to run ({','.join(RUNNERS)}); env always runs")
    p.add_argument("--skip", default=None, help="comma-separated steps to leave out")
    p.add_argument("--total", type=float, default=TOTAL_S, help=f"seconds for the whole run (default {TOTAL_S:.0f})")
    p.add_argument("--budget", action="append", default=[], metavar="NAME=S", help="one step's cap (repeatable)")
    p.add_argument("--steps", type=int, default=4, help="train suite: optimizer steps per job (default 4)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench", help="where the JSON goes (docs/bench)")
    p.add_argument("--work", type=Path, default=None, help="where each step's output goes (default: a new temp dir)")
    p.add_argument("--allow-missing", action="store_true", help="run even when a package is missing")
    p.add_argument("-v", "--verbose", action="store_true", help="also stream each step's output")
    p.add_argument("--_env", action="store_true", help=argparse.SUPPRESS)  # step 1's probe process
    p.add_argument("--_prepare", default=None, help=argparse.SUPPRESS)  # the demo's prepare stages, in background
    args = p.parse_args(argv)
    if args._env:
        print(json.dumps(probe_environment(), default=str))
        return 0
    if args._prepare:
        from video_dit.train.validate import validate_file  # the launcher's own step 1

        validate_file(args._prepare, do_prepare=True, log=print)
        return 0
    runners = runners or RUNNERS
    only, skip, caps = _names(args.only), _names(args.skip), budgets(args.budget)
    started, clock0 = time.time(), time.monotonic()
    work = args.work or Path(tempfile.mkdtemp(prefix="video_dit_gpu_check_"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    ctx = Context(python=sys.executable, work=work, env=env, verbose=args.verbose, steps=args.steps)
    chosen = [s for s in STEPS if s.name == "env" or ((not only or s.name in only) and s.name not in skip)]
    print(f"{PREFIX} {len(chosen)} steps, {args.total:.0f} s in all; python {sys.executable}; output in {work}",
          flush=True)
    try:
        return _run_steps(ctx, chosen, caps, args, argv, runners, started, clock0)
    finally:
        if ctx.prepare is not None:  # the demo never got to wait for it (no time left, or a crash)
            ctx.prepare.stop()


def _run_steps(ctx: Context, chosen: list[Step], caps: dict, args, argv: list[str], runners: dict, started: float,
               clock0: float) -> int:
    records = []
    for k, step in enumerate(chosen, 1):
        left = args.total - (time.monotonic() - clock0)
        timeout = min(caps[step.name], left)
        if timeout < MIN_STEP_S:
            records.append({"name": step.name, "title": step.title, "status": "timeout", "budget_s": caps[step.name],
                            "reason": f"not started: {max(left, 0):.0f} s left of the {args.total:.0f} s total"})
            print(f"{PREFIX} step {k}/{len(chosen)}: {step.title}: not started, {max(left, 0):.0f} s left", flush=True)
            continue
        print(f"{PREFIX} step {k}/{len(chosen)}: {step.title} (budget {timeout:.0f} s)", flush=True)
        try:
            rec = runners[step.name](ctx, timeout)
        except Exception as exc:  # noqa: BLE001 - a step that cannot even start is a failed step, not a crash
            rec = {"status": "fail", "reason": f"{type(exc).__name__}: {exc}"}
        rec = {"name": step.name, "title": step.title, "budget_s": round(timeout, 1), **rec}
        records.append(rec)
        print(f"{PREFIX} step {k}/{len(chosen)}: {step.title}: {rec['status']} in {_f(rec.get('seconds'), '.0f')} s"
              + (f"  {figures_line(step.name, rec)}" if rec["status"] == "pass" else ""), flush=True)
        if rec["status"] != "pass" and rec.get("reason"):
            print("\n".join(f"{PREFIX}   | {line}" for line in str(rec["reason"]).strip().splitlines()[-15:]),
                  flush=True)
        if step.name == "env":
            probe = ctx.probe or {}
            if ctx.probe is None:
                print(f"{PREFIX} error: could not read what {sys.executable} sees of the machine (above)",
                      file=sys.stderr)
                return 2
            if not probe.get("cuda_available"):
                print(f"{PREFIX} error: {no_cuda_message(probe)}", file=sys.stderr)
                return 2
            if probe.get("missing") and not args.allow_missing:
                print(f"{PREFIX} error: {missing_message(probe['missing'])}", file=sys.stderr)
                return 2
            if "demo" in [s.name for s in chosen] and runners["demo"] is step_demo and not demo_prepared():
                start_demo_prepare(ctx)
    rep = report(ctx.probe, records, started, args.total, argv, ctx.work)
    path = write_report(rep, args.out, started)
    print(summary_table(rep))
    print(f"{PREFIX} JSON: {path} (and {args.out / 'gpu_check_latest.json'}); each step's output: {ctx.work}")
    return rep["exit_code"]


if __name__ == "__main__":
    sys.exit(main())
