"""Pipeline and `video-dit sample`: t2v / i2v MP4s decode back to the requested size, first-frame
conditioning is applied at every step, classifier-free guidance batching, size snapping, errors."""

import pytest
import torch
from PIL import Image

from video_dit.cli import main as cli
from video_dit.families import get_preset, with_dit
from video_dit.families.wan.dit import LORA_TARGETS as WAN_LORA_TARGETS
from video_dit.families.wan.dit import VideoDiT
from video_dit.families.wan.pipeline import VideoPipeline
from video_dit.families.wan.schedule import wan_schedule as sampling_schedule
from video_dit.families.wan.vae import CausalVideoVAE
from video_dit.media import pil_to_tensor, probe_video, read_video

FRAMES, HEIGHT, WIDTH = 5, 32, 48


def _models(in_dim=16, seed=0):
    preset = with_dit(get_preset("tiny"), in_dim=in_dim)
    torch.manual_seed(seed)
    dit, vae = VideoDiT(preset.dit).eval(), CausalVideoVAE(preset.vae).eval()
    # the DiT's output layers are zero-initialised; give them weights so the velocity depends on the input
    with torch.no_grad():
        for p in (dit.head.head.weight, dit.head.modulation, *[b.modulation for b in dit.blocks]):
            p.normal_(0, 0.3)
    return dit, vae


class Spy(torch.nn.Module):
    """Wraps the DiT like a DeepSpeed engine (`.module`) and records every call's inputs."""

    def __init__(self, module):
        super().__init__()
        self.module, self.calls = module, []

    def forward(self, x, t, context):
        self.calls.append((x.clone(), t.clone(), [c.clone() for c in context]))
        return self.module(x, t, context)


@pytest.fixture(scope="module")
def models():
    return _models()


@pytest.fixture
def image():
    g = torch.Generator().manual_seed(3)
    pixels = (torch.rand(3, HEIGHT, WIDTH, generator=g) * 255).to(torch.uint8)
    return Image.fromarray(pixels.permute(1, 2, 0).numpy())


def _embeds(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3 + i, 64, generator=g) for i in range(n)]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("i2v", [False, True])
def test_sample_command_writes_decodable_mp4(tmp_path, image, i2v):
    out = tmp_path / "clip.mp4"
    args = ["sample", "--model", "preset:tiny", "--prompt", "a red ball bouncing", "--frames", "5",
            "--height", "32", "--width", "48", "--steps", "2", "--cfg", "3", "--seed", "0", "--out", str(out)]
    if i2v:
        image.save(tmp_path / "first.png")
        args += ["--image", str(tmp_path / "first.png"), "--solver", "unipc"]
    assert cli(args) == 0
    info = probe_video(out)
    assert (info.num_frames, info.width, info.height, info.fps) == (5, 48, 32, 16.0)
    assert read_video(out).shape == (5, 3, 32, 48)


def test_i2v_replace_applied_at_every_step_and_first_frame_is_the_vae_round_trip(models, image):
    dit, vae = models
    spy = Spy(dit)
    pipe = VideoPipeline(spy, vae)
    assert pipe.i2v_mode == "replace"
    frames = pipe.generate(_embeds(1)[0], num_frames=FRAMES, height=HEIGHT, width=WIDTH, steps=3,
                           guidance_scale=1.0, shift=3.0, generator=_gen(), first_frame=image)
    assert len(frames) == FRAMES and frames[0].size == (WIDTH, HEIGHT)
    pixels = pil_to_tensor(image)[None]  # (1, 3, H, W) already at the target size
    with torch.no_grad():
        z = vae.encode(pixels[:, :, None]).mode()  # (1, 16, 1, h, w)
        round_trip = vae.decode(z)[0, :, 0]  # (3, H, W)
    latent0 = vae.normalize(z)
    assert len(spy.calls) == 3
    n_first = (HEIGHT // 16) * (WIDTH // 16)  # tokens of latent frame 0
    for x, t, _ in spy.calls:  # every step saw the clean first frame, with t = 0 on its tokens only
        assert torch.equal(x[:, :, :1], latent0)
        assert t.shape == (1, 2 * n_first) and bool((t[:, :n_first] == 0).all()) and bool((t[:, n_first:] > 0).all())
    decoded0 = pil_to_tensor(frames[0])
    expected0 = pil_to_tensor(Image.fromarray(((round_trip.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 0).numpy()))
    assert torch.equal(decoded0, expected0)
    assert (pil_to_tensor(frames[1]) - expected0).abs().max() > 0.05  # later frames are generated


def test_i2v_concat_model_sees_mask_and_condition_every_step(image):
    dit, vae = _models(in_dim=36)
    spy = Spy(dit)
    pipe = VideoPipeline(spy, vae)
    assert pipe.i2v_mode == "concat"
    frames = pipe.generate(_embeds(1)[0], num_frames=FRAMES, height=HEIGHT, width=WIDTH, steps=2,
                           guidance_scale=1.0, generator=_gen(), first_frame=image)
    assert len(frames) == FRAMES
    first = spy.calls[0][0][:, 16:]
    for x, t, _ in spy.calls:
        assert x.shape == (1, 36, 2, HEIGHT // 8, WIDTH // 8) and t.shape == (1,)
        assert torch.equal(x[:, 16:], first)  # mask + condition latents constant across steps
        assert bool((x[:, 16:20, 0] == 1).all()) and bool((x[:, 16:20, 1:] == 0).all())
    with pytest.raises(ValueError, match="pass first_frame"):
        pipe.generate(_embeds(1)[0], num_frames=FRAMES, height=HEIGHT, width=WIDTH, steps=1, guidance_scale=1.0)


def test_cfg_scale_one_equals_conditional_only(models):
    dit, vae = models
    pipe = VideoPipeline(dit, vae)
    kw = dict(num_frames=FRAMES, height=HEIGHT, width=WIDTH, steps=2, shift=3.0)
    cond_only = pipe.generate_latents(_embeds(2), None, guidance_scale=1.0, generator=_gen(), **kw)
    with_negative = pipe.generate_latents(_embeds(2), _embeds(1, seed=9)[0], guidance_scale=1.0, generator=_gen(), **kw)
    assert torch.equal(cond_only, with_negative)
    # scale s: one batched forward combines as v_u + s (v_c - v_u); check against separate forwards
    spy = Spy(dit)
    guided = VideoPipeline(spy, vae).generate_latents(_embeds(2), _embeds(1, seed=9)[0], guidance_scale=4.0,
                                                      generator=_gen(), solver="euler", **{**kw, "steps": 1})
    assert len(spy.calls) == 1 and spy.calls[0][0].shape[0] == 4  # cond and uncond in one batch
    noise = torch.randn(cond_only.shape, generator=_gen())
    schedule = sampling_schedule(1, 3.0, "euler")  # one step from sigma 1 (t = 1000) to 0
    assert schedule.timesteps.tolist() == [1000.0] and schedule.sigmas.tolist() == [1.0, 0.0]
    t = torch.full((2,), 1000.0)
    with torch.no_grad():
        v_c = dit(noise, t, _embeds(2))
        v_u = dit(noise, t, [_embeds(1, seed=9)[0]] * 2)
    torch.testing.assert_close(guided, noise - (v_u + 4.0 * (v_c - v_u)), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="negative"):
        pipe.generate_latents(_embeds(1), None, guidance_scale=4.0, **kw)


def test_initial_latents_replace_the_drawn_noise(models):
    dit, vae = models
    pipe = VideoPipeline(dit, vae)
    kw = dict(num_frames=FRAMES, height=HEIGHT, width=WIDTH, steps=2, guidance_scale=1.0, shift=3.0)
    drawn = pipe.generate_latents(_embeds(2), generator=_gen(7), **kw)
    noise = torch.randn(drawn.shape, generator=_gen(7))
    assert torch.equal(pipe.generate_latents(_embeds(2), latents=noise, generator=_gen(0), **kw), drawn)
    assert not torch.equal(pipe.generate_latents(_embeds(2), latents=noise * 0.5, **kw), drawn)
    with pytest.raises(ValueError, match=r"latents have shape \(1, 16, 2, 4, 6\).*need \(2, 16, 2, 4, 6\)"):
        pipe.generate_latents(_embeds(2), latents=noise[:1], **kw)


def test_first_frame_is_fitted_to_cover_and_centre_cropped():
    from video_dit.diffusion.pipeline_parts import fit_frame

    x = torch.linspace(-1, 1, 60).view(1, 1, 1, 60).expand(2, 3, 20, 60)  # 1:3, a horizontal ramp
    out = fit_frame(x, 32, 48)
    assert out.shape == (2, 3, 32, 48)
    assert float(out[0, 0, 0, 0]) > -0.5 and float(out[0, 0, 0, -1]) < 0.5  # the sides were cropped away
    torch.testing.assert_close(out[..., :24].mean(), -out[..., 24:].mean(), atol=1e-5, rtol=0)  # centred


def test_batch_of_prompts_and_snapping(models):
    dit, vae = models
    pipe = VideoPipeline(dit, vae)
    with pytest.warns(UserWarning, match=r"\(7, 20, 40\) -> \(5, 16, 32\)"):
        videos = pipe.generate(_embeds(2), num_frames=7, height=20, width=40, steps=1, guidance_scale=1.0,
                               generator=_gen())
    assert len(videos) == 2 and all(len(v) == 5 and v[0].size == (32, 16) for v in videos)
    assert pipe.snap(17, 480, 832) == (17, 480, 832)
    with pytest.warns(UserWarning, match="frames must be 4k \\+ 1 and sides multiples of 16") as caught:
        assert pipe.snap(7, 20, 40) == (5, 16, 32)
    assert caught[0].filename == __file__  # the warning names the caller of snap
    with pytest.raises(ValueError, match="2D"):
        pipe.generate(torch.randn(1, 3, 64), steps=1, guidance_scale=1.0)
    with pytest.raises(ValueError, match="i2v_mode 'concat'"):
        pipe.generate(_embeds(1)[0], steps=1, guidance_scale=1.0, i2v_mode="concat")


def test_sample_command_rejects_bad_values(tmp_path, capsys):
    base = ["sample", "--model", "preset:tiny", "--prompt", "x", "--out", str(tmp_path / "a.mp4")]
    for extra, message in [(["--frames", "0"], "positive integer"), (["--cfg", "abc"], "expected a number"),
                           (["--shift", "0"], "> 0.0"), (["--stepz", "3"], "unrecognized arguments: --stepz")]:
        with pytest.raises(SystemExit):
            cli(base + extra)
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["sample", "--model", "preset:tiny", "--prompt", "x", "--out", str(tmp_path / "a.avi")])
    assert "accepted: .mp4" in capsys.readouterr().err
    # errors a user can fix: one line, exit 2, no traceback
    assert cli(["sample", "--model", str(tmp_path / "nope"), "--prompt", "x", "--out", str(tmp_path / "a.mp4")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("video-dit sample: error: --model") and "no such file" in err and err.count("\n") == 1
    assert cli(["sample", "--model", "preset:tinny", "--prompt", "x", "--out", str(tmp_path / "a.mp4")]) == 2
    err = capsys.readouterr().err
    assert "did you mean 'tiny'" in err and err.count("\n") == 1 and "Traceback" not in err


def test_sample_command_from_a_model_folder_with_lora(tmp_path):
    """A folder holding DiT + VAE weight files, text_encoder/ and tokenizer/ renders the same MP4 as the
    pipeline run in-process on those weights; a LoRA then changes it."""
    from safetensors.torch import save_file
    from transformers import ByT5Tokenizer

    from video_dit.families.wan.text_encoder import TextEncoder, build_umt5
    from video_dit.lora import add_lora, save_lora
    from video_dit.media import write_video

    folder = tmp_path / "model"
    folder.mkdir()
    dit, vae = _models(seed=5)
    save_file({k: v.contiguous() for k, v in dit.state_dict().items()}, str(folder / "dit.safetensors"))
    save_file(vae.state_dict(), str(folder / "vae.safetensors"))
    umt5 = build_umt5(get_preset("tiny").text_encoder, seed=2)
    umt5.save_pretrained(folder / "text_encoder")
    ByT5Tokenizer().save_pretrained(folder / "tokenizer")

    common = ["--prompt", "a red ball", "--negative", "blurry", "--frames", "5", "--height", "32", "--width", "32",
              "--steps", "2", "--cfg", "2", "--shift", "3", "--seed", "4", "--solver", "euler"]
    assert cli(["sample", "--model", str(folder), *common, "--out", str(tmp_path / "folder.mp4")]) == 0
    embeds = TextEncoder(umt5, ByT5Tokenizer()).encode(["a red ball", "blurry"])
    frames = VideoPipeline(dit, vae).generate(embeds[0], embeds[1], num_frames=5, height=32, width=32, steps=2,
                                              guidance_scale=2.0, shift=3.0, generator=_gen(4), solver="euler")
    write_video(frames, tmp_path / "direct.mp4", fps=16)
    assert (tmp_path / "folder.mp4").read_bytes() == (tmp_path / "direct.mp4").read_bytes()

    add_lora(dit, rank=4, targets=WAN_LORA_TARGETS)
    with torch.no_grad():
        for name, p in dit.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    save_lora(tmp_path / "style.safetensors", dit, alpha=4.0)
    assert cli(["sample", "--model", str(folder), "--lora", str(tmp_path / "style.safetensors"), *common,
                "--out", str(tmp_path / "lora.mp4")]) == 0
    assert not torch.equal(read_video(tmp_path / "folder.mp4"), read_video(tmp_path / "lora.mp4"))
