"""On a GPU (`gpu` marker: skipped without CUDA; `./launch/gpu_check.sh` runs them): the DiT and
VAE equal diffusers' on CUDA (float32; in bf16 no further from a float32 run than diffusers' own
bf16), the trainer on one GPU (a ZeRO-2 LoRA and a ZeRO-3 full fine-tune in bf16: the loss falls,
a resume gives the uninterrupted losses exactly, the exports load and render), `video-dit sample
--device cuda`, the embedded default end to end with its preview checker, and with two GPUs or more
sequence parallelism SP=2 against SP=1 and ZeRO-3 over NCCL; HunyuanVideo 1.5 trained in bf16 (ZeRO-2 LoRA
resumed exactly, ZeRO-3 full fine-tune with a preview); for each family the ZeRO-2 LoRA job with
`train.compile` on (auto's choice there) against the same job eager, within bf16's own distance from float32
(compiled blocks against eager ones, every gradient: tests/test_compile.py's `gpu` cases)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import helpers
import pytest
import ranks
import torch
import yaml

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(autouse=True)
def _exact_float32():
    """float32 parity means float32: no TF32 matmuls or convolutions inside these tests."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


# ---------------------------------------------------------------- modules


def test_dit_equals_diffusers_on_cuda_and_bf16_no_worse_than_diffusers():
    from test_dit import inputs, ours_from, reference

    from video_dit.bench.common import diffusers_as_loaded
    from video_dit.families.wan.dit import cast_dit

    ref = reference(in_dim=36, out_dim=16).cuda()
    ours = ours_from(ref.cpu()).cuda()
    ref = ref.cuda()
    x, t, ctx = (v.cuda() for v in inputs(ours))
    with torch.no_grad():
        want = ref(x, t, ctx, return_dict=False)[0]
        got = ours(x, t, ctx)
        assert _rel(got, want) <= 1e-4
        truth = ours.double()(x.double(), t, ctx.double()).float()  # float64: the error scale of both bf16 runs
        ours_bf16 = cast_dit(ours_from(ref.cpu()).cuda(), torch.bfloat16)(x, t, ctx)
        ref_bf16 = diffusers_as_loaded(reference(in_dim=36, out_dim=16), torch.bfloat16).cuda()
        ref_bf16 = ref_bf16(x.bfloat16(), t, ctx.bfloat16(), return_dict=False)[0]
    assert _rel(ours_bf16, truth) <= _rel(ref_bf16, truth), (_rel(ours_bf16, truth), _rel(ref_bf16, truth))


@pytest.mark.parametrize("layout", ["wan2.1-style", "wan2.2-style"])
def test_vae_equals_diffusers_on_cuda_and_bf16_no_worse_than_diffusers(layout):
    from test_vae import CONFIGS, _reference_and_ours, _video

    cfg = CONFIGS[layout]
    ref, ours = (m.cuda() for m in _reference_and_ours(cfg))
    s = cfg.spatial_compression
    video = _video(9, 2 * s, 3 * s).cuda()
    with torch.no_grad():
        post, post_ref = ours.encode(video), ref.encode(video).latent_dist
        assert _rel(post.mean, post_ref.mean) <= 1e-4
        z = post_ref.mean
        assert _rel(ours.decode(z), ref.decode(z).sample.clamp(-1, 1)) <= 1e-4
        truth = ours.double().decode(z.double()).float()
        ours_bf16 = ours.to(torch.bfloat16).decode(z.bfloat16())
        ref_bf16 = ref.to(torch.bfloat16).decode(z.bfloat16()).sample.clamp(-1, 1)
    assert _rel(ours_bf16, truth) <= _rel(ref_bf16, truth) * 1.05


# ---------------------------------------------------------------- the trainer on one GPU


@pytest.fixture(scope="module")
def one_gpu_runs(tmp_path_factory):
    """The ZeRO-2 LoRA and the ZeRO-3 full fine-tune of tests/test_train_bf16.py, on GPU 0 (bf16 on a
    GPU without train.cpu_bf16), each uninterrupted and resumed from its step-4 checkpoint; and in the same
    launch the HunyuanVideo 1.5 jobs (`_hy15_jobs`, under hy15/)."""
    from test_train_bf16 import CI, _job, _jobs

    world = helpers.make_world(tmp_path_factory.mktemp("gpu_bf16"))
    (world / "hy15").mkdir()
    lora = str(_job(world, "lora_z2", *CI["lora_z2"]))  # compiled: train.compile auto on a GPU under ZeRO-2
    twins = [{"config": str(_twin(lora, "lora_z2_eager", compile=False))},
             {"config": str(_twin(lora, "lora_z2_fp32", dtype="fp32")), "stop_at": 2}]
    _, logs, _ = ranks.run_jobs(world, _jobs(world, CI) + twins + _hy15_jobs(world / "hy15"), world=1,
                                env={"CUDA_VISIBLE_DEVICES": "0"}, timeout=1200)
    (world / "launch.log").write_text(logs)
    return world


def _twin(config: str, name: str, **train) -> Path:
    """A copy of the job file `config` named `name` (its own output folder) with `train` keys changed."""
    job = yaml.safe_load(Path(config).read_text())
    job["config"]["name"] = name
    job["config"]["process"][0]["train"].update(train)
    path = Path(config).with_name(f"{name}.yaml")
    path.write_text(yaml.safe_dump(job))
    return path


def test_one_gpu_bf16_trains_resumes_exactly_and_exports_render(one_gpu_runs):
    from test_train_bf16 import CI, _computes_in_bf16_and_the_loss_falls, _exports_load_and_render, _resumes_exactly

    _computes_in_bf16_and_the_loss_falls(one_gpu_runs, CI, world=1)
    _resumes_exactly(one_gpu_runs, CI)
    _exports_load_and_render(one_gpu_runs, CI)


def _hy15_jobs(root: Path) -> list[dict]:
    """HunyuanVideo 1.5 on the GPU in bf16 (tests/test_train_hunyuan15.py's tiny presets and data, under
    `root`): a ZeRO-2 t2v LoRA, the same job resumed from its step-6 checkpoint, and a ZeRO-3 i2v full
    fine-tune with a preview. Run in `one_gpu_runs`' launch (a launch costs more than these steps)."""
    from test_train_hunyuan15 import hy15_job

    from video_dit.data.demo import make_demo_data

    make_demo_data(root / "data", count=2, frames=9, size=32, seed=0, holdout=1)
    t2v = helpers.write_hy15_base(root / "t2v.safetensors", "tiny-hy15-t2v")
    i2v = helpers.write_hy15_base(root / "i2v.safetensors", "tiny-hy15-i2v")
    bf16 = {"dtype": "bf16"}
    a, b = (hy15_job(root, name, "tiny-hy15-t2v", do_i2v=False, zero=2, steps=12, save_every=6, lr=3e-2, train=bf16,
                     model={"name_or_path": str(t2v)}) for name in ("a", "b"))
    eager, fp32 = _twin(str(a), "a_eager", compile=False), _twin(str(a), "a_fp32", dtype="fp32")
    c = hy15_job(root, "c", "tiny-hy15-i2v", do_i2v=True, zero=3, network=None, steps=4, save_every=4, lr=1e-3,
                 train=bf16, samples=[helpers.holdout_sample(root / "data")], sample_every=4,
                 model={"name_or_path": str(i2v)})
    return [{"config": str(a), "resume": "none"},
            {"config": str(b), "resume": str(root / "out/a/checkpoints/step_000000006")},
            {"config": str(c), "resume": "none"},
            {"config": str(eager), "resume": "none"},
            {"config": str(fp32), "resume": "none", "stop_at": 2}]


def test_hunyuan15_bf16_trains_resumes_exactly_and_previews(one_gpu_runs):
    root = one_gpu_runs / "hy15"
    for name in ("a", "c"):
        res = ranks.result(root / "out" / name)
        assert res["dtype"] == "torch.bfloat16" and res["linear_output_dtypes"] == ["torch.bfloat16"], (name, res)
    la, lb = helpers.losses(root / "out/a"), helpers.losses(root / "out/b")
    assert sorted(la) == list(range(1, 13)) and sum(la[s] for s in (10, 11, 12)) < sum(la[s] for s in (1, 2, 3)), la
    assert all(lb[s] == la[s] for s in range(7, 13)), (la, lb)  # the resume draws and computes what A did
    assert (root / "out/c/samples/000000004_0.mp4").stat().st_size > 0


@pytest.mark.parametrize("family", ["wan", "hunyuan15"])
def test_compiled_training_tracks_eager(one_gpu_runs, family):
    """`train.compile` on (auto's choice for a GPU under ZeRO-2, logged) against the same bf16 job eager: each
    of the first two steps' losses no further from eager's than twice bf16's own distance from the float32
    job's, plus 2^-8 relative (tests/kernel_cases.assert_dit_tracks' bound for one step); afterwards the two
    runs may drift apart like any two bf16 orders of summation, so later: the eager run trains as the compiled
    one is checked to (the held-out loss falls; HunyuanVideo's last steps' losses below its first ones)."""
    root, job = (one_gpu_runs, "lora_z2") if family == "wan" else (one_gpu_runs / "hy15", "a")
    assert "torch.compile of the DiT's blocks included (train.compile)" in (one_gpu_runs / "launch.log").read_text()
    on, off, fp32 = (helpers.losses(root / "out" / n) for n in (job, f"{job}_eager", f"{job}_fp32"))
    assert sorted(on) == sorted(off) and sorted(fp32) == [1, 2]
    for s in (1, 2):
        bound = 2 * abs(off[s] - fp32[s]) + 2 ** -8 * abs(fp32[s])
        assert abs(on[s] - off[s]) <= bound, (family, s, on[s], off[s], fp32[s])
    if family == "wan":
        rows = {r["step"]: r for r in helpers.metrics(root / "out" / f"{job}_eager")}
        assert rows[8]["val_loss"] < 0.95 * rows[0]["val_loss"], rows
    else:
        assert sum(off[s] for s in (10, 11, 12)) < sum(off[s] for s in (1, 2, 3)), off


def test_sample_on_cuda(tmp_path):
    """`video-dit sample --device cuda`: the tiny preset renders on the GPU; its frames are the CPU
    render's (the same noise, drawn on the CPU; the same model), up to float rounding."""
    from video_dit.cli import main as cli
    from video_dit.media import read_video_frames

    args = ["sample", "--model", "preset:tiny", "--prompt", "a red square", "--frames", "9", "--height", "32",
            "--width", "32", "--steps", "4", "--seed", "3"]
    assert cli([*args, "--device", "cuda", "--out", str(tmp_path / "gpu.mp4")]) == 0
    assert cli([*args, "--device", "cpu", "--out", str(tmp_path / "cpu.mp4")]) == 0
    gpu, cpu = (torch.from_numpy(read_video_frames(tmp_path / f"{d}.mp4")).float() for d in ("gpu", "cpu"))
    assert gpu.shape == cpu.shape == (9, 32, 32, 3)
    assert (gpu - cpu).abs().mean() <= 2.0  # /255: the codec's rounding of equal frames, not another video


# ---------------------------------------------------------------- the embedded default


@pytest.mark.slow
def test_embedded_default_end_to_end(tmp_path):
    """`configs/demo_i2v_tiny.yaml` through the launcher on this machine's GPUs (its data and outputs in
    a temporary folder): exit 0, the checker passes every held-out preview at the last step and none at
    step 0."""
    cfg = yaml.safe_load((ROOT / "configs" / "demo_i2v_tiny.yaml").read_text())
    text = yaml.safe_dump(cfg)
    for rel in ("data/", "output/"):  # the job's relative paths, under the temporary folder
        text = re.sub(rf"(?<![\w/]){rel}", f"{tmp_path}/{rel}", text)
    job = tmp_path / "demo.yaml"
    job.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "video_dit.train.launcher", str(job)], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    steps = dict(re.findall(r"step (\d+): (\d+)/\d+ previews pass", out))
    assert steps.get("0") == "0" and steps.get("800") == "5", (steps, out[-4000:])


# ---------------------------------------------------------------- two GPUs or more


@pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")
def test_two_gpus_sequence_parallel_equals_sp1_and_zero3_over_nccl(tmp_path):
    """SP=2 over 2 GPUs computes what SP=1 computes (the same losses up to bf16 summation order), and
    a ZeRO-3 LoRA job over NCCL on 2 GPUs trains (its loss falls) and resumes exactly."""
    world = helpers.make_world(tmp_path, count=4)
    common = dict(steps=4, save_every=2, keep=2, lr=5e-2, train={"dtype": "bf16"})
    sp1 = helpers.write_job(world, "sp1", zero=2, **common)
    sp2 = helpers.write_job(world, "sp2", zero=2, deepspeed={"sequence_parallel_size": 2}, **common)
    z3 = helpers.write_job(world, "z3", zero=3, **common)
    z3r = helpers.write_job(world, "z3_resumed", zero=3, **common)
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    ranks.run_jobs(world, [{"config": str(sp1)}], world=1, env={"CUDA_VISIBLE_DEVICES": "0"}, timeout=1200)
    ranks.run_jobs(world, [{"config": str(sp2)}, {"config": str(z3)},
                           {"config": str(z3r), "resume": str(world / "out/z3/checkpoints/step_000000002")}],
                   world=2, env=env, timeout=1200)
    a, b = helpers.losses(world / "out/sp1"), helpers.losses(world / "out/sp2")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert all(b[s] == pytest.approx(a[s], rel=2e-2) for s in a), (a, b)
    z, zr = helpers.losses(world / "out/z3"), helpers.losses(world / "out/z3_resumed")
    assert z[4] < z[1] and all(zr[s] == z[s] for s in (3, 4)), (z, zr)
