"""HunyuanVideo 1.5 sampling end to end against diffusers' pipelines, the family registry, and the bad
input refused before any model loads.

Tiny random diffusers folders (written by `HunyuanVideo15Pipeline.save_pretrained` /
`HunyuanVideo15ImageToVideoPipeline.save_pretrained`: transformer, VAE, Qwen2.5-VL + ByT5 text encoders
and their tokenizers, scheduler, guider; i2v: SigLIP + its processor) are sampled by diffusers in memory
and by us from the folder (our loaders, `HunyuanVideo15Pipeline`, `video-dit sample`), with the same
prompts, seed (or initial latents) and settings: the same latents and frames (fp32, within LATENT_ATOL and
FRAME_ATOL: 1% more guidance, or a latent statistic off by 1% of its std, fails them). diffusers hard-codes
the Qwen template crop (108, the real tokenizer's); its pipelines are given ours for the tiny tokenizer, as
tests/test_hunyuan15_encoders.py does. The prompts quote text (the ByT5 glyph path) and the negative prompt
does not (the one place Tencent and diffusers differ there).
"""

import json
from dataclasses import replace

import helpers
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import ByT5Tokenizer

from video_dit.cli import main as cli
from video_dit.families import FAMILIES, PRESETS, get_family, get_preset, identify
from video_dit.families.hunyuan15 import FAMILY as HUNYUAN15
from video_dit.families.hunyuan15 import encoders as H
from video_dit.families.hunyuan15.convert import hy15_config_to_diffusers, hy15_to_comfy, hy15_to_diffusers
from video_dit.families.hunyuan15.convert_vae import hy15_vae_config_to_diffusers
from video_dit.families.hunyuan15.pipeline import HunyuanVideo15Pipeline, fit_image
from video_dit.families.hunyuan15.presets import TINY_HY15_DIT
from video_dit.families.wan import FAMILY as WAN
from video_dit.families.wan.loading import load_dit
from video_dit.media import write_video
from video_dit.spec import AITK_KEYS, CLI_KEYS, JOB_KEYS, Request, resolve
from video_dit.typed_config import ConfigError

diffusers = pytest.importorskip("diffusers")

FRAMES, HEIGHT, WIDTH, STEPS, SHIFT, CFG, SEED = 5, 32, 48, 3, 4.0, 3.0, 5
PROMPT, NEGATIVE = 'a neon sign saying "OPEN" flickers', "blurry, low quality"
TARGET_SIZE = 48  # diffusers' i2v size from the image: a 48 x 32 image stays 48 x 32 (its aspect bucket)
# Tolerances from the measured errors (2-core x86 CPU, torch 2.13, diffusers 0.42.1): latents (magnitude 3-4)
# measured max |diff| 9.4e-6 (t2v), 9.8e-6 (i2v), 8.7e-6 (step-distilled), tolerance 1e-4 (10x); 1% more
# guidance moves them 2.7e-3 or more. Frames (in [0, 1]) measured 6.1e-6 (t2v), 5.3e-6 (i2v), tolerance 6e-5
# (10x); a latent statistic off by 1% of its std moves them 3.3e-3 or more.
LATENT_ATOL, FRAME_ATOL = 1e-4, 6e-5


def _transformer(cfg, seed: int):
    """A diffusers HunyuanVideo15Transformer3DModel of `cfg`, every weight random (the zero-initialised
    adaLN and output layers would hide the blocks): Linear / conv N(0, 1/fan_in), biases N(0, 0.05), norm
    scales 1 + N(0, 0.1)."""
    torch.manual_seed(seed)
    ref = diffusers.HunyuanVideo15Transformer3DModel(**hy15_config_to_diffusers(cfg), target_size=TARGET_SIZE).eval()
    return helpers.randomize_all(ref, seed=seed, norm_std=0.1, vector_std=0.05)


def _pipe(kind: str, transformer=None):
    """diffusers' pipeline of `kind` (t2v | i2v) over the tiny components; the text crop set to ours."""
    torch.manual_seed(1)
    vae = diffusers.AutoencoderKLHunyuanVideo15(**hy15_vae_config_to_diffusers(get_preset("tiny-hy15-t2v").vae)).eval()
    parts = dict(text_encoder=H.tiny_qwen_text_model(2), tokenizer=H.tiny_qwen_tokenizer(), vae=vae,
                 transformer=transformer if transformer is not None else _transformer(TINY_HY15_DIT, 3),
                 scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=SHIFT),
                 text_encoder_2=H.tiny_t5_encoder(2), tokenizer_2=ByT5Tokenizer(),
                 guider=diffusers.ClassifierFreeGuidance(guidance_scale=CFG))
    if kind == "t2v":
        pipe = diffusers.HunyuanVideo15Pipeline(**parts)
    else:
        pipe = diffusers.HunyuanVideo15ImageToVideoPipeline(**parts, image_encoder=H.tiny_siglip(4),
                                                            feature_extractor=H.siglip_processor(32))
    pipe.prompt_template_encode_start_idx = H.tiny_hy15_text_encoder().crop_start
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for kind in ("t2v", "i2v"):
        pipe = _pipe(kind)
        folder = tmp_path_factory.mktemp(f"hy15_{kind}")
        pipe.save_pretrained(folder)
        out[kind] = (pipe, folder)
    return out


def _image(seed: int = 7) -> Image.Image:
    arr = np.random.default_rng(seed).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)
    return Image.fromarray(arr)


def _latents(seed: int = 9) -> torch.Tensor:
    z = get_preset("tiny-hy15-t2v").vae.z_dim
    return torch.randn(1, z, (FRAMES - 1) // 4 + 1, HEIGHT // 16, WIDTH // 16, generator=torch.Generator().manual_seed(seed))


def _ours(folder, kind: str):
    """Our pipeline and prompt embeds, everything read from the diffusers folder."""
    te = HUNYUAN15.load_text_encoder(folder)
    prompt, negative = te.encode([PROMPT, NEGATIVE])
    assert prompt.glyph.shape[0] > 0 and negative.glyph.shape[0] == 0  # the glyph path is exercised
    image_encoder = HUNYUAN15.load_image_encoder(folder) if kind == "i2v" else None
    pipe = HunyuanVideo15Pipeline(HUNYUAN15.load_dit(folder).eval(), HUNYUAN15.load_vae(folder).eval(),
                                  image_encoder=image_encoder)
    return pipe, prompt, negative


def _reference(pipe, kind: str, **kw):
    args = dict(prompt=PROMPT, negative_prompt=NEGATIVE, num_frames=FRAMES, num_inference_steps=STEPS,
                return_dict=False, **kw)
    if kind == "t2v":
        args.update(height=HEIGHT, width=WIDTH)
    else:
        args.update(image=_image())
    with torch.no_grad():
        return pipe(**args)[0]


@pytest.mark.parametrize("kind", ["t2v", "i2v"])
def test_latents_equal_diffusers(folders, kind):
    pipe, folder = folders[kind]
    ours, prompt, negative = _ours(folder, kind)
    latents = _latents()
    ref = _reference(pipe, kind, latents=latents.clone(), output_type="latent")
    z, more = (ours.generate_latents(prompt, negative, num_frames=FRAMES, height=HEIGHT, width=WIDTH, steps=STEPS,
                                     guidance_scale=cfg, shift=SHIFT, latents=latents,
                                     first_frame=_image() if kind == "i2v" else None) for cfg in (CFG, 1.01 * CFG))
    assert float((ref - latents).abs().mean()) > 0.05  # the steps moved them
    torch.testing.assert_close(z, ref, rtol=0, atol=LATENT_ATOL)
    assert (more - ref).abs().max() > LATENT_ATOL  # the comparison sees 1% more guidance


def test_step_distilled_i2v_latents_equal_diffusers(folders, tmp_path):
    """The step-distilled DiT (use_meanflow) is told the next timestep too: 0 at the last step."""
    pipe, folder = folders["i2v"]
    meanflow = _transformer(replace(TINY_HY15_DIT, use_meanflow=True), 5)
    meanflow.save_pretrained(tmp_path / "transformer")
    ours, prompt, negative = _ours(folder, "i2v")
    ours.dit = HUNYUAN15.load_dit(tmp_path).eval()
    ours.dit_config = ours.dit.config
    assert ours.dit_config.use_meanflow
    saved, pipe.transformer = pipe.transformer, meanflow
    try:
        ref = _reference(pipe, "i2v", latents=_latents(), output_type="latent")
    finally:
        pipe.transformer = saved
    z, more = (ours.generate_latents(prompt, negative, num_frames=FRAMES, height=HEIGHT, width=WIDTH, steps=STEPS,
                                     guidance_scale=cfg, shift=SHIFT, latents=_latents(), first_frame=_image())
               for cfg in (CFG, 1.01 * CFG))
    torch.testing.assert_close(z, ref, rtol=0, atol=LATENT_ATOL)
    assert (more - ref).abs().max() > LATENT_ATOL  # the comparison sees 1% more guidance


@pytest.mark.parametrize("kind", ["t2v", "i2v"])
def test_sample_command_gives_diffusers_frames(folders, kind, tmp_path, capsys):
    """`video-dit sample --model FOLDER` reads the folder's scheduler (shift) and guider (guidance) configs,
    draws the seed's noise as diffusers does, and renders the frames of our Python API (the MP4 bytes are
    equal), whose frames are diffusers' within FRAME_ATOL."""
    pipe, folder = folders[kind]
    args = ["sample", "--model", str(folder), "--prompt", PROMPT, "--negative", NEGATIVE, "--frames", str(FRAMES),
            "--height", str(HEIGHT), "--width", str(WIDTH), "--steps", str(STEPS), "--seed", str(SEED)]
    if kind == "i2v":
        _image().save(tmp_path / "first.png")
        args += ["--image", str(tmp_path / "first.png")]
    assert cli(args + ["--out", str(tmp_path / "cli.mp4")]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("sampling:"))
    assert line == (f"sampling: euler, {STEPS} steps, shift {SHIFT:g}, guidance {CFG:g}, negative prompt "
                    f"{NEGATIVE!r} [solver, shift: {folder / 'scheduler' / 'scheduler_config.json'}; steps: --steps; "
                    f"guidance: {folder / 'guider' / 'guider_config.json'}; negative: --negative]")
    assert f"({kind}, {FRAMES} frames, {WIDTH}x{HEIGHT}, 24 fps)" in out

    ours, prompt, negative = _ours(folder, kind)
    first = _image() if kind == "i2v" else None
    z = ours.generate_latents(prompt, negative, num_frames=FRAMES, height=HEIGHT, width=WIDTH, steps=STEPS,
                              guidance_scale=CFG, shift=SHIFT, first_frame=first,
                              generator=torch.Generator().manual_seed(SEED))
    write_video(ours.decode(z)[0], tmp_path / "api.mp4", fps=24)
    assert (tmp_path / "cli.mp4").read_bytes() == (tmp_path / "api.mp4").read_bytes()

    ref = _reference(pipe, kind, generator=torch.Generator().manual_seed(SEED), output_type="np")

    def frames(latents):  # diffusers' "np" output
        with torch.no_grad():
            video = ours.vae.decode(ours.vae.denormalize(latents))  # (1, 3, F, H, W) in [-1, 1]
        return (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).numpy()

    got = frames(z)
    assert got.shape == ref.shape == (1, FRAMES, HEIGHT, WIDTH, 3)
    assert float(np.std(ref)) > 0.02  # not a flat video: the comparison means something
    np.testing.assert_allclose(got, ref, rtol=0, atol=FRAME_ATOL)
    off = z.clone()
    off[:, 0] += 0.01  # as if channel 0's latent mean were off by 1% of its std
    assert np.abs(frames(off) - ref).max() > FRAME_ATOL  # the comparison sees a latent statistic off


def test_conditioning_object_conditions_some_samples_of_a_batch():
    """`HY15Conditioning` (the object training will reuse): a sample left out of `active` is exactly t2v,
    in its input (zero condition, mask 0) and through the DiT (its SigLIP rows masked out)."""
    from video_dit.families.hunyuan15.conditioning import HY15Conditioning

    dit = _randomized(HUNYUAN15.load_dit("preset:tiny-hy15-i2v"))
    g = torch.Generator().manual_seed(0)
    noisy, t = torch.randn(2, 4, 2, 2, 3, generator=g), torch.tensor([700.0, 300.0])
    cond = {"first_frame_latents": torch.randn(2, 4, 1, 2, 3, generator=g), "image_embeds": torch.randn(2, 16, 32, generator=g)}
    text = torch.randn(2, 5, 32, generator=g)
    c = HY15Conditioning()
    x, t_out, mask = c.apply(noisy, t, cond, active=torch.tensor([True, False]))
    assert x.shape == (2, 9, 2, 2, 3) and torch.equal(t_out, t) and bool((mask == 1).all())
    assert torch.equal(x[0, 4:8, 0], cond["first_frame_latents"][0, :, 0]) and not x[0, 4:8, 1:].any()
    assert bool((x[0, 8, 0] == 1).all()) and not x[0, 8, 1:].any() and not x[1, 4:].any()
    with torch.no_grad():
        mixed = dit(x, t, text, **c.dit_kwargs(cond, active=torch.tensor([True, False])))
        t2v = dit(c.apply(noisy[1:], t[1:])[0], t[1:], text[1:])
        i2v = dit(c.apply(noisy[:1], t[:1], {k: v[:1] for k, v in cond.items()})[0], t[:1], text[:1],
                  **c.dit_kwargs({k: v[:1] for k, v in cond.items()}))
    torch.testing.assert_close(mixed[1:], t2v, rtol=0, atol=1e-5)
    torch.testing.assert_close(mixed[:1], i2v, rtol=0, atol=1e-5)
    assert not torch.allclose(i2v, dit(c.apply(noisy[:1], t[:1])[0], t[:1], text[:1]), atol=1e-3)  # the frame matters


def _randomized(dit):
    """The seeded DiT with its zero-initialised output and modulation layers drawn (else it predicts 0)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in dit.named_parameters():
            if not p.any():
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return dit.eval()


def test_tencent_layout_samples_as_the_diffusers_folder(folders, tmp_path, capsys):
    """Tencent's layout (ckpts/transformer/<variant>/ with its config.json and native keys, ckpts/vae/ with
    AutoencoderKLConv3D's config), written from the t2v folder's weights, with the encoders of the diffusers
    folder (--text-encoder): the same MP4 as the diffusers folder, the task read from `ideal_task`."""
    from dataclasses import asdict

    from safetensors.torch import save_file

    from video_dit.families.hunyuan15.convert import hy15_from_diffusers
    from video_dit.families.hunyuan15.convert_vae import hy15_vae_from_diffusers
    from video_dit.models.weights import read_state_dict

    _, folder = folders["t2v"]
    variant, vae = tmp_path / "ckpts" / "transformer" / "480p_t2v", tmp_path / "ckpts" / "vae"
    variant.mkdir(parents=True)
    vae.mkdir()
    save_file(hy15_from_diffusers(read_state_dict(folder / "transformer")), variant / "diffusion_pytorch_model.safetensors")
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(TINY_HY15_DIT).items()}
    (variant / "config.json").write_text(json.dumps({"_class_name": "HunyuanVideo_1_5_DiffusionTransformer",
                                                     "ideal_task": "t2v", "ideal_resolution": "480p", **config}))
    save_file(hy15_vae_from_diffusers(read_state_dict(folder / "vae")), vae / "diffusion_pytorch_model.safetensors")
    v = get_preset("tiny-hy15-t2v").vae
    (vae / "config.json").write_text(json.dumps({
        "_class_name": "AutoencoderKLConv3D", "in_channels": 3, "out_channels": 3, "latent_channels": v.latent_channels,
        "block_out_channels": list(v.block_out_channels), "layers_per_block": v.layers_per_block,
        "ffactor_spatial": 16, "ffactor_temporal": 4, "scaling_factor": v.scaling_factor}))
    spec = resolve(Request(str(variant), text_encoder=str(folder), preset_required=False), CLI_KEYS)
    assert spec.family is HUNYUAN15 and spec.vae == str(vae) and spec.task[0] == "t2v" and "ideal_task" in spec.task[1]

    common = ["--prompt", PROMPT, "--negative", NEGATIVE, "--frames", str(FRAMES), "--height", str(HEIGHT), "--width",
              str(WIDTH), "--steps", str(STEPS), "--shift", str(SHIFT), "--cfg", str(CFG), "--seed", str(SEED)]
    assert cli(["sample", "--model", str(folder), *common, "--out", str(tmp_path / "diffusers.mp4")]) == 0
    assert cli(["sample", "--model", str(variant), "--text-encoder", str(folder), *common,
                "--out", str(tmp_path / "tencent.mp4")]) == 0
    assert (tmp_path / "tencent.mp4").read_bytes() == (tmp_path / "diffusers.mp4").read_bytes()
    capsys.readouterr()


def test_fit_image_is_tencents_resize_and_centre_crop():
    """Tencent's `get_image_condition_latents`: scale = max(W / w0, H / h0), resize to the rounded sides
    with LANCZOS, then torchvision's CenterCrop (top = round((h1 - H) / 2)); the numbers worked by hand
    for a 70 x 50 image. An image of the video's size is left as it is."""
    image = Image.fromarray(np.random.default_rng(1).integers(0, 256, (50, 70, 3), dtype=np.uint8))
    for (h, w), (w1, h1), (left, top) in (((32, 48), (48, 34), (0, 1)),  # scale 48/70: 34.3 -> 34 high
                                          ((48, 32), (67, 48), (18, 0)),  # scale 48/50 = 0.96: 67.2 -> 67
                                          ((64, 64), (90, 64), (13, 0))):  # scale 64/50 = 1.28: 89.6 -> 90
        expected = image.resize((w1, h1), Image.LANCZOS).crop((left, top, left + w, top + h))
        assert np.array_equal(np.asarray(fit_image(image, h, w)), np.asarray(expected)), (h, w)
    same = Image.fromarray(np.asarray(image)[:32, :48])
    assert np.array_equal(np.asarray(fit_image(same, 32, 48)), np.asarray(same))


# ---------------------------------------------------------------- the family registry

def test_registry_every_preset_has_a_family_and_dispatches(tmp_path):
    from safetensors.torch import save_file

    assert set(FAMILIES) == {"wan", "hunyuan15", "ltx2", "minimax_h3"} and all(p.family in FAMILIES for p in PRESETS.values())
    assert {n for n in PRESETS if PRESETS[n].family == "hunyuan15"} >= {"tiny-hy15-t2v", "tiny-hy15-i2v",
                                                                        "hunyuan15-480p-t2v", "hunyuan15-480p-i2v"}
    assert type(get_family(get_preset("tiny-hy15-t2v").family).load_dit("preset:tiny-hy15-t2v")).__name__ \
        == "HunyuanVideo15DiT"  # by the preset's family
    assert type(load_dit("preset:tiny")).__name__ == "VideoDiT"
    # a checkpoint's family from its tensor names, in every layout; Wan's stays Wan's
    sd = {k: v.contiguous() for k, v in HUNYUAN15.load_dit("preset:tiny-hy15-t2v").state_dict().items()}
    for name, layout in (("native", sd), ("diffusers", hy15_to_diffusers(sd)),
                         ("comfy", hy15_to_comfy(sd, "model.diffusion_model."))):
        save_file(layout, tmp_path / f"{name}.safetensors")
        assert identify(tmp_path / f"{name}.safetensors")[0] is HUNYUAN15, name
    wan = tmp_path / "wan" / "dit.safetensors"
    wan.parent.mkdir()
    save_file({k: v.contiguous() for k, v in load_dit("preset:tiny").state_dict().items()}, wan)
    assert identify(wan)[0] is WAN
    spec = resolve(Request(str(wan), preset_required=False), CLI_KEYS)
    assert (spec.family_name, spec.task, spec.i2v_mode) == ("wan", None, "replace")


def test_a_diffusers_folder_resolves_to_its_family_and_task(folders):
    for kind in ("t2v", "i2v"):
        _, folder = folders[kind]
        spec = resolve(Request(str(folder), preset_required=False), CLI_KEYS)
        assert spec.family is HUNYUAN15 and spec.task[0] == kind and "model_index.json" in spec.task[1]
        assert spec.i2v_mode == ("concat" if kind == "i2v" else None)
        assert (spec.vae, spec.text_encoder) == (str(folder), str(folder))
        assert spec.image_encoder == (str(folder) if kind == "i2v" else None)
        assert spec.dit_config == TINY_HY15_DIT


# ---------------------------------------------------------------- bad input: exit 2 before any model loads

@pytest.fixture
def no_loading(monkeypatch):
    """Any model load is a test failure (an AssertionError is no user error: it is not turned into exit 2)."""
    import dataclasses

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    for name, family in list(FAMILIES.items()):  # every family's loaders, as the front ends reach them
        monkeypatch.setitem(FAMILIES, name, dataclasses.replace(
            family, load_text_encoder=refuse, load_image_encoder=refuse, load_dit=refuse, load_vae=refuse))


def _wrong_width_siglip(tmp_path):
    from transformers import SiglipVisionConfig, SiglipVisionModel

    folder = tmp_path / "siglip48"
    SiglipVisionModel(SiglipVisionConfig(hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, image_size=32, patch_size=8)).save_pretrained(
        folder / "image_encoder")
    return folder


def _wan_file(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "wan_dit.safetensors"
    save_file({k: v.contiguous() for k, v in helpers.tiny_dit().state_dict().items()}, path)
    return path


@pytest.mark.parametrize("case", ["hy15_weights_wan_preset", "wan_weights_hy15_preset", "image_on_t2v",
                                  "i2v_preset_on_t2v", "no_image_on_i2v", "siglip_width"])
def test_bad_input_exits_2_naming_file_key_and_accepted(folders, tmp_path, capsys, no_loading, case):
    t2v, i2v = str(folders["t2v"][1]), str(folders["i2v"][1])
    _image().save(tmp_path / "first.png")
    image = ["--image", str(tmp_path / "first.png")]
    args, expected = {
        "hy15_weights_wan_preset": (["--model", t2v, "--preset", "wan2.1-t2v-1.3b"],
                                    ["--preset wan2.1-t2v-1.3b: is a Wan 2.1 / 2.2 preset", f"{t2v}/model_index.json",
                                     "'HunyuanVideo15Pipeline'", "accepted: hunyuan15-480p-t2v", "or no --preset"]),
        "wan_weights_hy15_preset": (["--model", str(_wan_file(tmp_path)), "--preset", "hunyuan15-480p-t2v"],
                                    ["--preset hunyuan15-480p-t2v: is a HunyuanVideo 1.5 preset", "wan_dit.safetensors",
                                     "holds Wan 2.1 / 2.2 weights", "accepted: tiny, wan2.1-t2v-1.3b"]),
        "image_on_t2v": (["--model", t2v, *image],
                         [f"--image {tmp_path / 'first.png'}", f"{t2v}/model_index.json: _class_name "
                          "'HunyuanVideo15Pipeline'", "a text-to-video checkpoint",
                          "accepted: an image-to-video checkpoint"]),
        "i2v_preset_on_t2v": (["--model", t2v, "--preset", "hunyuan15-480p-i2v", *image],
                              ["--preset hunyuan15-480p-i2v: is an image-to-video preset", "is a text-to-video checkpoint",
                               f"{t2v}/model_index.json", "accepted: hunyuan15-480p-t2v"]),
        "no_image_on_i2v": (["--model", i2v], [f"--model {i2v} is an image-to-video model",
                                               "'HunyuanVideo15ImageToVideoPipeline'", "pass --image FIRST_FRAME"]),
        "siglip_width": (["--model", i2v, *image, "--image-encoder", str(_wrong_width_siglip(tmp_path))],
                         ["--image-encoder", "siglip48: an image encoder of width 48",
                          "image_encoder/config.json: hidden_size", "accepted: an image encoder of width 32"]),
    }[case]
    rc = cli(["sample", *args, "--prompt", "x", "--steps", "1", "--out", str(tmp_path / "x.mp4")])
    err = capsys.readouterr().err
    assert rc == 2, err
    line = err.strip().splitlines()[-1]
    assert all(e in line for e in expected), line
    assert "Traceback" not in err


def test_both_trainers_take_hunyuan15_but_not_its_step_distilled_model(tmp_path, capsys):
    for keys in (JOB_KEYS, AITK_KEYS):  # our trainer and the ai-toolkit arch
        assert resolve(Request("preset:tiny-hy15-t2v"), keys).family is HUNYUAN15
        with pytest.raises(ConfigError) as e:  # it reads the next timestep too: not the flow-matching objective
            resolve(Request("preset:hunyuan15-480p-i2v-step-distilled"), keys)
        assert e.value.path == keys.model and "step-distilled" in str(e.value) and "accepted: tiny," in str(e.value)
    assert resolve(Request("preset:hunyuan15-480p-i2v-step-distilled", preset_required=False), CLI_KEYS)  # samples
    # our trainer's checks before any rank starts pass, `gradient_checkpointing: auto` from the memory plan
    (tmp_path / "data").mkdir()
    _image().save(tmp_path / "data" / "a.png")
    (tmp_path / "data" / "a.txt").write_text("a red square")
    job = {"job": "extension", "config": {"name": "j", "process": [{
        "type": "sd_trainer", "training_folder": str(tmp_path / "out"), "train": {"steps": 1},
        "datasets": [{"folder_path": str(tmp_path / "data"), "resolution": [32]}],
        "model": {"arch": "video_dit", "name_or_path": "preset:tiny-hy15-i2v"}}]}}
    rc, err = helpers.validate(tmp_path, job, capsys)
    assert rc == 0 and "OK (j: preset:tiny-hy15-i2v, full fine-tune" in err, err
    job["config"]["process"][0]["train"]["gradient_checkpointing"] = "auto"  # auto: the plan's choice per bucket
    rc, err = helpers.validate(tmp_path, job, capsys)
    assert rc == 0 and "OK (j: preset:tiny-hy15-i2v" in err, err
    spec = resolve(Request("preset:tiny-hy15-t2v", preset_required=False), CLI_KEYS)  # sampling takes it
    assert spec.family is HUNYUAN15 and spec.text_encoder == "preset:tiny-hy15-t2v"
    assert json.dumps(spec.sources())  # what an export would record
