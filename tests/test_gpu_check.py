"""`./launch/gpu_check.sh` (video_dit/bench/gpu_check.py) on a machine without a GPU: the pieces that
read the machine and the steps' output (driver, missing packages, JUnit XML, the demo checker's report,
the bench JSON), the report it writes and the table it prints, its exit codes, the budgets, and the
no-CUDA exit, with fake steps; the real no-CUDA path end to end (this machine has no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from video_dit.bench import gpu_check as gc

REPO = Path(__file__).resolve().parents[1]
H200 = {"cuda_available": True, "gpu": "NVIDIA H200", "gpus": [{"name": "NVIDIA H200", "memory_mib": 143771}],
        "torch": "2.11.0+cu130", "cuda": "13.0", "cudnn": 91900, "python": "3.12.3", "missing": [],
        "packages": {"deepspeed": "0.19.8", "triton": "3.6.0", "diffusers": "0.42.1"},
        "driver": {"version": "580.159.04", "source": "nvidia-smi"}}


# ---------------------------------------------------------------- reading the machine


def test_driver_version_from_nvidia_smi_else_says_where_it_looked():
    def smi(argv, **kw):
        assert argv[0] == "nvidia-smi" and "--query-gpu=driver_version,name,memory.total" in argv
        return SimpleNamespace(returncode=0, stdout="580.159.04, NVIDIA H200, 143771\n", stderr="")

    assert gc.driver_version(run=smi) == {"version": "580.159.04", "source": "nvidia-smi", "name": "NVIDIA H200",
                                          "memory_mib": 143771}

    def absent(argv, **kw):
        raise FileNotFoundError(argv[0])

    d = gc.driver_version(run=absent)  # no pynvml here either
    assert d["version"] is None and "nvidia-smi not found" in d["source"] and "NVML" in d["source"]

    def failing(argv, **kw):
        return SimpleNamespace(returncode=9, stdout="", stderr="NVIDIA-SMI has failed: no driver")

    assert "exited 9: NVIDIA-SMI has failed" in gc.driver_version(run=failing)["source"]


def test_missing_modules_names_the_distributions():
    def find(name):
        if name == "optimum.quanto":
            raise ModuleNotFoundError("No module named 'optimum'")  # find_spec of a dotted name imports its parent
        return None if name in ("av", "yaml") else object()

    assert gc.missing_modules(find=find) == ["optimum-quanto", "av", "pyyaml"]
    assert gc.missing_modules({"json": "json"}) == []


def test_last_json_line_and_file_name():
    assert gc.last_json('warning: x\n{"torch": "2.11"}\nWarning: at exit\n') == {"torch": "2.11"}
    assert gc.last_json("Traceback (most recent call last):\nImportError: torch\n") is None
    assert gc.json_name("NVIDIA H200 NVL", 0.0) == "gpu_check_nvidia-h200-nvl_19700101T000000Z.json"
    assert gc.json_name(None, 0.0).startswith("gpu_check_unknown-gpu_")


# ---------------------------------------------------------------- reading the steps' output


def test_parse_junit_counts_and_names_the_failures(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text("""<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="4" failures="1" errors="1"
      skipped="1"><testcase classname="tests.test_gpu_train" name="test_step"/>
      <testcase classname="tests.test_gpu_train" name="test_zero3"><failure message="boom"/></testcase>
      <testcase classname="tests.test_gpu_previews" name="test_mp4"><error message="fixture"/></testcase>
      <testcase classname="tests.test_gpu_train" name="test_offload"><skipped/></testcase></testsuite></testsuites>""")
    assert gc.parse_junit(xml) == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1, "failures": [
        "tests.test_gpu_train::test_zero3", "tests.test_gpu_previews::test_mp4"]}


TRAINER_REPORT = """[video_dit] step 800/800 loss 0.0123
[video_dit] demo check (output/demo_i2v_tiny/samples): shape, colour and >= 1/4 frame width of motion ...
step 0: 0/5 previews pass
  FAIL a red square moving right on a black background
step 800: {last}/5 previews pass
  ok   a red square moving right on a black background
"""


@pytest.mark.parametrize("last, first, met", [(5, 0, True), (4, 0, False)])
def test_demo_report_parsed_into_the_verdict(last, first, met):
    checks = gc.parse_demo_checks(TRAINER_REPORT.format(last=last).replace("step 0: 0/5", f"step 0: {first}/5"))
    assert checks == {0: {"pass": first, "of": 5}, 800: {"pass": last, "of": 5}}
    v = gc.demo_verdict(checks)
    assert (v["met"], v["first_step"], v["last_step"], v["last"]) == (met, 0, 800, {"pass": last, "of": 5})
    assert gc.demo_verdict({0: {"pass": 1, "of": 5}, 800: {"pass": 5, "of": 5}})["met"] is False  # step 0 must fail
    assert gc.demo_verdict({}) == {"met": False, "why": "no demo check report found"}


def test_demo_config_moves_only_the_training_folder(tmp_path):
    path = gc.demo_config(tmp_path)
    ours, shipped = yaml.safe_load(path.read_text()), yaml.safe_load((REPO / gc.DEMO_CONFIG).read_text())
    assert ours["config"]["process"][0].pop("training_folder") == str(tmp_path / "demo_output")
    shipped["config"]["process"][0].pop("training_folder")
    assert ours == shipped  # data, VAE path, steps, previews, prepare stages: the embedded default's own
    assert gc.DEMO_VAE == shipped["config"]["process"][0]["model"]["vae_path"]


def test_metrics_figures_from_the_demo_metrics(tmp_path):
    rows = [{"step": s, "loss": 1.0 / s, "step_time_s": t, "tokens_per_s": 100.0 * s, "peak_mem_gb": m}
            for s, t, m in ((1, 0.5, 1.0), (2, 0.1, 2.0), (3, 0.2, 1.5))]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"step": 0, "val_loss": 2.0}, *rows]) + "\n")
    assert gc.metrics_figures(path) == {"steps": 3, "median_step_s": 0.2, "median_tokens_per_s": 200.0,
                                        "peak_mem_gb": 2.0, "last_loss": 1.0 / 3}
    assert gc.metrics_figures(tmp_path / "absent.jsonl") == {}


def _ctx(tmp_path, **kw):
    return gc.Context(python=sys.executable, work=tmp_path, env=dict(os.environ), verbose=False, steps=4, **kw)


def test_step_bench_command_status_and_figures(tmp_path, monkeypatch):
    """The bench command (train: --steps and a budget under the step's), its JSON read back, its status."""
    seen = {}
    result = {"jobs": {"jobs": [{"name": "LoRA r32, ZeRO-2, 33x480x832", "step_s": 0.72, "tokens_per_s": 19500.0,
                                 "mfu": 0.308, "peak_bytes": 29e9, "planned_over_measured": 0.87,
                                 "step_s_all": [1.2, 0.72, 0.71, 0.73]}]}}

    def fake_run(argv, timeout, log, **kw):
        seen["argv"], seen["timeout"] = argv, timeout
        log.write_text("bench output\n")
        out = Path(argv[argv.index("--json") + 1])
        code = seen.get("code", 0)
        if code is not None:
            out.write_text(json.dumps({"meta": {}, "results": {"train": seen.get("result", result)}, "summary": []}))
        return gc.Outcome(code, 12.0, log)

    monkeypatch.setattr(gc, "run_command", fake_run)
    rec = gc.step_bench("train", _ctx(tmp_path), 95)
    argv = seen["argv"]
    assert argv[1:7] == ["-m", "video_dit.cli", "bench", "--suite", "train", "--device"] and "cuda" in argv
    assert argv[argv.index("--steps") + 1] == "4" and argv[argv.index("--budget") + 1] == "70"
    assert rec["status"] == "pass" and rec["figures"]["jobs"][0]["step_s"] == 0.72
    assert rec["bench"]["results"]["train"] == result  # the suite's whole result is kept
    assert "0.72 s 31% p/m 0.87" in gc.figures_line("train", rec)

    seen["result"] = {"error": "video_dit.bench.train does not exist in this checkout"}
    assert gc.step_bench("train", _ctx(tmp_path), 95)["status"] == "fail"
    seen["code"] = None  # killed at its budget
    rec = gc.step_bench("vae", _ctx(tmp_path), 30)
    assert rec["status"] == "timeout" and "--budget" not in rec["command"] and "--steps" not in rec["command"]


# ---------------------------------------------------------------- the run: report, table, exit codes


def _fake_env(probe):
    def run(ctx, timeout):
        ctx.probe = probe
        return {"status": "pass", "seconds": 2.0, "figures": probe}
    return run


def _fake_runners(probe=H200, demo_status="pass"):
    dit_bench = {"meta": {"device": "cuda"}, "results": {"dit": {"time_ratio": 1.143, "mfu": 0.363, "peak_ratio": 0.64,
                                                                 "rows": [], "levers": [{"lever": "compile",
                                                                                         "time_ratio": 0.9,
                                                                                         "compile_s": 41.0}]}},
                 "summary": [{"suite": "dit", "figure": "step time ours / diffusers (bf16, same attention)",
                              "value": 1.143, "target": "<= 0.8", "met": False}]}

    def bench(ctx, timeout):
        return {"status": "pass", "seconds": 30.0, "bench": dit_bench,
                "figures": gc.bench_digest("dit", dit_bench["results"]["dit"])}

    def ok(figures=None):
        return lambda ctx, timeout: {"status": "pass", "seconds": 1.0, "figures": figures or {}}

    runners = {name: ok() for name in gc.RUNNERS}
    runners.update(env=_fake_env(probe), dit=bench,
                   gpu_tests=ok({"passed": 7, "failed": 0, "errors": 0, "skipped": 1, "failures": []}),
                   demo=lambda ctx, timeout: {"status": demo_status, "seconds": 140.0, "reason": "demo check: 4/5",
                                              "figures": {"checks": {"0": {"pass": 0, "of": 5},
                                                                     "800": {"pass": 4, "of": 5}},
                                                          "vae_stage": "trained"}})
    return runners


def test_a_failed_step_does_not_stop_the_others_and_exits_1(tmp_path, capsys):
    out = tmp_path / "bench"
    code = gc.main(["--out", str(out), "--work", str(tmp_path / "work")], runners=_fake_runners(demo_status="fail"))
    assert code == 1
    files = sorted(p.name for p in out.iterdir())
    assert len(files) == 2 and files[0] == "gpu_check_latest.json"
    assert files[1].startswith("gpu_check_nvidia-h200_") and files[1].endswith("Z.json")
    rep = json.loads((out / files[1]).read_text())
    assert rep == json.loads((out / "gpu_check_latest.json").read_text())
    assert [s["name"] for s in rep["steps"]] == [s.name for s in gc.STEPS]  # every step ran after the demo failed
    assert {s["name"]: s["status"] for s in rep["steps"]}["demo"] == "fail"
    assert all(s["status"] == "pass" for s in rep["steps"] if s["name"] != "demo")
    env = rep["environment"]
    assert (env["gpu"], env["driver"]["version"], env["torch"], env["cuda"], env["packages"]["deepspeed"]) == (
        "NVIDIA H200", "580.159.04", "2.11.0+cu130", "13.0", "0.19.8")
    assert rep["targets"] == [{"suite": "dit", "figure": "step time ours / diffusers (bf16, same attention)",
                               "value": 1.143, "target": "<= 0.8", "met": False}]
    assert rep["exit_code"] == 1 and rep["total_budget_s"] == gc.TOTAL_S
    printed = capsys.readouterr().out
    for k, step in enumerate(gc.STEPS, 1):
        assert f"[gpu-check] step {k}/{len(gc.STEPS)}: {step.title}" in printed  # says which step it is on
    table = printed[printed.index("[gpu-check] summary"):]
    lines = {line.split()[0]: line for line in table.splitlines()[2:2 + len(gc.STEPS)]}  # one row per step
    assert "FAIL" in lines["demo"] and "step 0: 0/5, step 800: 4/5, VAE trained" in lines["demo"]
    assert "[demo check: 4/5]" in lines["demo"]
    assert "ours/diffusers 1.143, MFU 36.3%, peak 0.640; on/off: compile 0.90 (compile 41 s)" in lines["dit"]
    assert "7 passed, 0 failed, 1 skipped" in lines["gpu_tests"]
    assert "NVIDIA H200, driver 580.159.04, torch 2.11.0+cu130, CUDA 13.0, DeepSpeed 0.19.8" in lines["env"]
    assert table.rstrip().splitlines()[-2].endswith("NO")  # the unmet target, reported, not a failure of its own


def test_all_steps_passing_exit_0_and_only_runs_the_named_steps(tmp_path, capsys):
    runners = _fake_runners()
    assert gc.main(["--out", str(tmp_path), "--work", str(tmp_path / "w"), "--skip", "demo"], runners=runners) == 0
    rep = json.loads((tmp_path / "gpu_check_latest.json").read_text())
    assert "demo" not in [s["name"] for s in rep["steps"]] and rep["exit_code"] == 0
    assert gc.main(["--out", str(tmp_path), "--work", str(tmp_path / "w"), "--only", "dit"], runners=runners) == 0
    assert [s["name"] for s in json.loads((tmp_path / "gpu_check_latest.json").read_text())["steps"]] == ["env", "dit"]
    with pytest.raises(SystemExit, match="unknown step"):
        gc.main(["--only", "dti"], runners=runners)


def test_the_total_budget_caps_each_step_and_stops_starting_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gc, "MIN_STEP_S", 1.0)
    given = {}
    runners = _fake_runners()

    def slow_tests(ctx, timeout):
        given["gpu_tests"] = timeout
        time.sleep(1.2)
        return {"status": "pass", "seconds": 1.2}

    runners["gpu_tests"] = slow_tests
    code = gc.main(["--out", str(tmp_path), "--work", str(tmp_path / "w"), "--total", "2", "--budget", "env=5"],
                   runners=runners)
    assert code == 1 and given["gpu_tests"] <= 2.0  # capped by what was left of the total, not its own 50 s
    steps = {s["name"]: s for s in json.loads((tmp_path / "gpu_check_latest.json").read_text())["steps"]}
    assert steps["demo"]["status"] == "timeout" and steps["demo"]["reason"].startswith("not started")
    assert all(steps[s]["status"] == "timeout" for s in gc.BENCHES)
    with pytest.raises(SystemExit, match="unknown step 'dmo'"):
        gc.budgets(["dmo=30"])
    assert gc.budgets(["demo=240"])["demo"] == 240.0


def test_no_cuda_exits_2_with_torchs_words_and_writes_nothing(tmp_path, capsys):
    probe = {"cuda_available": False, "torch": "2.11.0+cu130", "cuda": "13.0", "cuda_visible_devices": "",
             "executable": "/usr/bin/python3", "cuda_error": "RuntimeError: Found no NVIDIA driver on your system."}
    runners = _fake_runners(probe)
    assert gc.main(["--out", str(tmp_path / "out")], runners=runners) == 2
    err = capsys.readouterr().err
    assert "torch sees no CUDA device: RuntimeError: Found no NVIDIA driver on your system." in err
    assert "built with CUDA 13.0, CUDA_VISIBLE_DEVICES=''" in err and not (tmp_path / "out").exists()


def test_a_missing_package_exits_2_unless_allowed(tmp_path, capsys):
    runners = _fake_runners({**H200, "missing": ["av", "optimum-quanto"]})
    assert gc.main(["--out", str(tmp_path)], runners=runners) == 2
    assert "missing packages for this Python: av, optimum-quanto" in capsys.readouterr().err
    assert gc.main(["--out", str(tmp_path), "--allow-missing"], runners=runners) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path, on a machine without CUDA")
def test_no_cuda_end_to_end_through_the_shell_entry(tmp_path):
    """./launch/gpu_check.sh with this Python: the real probe process, then exit 2 with torch's reason."""
    env = {**os.environ, "GPU_CHECK_PYTHON": sys.executable, "VIDEO_DIT_SITE": str(tmp_path / "no_site")}
    proc = subprocess.run([str(REPO / "launch" / "gpu_check.sh"), "--out", str(tmp_path / "out"), "--work",
                           str(tmp_path / "work")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"[gpu-check] python: {sys.executable}; PYTHONPATH={REPO}" in proc.stdout
    assert "[gpu-check] step 1/8: environment" in proc.stdout
    assert f"torch sees no CUDA device" in proc.stderr and f"torch {torch.__version__}" in proc.stderr
    assert not (tmp_path / "out").exists()
    probe = json.loads((tmp_path / "work" / "env.log").read_text().strip().splitlines()[-1])
    assert probe["torch"] == torch.__version__ and probe["cuda_available"] is False and "packages" in probe


def test_run_command_stops_the_whole_group_at_its_timeout(tmp_path, monkeypatch):
    monkeypatch.setattr(gc, "KILL_GRACE_S", 1.0)
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(60)\n")
    out = gc.run_command([sys.executable, "-c", code], timeout=2.0, log=tmp_path / "log", label="sleeper")
    assert out.returncode is None and 2.0 <= out.seconds < 10
    child = int(out.log.read_text().split()[0])
    for _ in range(50):  # the orphaned grandchild is reaped by init shortly after its kill
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"process {child} of the timed-out step is still alive")
    done = gc.run_command([sys.executable, "-c", "print('hi')"], timeout=30, log=tmp_path / "ok")
    assert done.returncode == 0 and done.tail().strip() == "hi"


def _fake_python(tmp_path, text: str, code: int = 0) -> str:
    """An executable standing in for the Python the demo step starts: prints `text`, exits `code`."""
    (tmp_path / "report.txt").write_text(text)
    exe = tmp_path / "fake_python"
    exe.write_text(f"#!/bin/sh\ncat '{tmp_path / 'report.txt'}'\nexit {code}\n")
    exe.chmod(0o755)
    return str(exe)


def test_step_demo_waits_for_its_prepare_then_reads_the_verdicts(tmp_path, monkeypatch):
    ctx = _ctx(tmp_path)
    ctx.python = _fake_python(tmp_path, TRAINER_REPORT.format(last=5))
    ctx.prepare = gc.Running([sys.executable, "-c", "import time; time.sleep(0.5); print('prepared')"],
                             tmp_path / "prep.log")
    rec = gc.step_demo(ctx, timeout=30)
    assert rec["status"] == "pass" and ctx.prepare is None, rec
    f = rec["figures"]
    assert f["prepare"]["returncode"] == 0 and f["prepare"]["seconds"] >= 0.5
    assert f["vae_stage"].startswith("trained") and f["checks"] == {"0": {"pass": 0, "of": 5},
                                                                     "800": {"pass": 5, "of": 5}}
    assert f["verdict"]["met"] and f["verdict_lines"] == ["step 0: 0/5 previews pass", "step 800: 5/5 previews pass"]
    assert rec["command"].endswith(f"-m video_dit.train.launcher {tmp_path / 'demo_i2v_tiny.yaml'}")

    ctx.python = _fake_python(tmp_path, TRAINER_REPORT.format(last=3))
    rec = gc.step_demo(ctx, timeout=30)
    assert rec["status"] == "fail" and "'last': {'pass': 3, 'of': 5}" in rec["reason"]
    ctx.python = _fake_python(tmp_path, "Traceback: ranks failed\n", code=1)
    rec = gc.step_demo(ctx, timeout=30)
    assert rec["status"] == "fail" and rec["returncode"] == 1 and "ranks failed" in rec["reason"]


def test_step_demo_whose_prepare_runs_out_of_time_says_how_to_make_it_once(tmp_path, monkeypatch):
    monkeypatch.setattr(gc, "KILL_GRACE_S", 1.0)
    ctx = _ctx(tmp_path)
    ctx.prepare = gc.Running([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "prep.log")
    rec = gc.step_demo(ctx, timeout=1.0)
    assert rec["status"] == "timeout" and "--only demo" in rec["reason"]
    assert rec["figures"]["prepare"]["returncode"] is None
    assert ctx.prepare is None


def test_the_demo_prepare_starts_after_the_env_step_only_when_needed(tmp_path, monkeypatch):
    events = []
    runners = _fake_runners()
    env_step, tests_step = runners["env"], runners["gpu_tests"]
    runners["env"] = lambda ctx, t: (events.append("env"), env_step(ctx, t))[1]
    runners["gpu_tests"] = lambda ctx, t: (events.append("gpu_tests"), tests_step(ctx, t))[1]
    runners["demo"] = lambda ctx, t: (events.append("demo"), {"status": "pass", "seconds": 1.0})[1]
    monkeypatch.setattr(gc, "step_demo", runners["demo"])  # main starts the prepare for the real demo step only
    monkeypatch.setattr(gc, "start_demo_prepare", lambda ctx: events.append("prepare"))
    for prepared, want in ((False, ["env", "prepare", "gpu_tests", "demo"]), (True, ["env", "gpu_tests", "demo"])):
        events.clear()
        monkeypatch.setattr(gc, "demo_prepared", lambda: prepared)
        assert gc.main(["--out", str(tmp_path), "--work", str(tmp_path / "w")], runners=runners) == 0
        assert events == want
    events.clear()
    monkeypatch.setattr(gc, "demo_prepared", lambda: False)
    gc.main(["--out", str(tmp_path), "--work", str(tmp_path / "w"), "--skip", "demo"], runners=runners)
    assert "prepare" not in events


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA path, on a machine without CUDA")
def test_the_shell_entry_uses_python3_from_path_and_says_when_it_lacks_torch(tmp_path):
    """No GPU_CHECK_PYTHON and no .venv whose torch sees CUDA (none does here: this machine has no
    CUDA, so a CI run's .venv does not count): python3 from PATH; one without torch: exit 2 saying so."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # a venv's python, wrapped
    (bin_dir / "python3").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "GPU_CHECK_PYTHON"}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", VIDEO_DIT_SITE=str(tmp_path))  # an existing site folder
    proc = subprocess.run([str(REPO / "launch" / "gpu_check.sh"), "--out", str(tmp_path / "out"), "--work",
                           str(tmp_path / "work")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "torch sees no CUDA device" in proc.stderr
    assert f"[gpu-check] python: {bin_dir / 'python3'}; PYTHONPATH={REPO}:{tmp_path}" in proc.stdout

    (bin_dir / "python3").unlink()
    (bin_dir / "python3").write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch'\" >&2\nexit 1\n")
    (bin_dir / "python3").chmod(0o755)
    proc = subprocess.run([str(REPO / "launch" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "cannot import torch" in proc.stderr
    assert "ModuleNotFoundError: No module named 'torch'" in proc.stderr and proc.stdout == ""
