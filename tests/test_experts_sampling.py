"""Two-expert sampling (Wan 2.2 A14B) against diffusers' two-expert pipelines: a tiny random folder
written by `WanPipeline(transformer=, transformer_2=, boundary_ratio=0.875).save_pretrained` (and the
I2V-style concat one, `WanImageToVideoPipeline`, boundary 0.9) sampled by diffusers and by us from the
folder (`expert_sources`, `TwoExperts`) with the same embeds, initial latents and a guidance pair:
the same latents and frames in fp32; our calls traced: the high-noise expert runs exactly on the steps
whose timestep is >= boundary x 1000, each at its own guidance scale."""

import numpy as np
import pytest
import torch
from PIL import Image

from video_dit.diffusion.experts import HIGH, LOW, TwoExperts, expert_at
from video_dit.families import get_preset
from video_dit.families.wan.convert import vae_config_to_diffusers
from video_dit.families.wan.dit import LORA_TARGETS as WAN_LORA_TARGETS
from video_dit.families.wan.loading import load_dit, load_vae
from video_dit.families.wan.pipeline import VideoPipeline
from video_dit.families.wan.schedule import wan_schedule as sampling_schedule
from video_dit.families.wan.vae import VAEConfig
from video_dit.models.layouts import expert_sources, folder_boundary

diffusers = pytest.importorskip("diffusers")

FRAMES, SIZE, STEPS, SHIFT = 5, 32, 4, 3.0
TEXT_DIM = get_preset("tiny").text_encoder.d_model  # 64: the t2v folder carries the tiny umT5 + ByT5 tokenizer
CFG_HIGH, CFG_LOW = 4.0, 3.0  # T2V-A14B's pair: (low, high) = (3.0, 4.0) in wan/configs/wan_t2v_A14B.py
# Tolerances from the measured errors (2-core x86 CPU, torch 2.13, diffusers 0.42.1): latents (magnitude 6-9)
# measured max |diff| 4.1e-6 (t2v), 6.9e-6 (concat), tolerance 7e-5 (10x the larger); 1% more guidance on
# either expert moves them 1.6e-4 or more. Frames (t2v, in [0, 1]) measured 1.9e-6, tolerance 2e-5 (10x); a
# latent statistic off by 1% of its std moves them 3.1e-3.
LATENT_ATOL, FRAME_ATOL = 7e-5, 2e-5
VAE21 = VAEConfig(dim=4, z_dim=4, dim_mult=(1, 2, 2, 2), num_res_blocks=1,
                  mean=(0.1, -0.2, 0.3, 0.0), std=(1.5, 0.8, 1.2, 2.0))


def _transformer(in_dim, out_dim, seed):
    torch.manual_seed(seed)
    ref = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=in_dim,
        out_channels=out_dim, text_dim=TEXT_DIM, freq_dim=16, ffn_dim=64, num_layers=2, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6).eval()
    with torch.no_grad():  # norms perturbed so their weights matter; a larger head so steps move the latents
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
        ref.proj_out.weight.mul_(4.0)
    return ref


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """kind -> (diffusers two-expert pipeline, its save_pretrained folder), for t2v and concat i2v."""
    out = {}
    for kind, boundary in (("t2v", 0.875), ("concat", 0.9)):
        torch.manual_seed(1)
        vae = diffusers.AutoencoderKLWan(**vae_config_to_diffusers(VAE21)).eval()
        z = VAE21.z_dim
        in_dim = z + 4 + z if kind == "concat" else z
        common = dict(tokenizer=None, text_encoder=None, vae=vae, transformer=_transformer(in_dim, z, seed=2),
                      transformer_2=_transformer(in_dim, z, seed=5), boundary_ratio=boundary,
                      scheduler=diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction",
                                                                  use_flow_sigmas=True, flow_shift=SHIFT))
        if kind == "t2v":  # with a (tiny) text encoder, so `video-dit sample` can run on the folder as it is
            from transformers import ByT5Tokenizer

            from video_dit.families.wan.text_encoder import build_umt5

            common.update(tokenizer=ByT5Tokenizer(), text_encoder=build_umt5(get_preset("tiny").text_encoder, seed=4))
        pipe = (diffusers.WanPipeline(**common) if kind == "t2v" else
                diffusers.WanImageToVideoPipeline(**common, image_encoder=None, image_processor=None))
        pipe.set_progress_bar_config(disable=True)
        folder = tmp_path_factory.mktemp(f"a14b_{kind}")
        pipe.save_pretrained(folder)
        out[kind] = pipe, folder
    return out


def _padded(embeds, length=512):
    return torch.nn.functional.pad(embeds, (0, 0, 0, length - embeds.shape[0]))[None]


def _traced(module, name, calls):
    """Record (expert, t, batch) of every forward of `module` (2B under guidance: both halves in one call)."""
    module.register_forward_pre_hook(lambda m, args: calls.append((name, float(args[1].flatten()[-1]),
                                                                   args[0].shape[0])))
    return module


@pytest.mark.parametrize("kind", ["t2v", "concat"])
def test_two_experts_equal_diffusers_step_for_step(folders, kind):
    pipe, folder = folders[kind]
    sources = expert_sources(folder)
    assert sources == {HIGH: str(folder / "transformer"), LOW: str(folder / "transformer_2")}
    boundary = folder_boundary(folder)
    assert boundary == (0.875 if kind == "t2v" else 0.9)
    calls = []
    experts = TwoExperts(_traced(load_dit(sources[HIGH]).eval(), HIGH, calls),
                         _traced(load_dit(sources[LOW]).eval(), LOW, calls), boundary)
    vae = load_vae(folder).eval()
    ours = VideoPipeline(experts, vae)
    assert ours.i2v_mode == ("concat" if kind == "concat" else "replace")

    g = torch.Generator().manual_seed(3)
    prompt, negative = torch.randn(5, TEXT_DIM, generator=g), torch.randn(3, TEXT_DIM, generator=g)
    latents = torch.randn(1, VAE21.z_dim, (FRAMES - 1) // 4 + 1, SIZE // 8, SIZE // 8, generator=g)
    image = Image.fromarray((torch.rand(SIZE, SIZE, 3, generator=g) * 255).to(torch.uint8).numpy())
    first = image if kind == "concat" else None
    kw = dict(num_frames=FRAMES, height=SIZE, width=SIZE, steps=STEPS, shift=SHIFT, first_frame=first,
              latents=latents, solver="unipc", grid="diffusers")

    def reference(output_type):
        return pipe(prompt_embeds=_padded(prompt), negative_prompt_embeds=_padded(negative),
                    **({} if first is None else {"image": first}), height=SIZE, width=SIZE, num_frames=FRAMES,
                    num_inference_steps=STEPS, guidance_scale=CFG_HIGH, guidance_scale_2=CFG_LOW,
                    latents=latents.clone(), output_type=output_type, return_dict=False)[0]

    with torch.no_grad():
        ref = reference("latent")
        z = ours.generate_latents(prompt, negative, guidance_scale=CFG_HIGH, guidance_scale_2=CFG_LOW, **kw)
        # the calls: one per step, the high-noise expert exactly where t >= boundary x 1000 (both sides
        # occur; the concat case has a step exactly at t = 900 = 0.9 x 1000, which is the high-noise one's)
        timesteps = sampling_schedule(STEPS, SHIFT, "unipc", "diffusers").timesteps.tolist()
        assert [c[1] for c in calls] == timesteps
        assert [c[0] for c in calls] == [HIGH if t >= boundary * 1000 else LOW for t in timesteps]
        assert {c[0] for c in calls} == {HIGH, LOW} and all(c[2] == 2 for c in calls)  # guided: cond + uncond
        if kind == "concat":
            assert 900.0 in timesteps and expert_at(900.0, boundary) == HIGH
        assert float((ref - latents).abs().mean()) > 0.05
        torch.testing.assert_close(z, ref, rtol=0, atol=LATENT_ATOL)
        # the comparison can tell: 1% more guidance on either expert, the guidance pair swapped, or the
        # high-noise expert alone
        for high, low in ((1.01 * CFG_HIGH, CFG_LOW), (CFG_HIGH, 1.01 * CFG_LOW), (CFG_LOW, CFG_HIGH)):
            other = ours.generate_latents(prompt, negative, guidance_scale=high, guidance_scale_2=low, **kw)
            assert (other - ref).abs().max() > LATENT_ATOL, (high, low)
        alone = VideoPipeline(experts.high, vae).generate_latents(prompt, negative, guidance_scale=CFG_HIGH, **kw)
        assert (alone - ref).abs().max() > LATENT_ATOL
        if kind == "concat":
            with pytest.raises(ValueError, match="guidance_scale_2 is the low-noise expert's scale"):
                VideoPipeline(experts.high, vae).generate_latents(prompt, negative, guidance_scale=3.0,
                                                                  guidance_scale_2=2.0, **kw)
            return
        ref = reference("np")

        def frames(latents):
            return (vae.decode(vae.denormalize(latents)) / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).numpy()

        got = frames(z)
        off = z.clone()
        off[:, 0] += 0.01  # as if channel 0's latent mean were off by 1% of its std
        off = frames(off)
    assert float(np.std(ref)) > 0.02
    np.testing.assert_allclose(got, ref, rtol=0, atol=FRAME_ATOL)
    assert np.abs(off - ref).max() > FRAME_ATOL  # the comparison sees a latent statistic off


def _lora_file(path, module, expert, seed):
    """A LoRA of `module`'s shape with random A and B, written as our trainer exports an expert's."""
    from video_dit.lora import add_lora, save_lora

    add_lora(module, rank=2, alpha=2, targets=WAN_LORA_TARGETS)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return save_lora(path, module, 2.0, {"expert": expert, "base_preset": "tiny-a14b"})


def _run(cli, args, capsys) -> tuple[int, str]:
    """(exit code, what it printed to stderr) of a command: a raised error fails the test, as it would
    end `video-dit` with a traceback."""
    rc = cli(args)
    return rc, capsys.readouterr().err


def test_sample_command_two_experts_with_a_lora_each(folders, tmp_path, capsys):
    """`video-dit sample --model A14B_FOLDER --lora HIGH --lora-2 LOW --cfg 4 --cfg-2 3`: both experts,
    each with its LoRA and scale (the folder's boundary), is the MP4 our pipeline renders with them; the
    files swapped, or --lora-2 for a one-model --model, are refused naming the file / option."""
    from video_dit.cli import main as cli
    from video_dit.families.wan.loading import load_text_encoder
    from video_dit.lora import load_lora
    from video_dit.media import write_video

    _, folder = folders["t2v"]
    sources = expert_sources(folder)
    high = _lora_file(tmp_path / "j_high_noise.safetensors", load_dit(sources[HIGH]), HIGH, 1)
    low = _lora_file(tmp_path / "j_low_noise.safetensors", load_dit(sources[LOW]), LOW, 2)
    args = ["sample", "--model", str(folder), "--prompt", "a red ball", "--negative", "blurry", "--frames",
            str(FRAMES), "--height", str(SIZE), "--width", str(SIZE), "--steps", "3", "--solver", "euler",
            "--shift", str(SHIFT), "--cfg", "4", "--cfg-2", "3", "--seed", "5"]
    assert cli(args + ["--lora", str(high), "--lora-2", str(low), "--out", str(tmp_path / "cli.mp4")]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("sampling:"))
    assert "guidance 4 (high-noise expert) / 3 (low-noise expert)" in line
    te = load_text_encoder(folder)
    embeds = te.encode(["a red ball", "blurry"])
    experts = TwoExperts(load_lora(high, load_dit(sources[HIGH])).eval(), load_lora(low, load_dit(sources[LOW])).eval(),
                         0.875)
    frames = VideoPipeline(experts, load_vae(folder).eval()).generate(
        embeds[0], embeds[1], num_frames=FRAMES, height=SIZE, width=SIZE, steps=3, guidance_scale=4.0,
        guidance_scale_2=3.0, shift=SHIFT, solver="euler", generator=torch.Generator().manual_seed(5))
    write_video(frames, tmp_path / "direct.mp4", fps=16)
    assert (tmp_path / "cli.mp4").read_bytes() == (tmp_path / "direct.mp4").read_bytes()

    rc, err = _run(cli, args + ["--lora", str(low), "--out", str(tmp_path / "x.mp4")], capsys)
    assert rc == 2 and str(low) in err and "trained for the low-noise expert" in err and "--lora-2" in err, err
    rc, err = _run(cli, ["sample", "--model", "preset:tiny", "--prompt", "x", "--lora-2", str(low), "--out",
                         str(tmp_path / "y.mp4")], capsys)
    assert rc == 2 and "--lora-2 is for a two-expert model" in err, err
