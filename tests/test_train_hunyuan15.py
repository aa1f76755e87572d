"""HunyuanVideo 1.5 in the DeepSpeed trainer, on 2 CPU ranks over gloo (the tiny seeded presets, 9-frame
32x32 demo clips). One launch of tests/ranks.py's worker runs every job in one process group:
  A  t2v, ZeRO-2 LoRA, 24 steps (checkpoints every 8, a preview at the end): the loss falls; a caption
     that quotes text caches its ByT5 glyph tokens (and one without quotes none);
  B  A resumed from its step-16 checkpoint: steps 17..24 give A's losses exactly;
  C  i2v, ZeRO-3 full fine-tune (first-frame latents and SigLIP embeds cached), a preview from the held-out
     first frame, the export (Tencent's names) loads as a HunyuanVideo 1.5 DiT;
  C0 C under ZeRO-0 (no preview): the same losses and trained weights as C;
  D  C's data again, ZeRO-2 LoRA: every cache entry is there, so no VAE, text or image encoder runs;
  E  an i2v and a t2v dataset in one ZeRO-3 LoRA job: steps where one rank trains an i2v sample and the
     other a t2v one (recorded) run the same modules on both (a skipped ZeRO-3 gather would hang the job).
Then A's LoRA file (ComfyUI's fused qkv keys) equals the trained adapters, and `video-dit sample --lora`
renders it.
"""

from __future__ import annotations

import json
from pathlib import Path

import helpers
import pytest
import ranks
import torch
from safetensors.torch import load_file

from video_dit.cli import main as cli
from video_dit.data.demo import make_demo_data
from video_dit.families.hunyuan15 import FAMILY as HY15
from video_dit.families.hunyuan15.dit import HunyuanVideo15DiT
from video_dit.families.hunyuan15.loading import load_hy15_dit
from video_dit.lora import read_lora

pytestmark = pytest.mark.multirank


def hy15_job(root: Path, name: str, preset: str, *, do_i2v: bool, **kw) -> Path:
    dataset = {"folder_path": str(root / "data"), "num_frames": 9, "resolution": [32], "do_i2v": do_i2v,
               "caption_ext": "txt"}
    return helpers.write_job(root, name, datasets=[dataset], model={"preset": preset, **kw.pop("model", {})}, **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hy15")
    make_demo_data(root / "data", count=2, frames=9, size=32, seed=0, holdout=1)
    captions = sorted((root / "data").glob("*.txt"))
    captions[0].write_text(captions[0].read_text().strip() + ' with a sign that says "HELLO"')
    t2v = helpers.write_hy15_base(root / "t2v.safetensors", "tiny-hy15-t2v")
    i2v = helpers.write_hy15_base(root / "i2v.safetensors", "tiny-hy15-i2v")
    preview = {"prompt": 'a sign that says "HI"'}
    a = hy15_job(root, "a", "tiny-hy15-t2v", do_i2v=False, zero=2, steps=24, save_every=8, lr=3e-2,
                 samples=[preview], sample_every=24, model={"name_or_path": str(t2v)})
    b = hy15_job(root, "b", "tiny-hy15-t2v", do_i2v=False, zero=2, steps=24, save_every=8, lr=3e-2,
                 model={"name_or_path": str(t2v)})
    c = hy15_job(root, "c", "tiny-hy15-i2v", do_i2v=True, zero=3, network=None, steps=4, save_every=4, lr=1e-3,
                 samples=[helpers.holdout_sample(root / "data")], sample_every=4,
                 model={"name_or_path": str(i2v)})
    c0 = hy15_job(root, "c0", "tiny-hy15-i2v", do_i2v=True, zero=0, network=None, steps=4, save_every=4, lr=1e-3,
                  model={"name_or_path": str(i2v)})
    d = hy15_job(root, "d", "tiny-hy15-i2v", do_i2v=True, zero=2, steps=2, save_every=2,
                 model={"name_or_path": str(i2v)})
    make_demo_data(root / "data_t2v", count=2, frames=9, size=32, seed=1)
    mixed = [{"folder_path": str(root / name), "num_frames": 9, "resolution": [32], "do_i2v": i2v, "caption_ext": "txt"}
             for name, i2v in (("data", True), ("data_t2v", False))]
    e = helpers.write_job(root, "e", datasets=mixed, zero=3, steps=6, save_every=6,
                          model={"preset": "tiny-hy15-i2v", "name_or_path": str(i2v)})
    ranks.run_jobs(root, [{"config": str(a), "resume": "none"},
                          {"config": str(b), "resume": str(root / "out/a/checkpoints/step_000000016")},
                          {"config": str(c), "resume": "none"},
                          {"config": str(c0), "resume": "none"},
                          {"config": str(d), "resume": "none"},
                          {"config": str(e), "resume": "none", "record": True}], timeout=900)
    return root


def test_t2v_lora_loss_falls_and_glyphs_are_cached(runs):
    la = helpers.losses(runs / "out" / "a")
    assert sorted(la) == list(range(1, 25))
    first, last = sum(la[s] for s in range(1, 7)) / 6, sum(la[s] for s in range(19, 25)) / 6
    assert last < 0.8 * first, la
    texts = [load_file(str(p)) for p in (runs / "data").rglob("*.safetensors") if "text_embeds" in load_file(str(p))]
    glyph_rows = sorted(t["glyph_embeds"].shape[0] for t in texts)
    assert glyph_rows[0] == 0 and glyph_rows[-1] > 0, glyph_rows  # the quoting caption has glyph tokens
    assert all(t["text_embeds"].shape[1] == 32 and t["glyph_embeds"].shape[1] in (0, 32) for t in texts)
    assert (runs / "out/a/samples/000000024_0.mp4").stat().st_size > 0


def test_t2v_resume_gives_the_uninterrupted_losses(runs):
    la, lb = helpers.losses(runs / "out" / "a"), helpers.losses(runs / "out" / "b")
    assert sorted(lb) == list(range(17, 25))
    assert all(lb[s] == la[s] for s in lb), (la, lb)


def test_i2v_zero3_full_fine_tune_previews_and_exports(runs):
    lc = helpers.losses(runs / "out" / "c")
    assert sorted(lc) == [1, 2, 3, 4] and all(v == v for v in lc.values())
    assert (runs / "out/c/samples/000000004_0.mp4").stat().st_size > 0
    export = runs / "out/c/c"
    dit = load_hy15_dit(export)
    assert isinstance(dit, HunyuanVideo15DiT)
    base = load_file(str(runs / "i2v.safetensors"))
    trained = dit.state_dict()
    assert sorted(trained) == sorted(base)
    assert any(not torch.equal(trained[k], base[k]) for k in base)  # it trained
    cached = [load_file(str(p)) for p in (runs / "data").rglob("*.safetensors") if "latents" in load_file(str(p))]
    i2v = [t for t in cached if "first_frame_latents" in t]
    assert i2v and all(t["first_frame_latents"].shape[1] == 1 and t["image_embeds"].ndim == 2 for t in i2v)


def test_i2v_zero3_full_fine_tune_equals_zero0(runs):
    """C (ZeRO-3) and C0 (ZeRO-0): the same losses (float32 summation order: measured 1.1e-7 relative,
    tolerance 2e-6, 18x) and the same trained weights by what training changed (helpers.assert_trained_close:
    every tensor but the designed no-gradient ones trained in both; measured 2.7e-4 relative, on a bias of the
    text refiner whose few Adam steps turn rounding into a larger share of its change; tolerance 3e-3, 11x)."""
    lc, l0 = helpers.losses(runs / "out" / "c"), helpers.losses(runs / "out" / "c0")
    assert sorted(l0) == sorted(lc) == [1, 2, 3, 4]
    assert all(l0[s] == pytest.approx(lc[s], rel=2e-6) for s in lc), (lc, l0)
    base = load_file(str(runs / "i2v.safetensors"))
    c, c0 = (load_hy15_dit(runs / "out" / n / n).state_dict() for n in ("c", "c0"))
    helpers.assert_trained_close(c, c0, base=base, rtol=3e-3, untrained=helpers.hy15_no_gradient("tiny-hy15-i2v"))


def test_second_run_calls_no_encoder(runs):
    r = ranks.result(runs / "out" / "d")
    assert (r["vae_encode_calls_at_start"], r["text_encode_calls_at_start"], r["image_encode_calls_at_start"]) == (0, 0, 0)
    assert (r["vae_encode_calls"], r["text_encode_calls"], r["image_encode_calls"]) == (0, 0, 0)
    first = ranks.result(runs / "out" / "c")
    assert first["vae_encode_calls_at_start"] > 0 and first["image_encode_calls_at_start"] > 0  # C computed them


def test_ranks_training_i2v_and_t2v_samples_in_one_zero3_step(runs):
    drawn = {}  # step -> {rank: "i2v" / "t2v"}: dataset 0 (indices 0, 1) is the i2v one
    for r in (0, 1):
        for line in (runs / "out/e" / f"items_rank{r}.jsonl").read_text().splitlines():
            step, rank, indices = json.loads(line)
            drawn.setdefault(step, {})[rank] = "i2v" if indices[0] < 2 else "t2v"
    assert sorted(drawn) == list(range(1, 7))
    assert any(len(set(kinds.values())) == 2 for kinds in drawn.values()), drawn  # a step of both kinds ran
    le = helpers.losses(runs / "out" / "e")
    assert sorted(le) == list(range(1, 7)) and all(v == v for v in le.values())


def test_lora_file_fuses_qkv_and_samples(runs):
    path = runs / "out/a/a.safetensors"
    raw = load_file(str(path))
    fused = [k for k in raw if "_attn_qkv.lora_A" in k]
    assert fused and not any("_attn_q.lora" in k for k in raw)  # ComfyUI's HunyuanVideo keys
    a, b = raw[fused[0]], raw[fused[0].replace("lora_A", "lora_B")]
    assert a.shape[0] == 3 * 4 and b.shape[1] == 3 * 4
    native, alpha, rank, _ = read_lora(path, from_file=HY15.lora_from_file)  # split back: the trained rank-4 adapters
    assert (rank, alpha) == (4, 4.0)
    stream = fused[0].removeprefix("diffusion_model.").removesuffix("_attn_qkv.lora_A.weight")
    delta = b @ a  # the fused update ComfyUI applies (alpha 3a over rank 3r: the same scale)
    for i, part in enumerate("qkv"):
        own = native[f"{stream}_attn_{part}.lora_B.weight"] @ native[f"{stream}_attn_{part}.lora_A.weight"]
        rows = delta[i * own.shape[0]:(i + 1) * own.shape[0]]
        torch.testing.assert_close(rows, own)
    out = runs / "lora.mp4"  # the command, in this process (a subprocess would import torch and the package again)
    assert cli(["sample", "--model", str(runs / "t2v.safetensors"), "--preset", "tiny-hy15-t2v", "--lora", str(path),
                "--prompt", "a sign", "--frames", "5", "--height", "32", "--width", "32", "--steps", "2",
                "--out", str(out)]) == 0
    assert out.stat().st_size > 0
    assert json.dumps(native["double_blocks.0.img_attn_q.lora_A.weight"].shape)  # a real tensor came back


def test_weights_of_the_other_family_are_refused_before_any_rank(runs, tmp_path, capsys):
    """HunyuanVideo 1.5 weights under a Wan preset, and Wan weights under a HunyuanVideo 1.5 preset: exit 2
    naming the key and the file, from the headers (no rank, no tensor read)."""
    wan = helpers.write_base(tmp_path / "wan.safetensors")
    for weights, preset in ((runs / "t2v.safetensors", "tiny"), (wan, "tiny-hy15-t2v")):
        process = helpers.train_process(runs, model={"name_or_path": str(weights), "preset": preset})
        job = {"job": "extension", "config": {"name": "j", "process": [process]}}
        rc, err = helpers.validate(tmp_path, job, capsys)
        line = err.strip().splitlines()[-1]
        assert rc == 2 and "config.process[0].model" in line and str(weights) in line, err


def test_bf16_lora_storage_keeps_the_hunyuan15_float32_islands(tmp_path):
    """The trainer's build for a bf16 LoRA job (`make_trainable`, the family's cast): the frozen bulk in bf16,
    the adapters float32 masters, and HunyuanVideo 1.5's own islands (final layer, time embedders, norms)
    float32 (Wan's island names match none of them); a bf16 step then trains the adapters."""
    from PIL import Image

    from video_dit.families import get_preset
    from video_dit.families.hunyuan15 import FAMILY as HUNYUAN15
    from video_dit.train.build import build_dit, make_trainable
    from video_dit.train.config import parse_job

    (tmp_path / "data").mkdir()
    Image.new("RGB", (32, 32)).save(tmp_path / "data" / "a.png")
    base = str(helpers.write_hy15_base(tmp_path / "base.safetensors"))
    process = helpers.train_process(tmp_path, model={"name_or_path": base, "preset": "tiny-hy15-t2v"})
    process = parse_job({"job": "extension", "config": {"name": "j", "process": [process]}}).process
    preset = get_preset("tiny-hy15-t2v")
    dit = build_dit(base, preset, dtype=torch.bfloat16)
    make_trainable(dit, process, torch.bfloat16, family=HUNYUAN15)
    dtypes = {n: p.dtype for n, p in dit.named_parameters()}
    block = "double_blocks.0."
    assert dtypes[block + "img_attn_q.base_layer.weight"] == torch.bfloat16
    assert dtypes[block + "img_attn_q.lora_A.default.weight"] == torch.float32
    for island in ("final_layer.linear.weight", "time_in.mlp.0.weight", block + "img_attn_q_norm.weight",
                   "cond_type_embedding.weight"):
        assert dtypes[island] == torch.float32, island
    B, C = 1, 2 * preset.dit.in_channels + 1
    x, t = torch.randn(B, C, 2, 4, 4), torch.tensor([500.0])
    text = torch.randn(B, 5, preset.dit.text_states_dim)
    dit(x, t, text).float().square().mean().backward()
    # the video stream's adapters (the last block's text stream feeds nothing: no gradient there)
    grads = [p.grad for n, p in dit.named_parameters() if ".lora_B" in n and ".img_" in n]
    assert grads and all(g is not None and g.dtype == torch.float32 for g in grads)
    assert any(g.abs().max() > 0 for g in grads)
