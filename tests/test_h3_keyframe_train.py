"""MiniMax H3's first-frame conditioning in training (families/minimax_h3/conditioning.py) against the sampler: the
training inputs and loss of a do_i2v clip, built by the family's `Training` record and the house's objective, equal
an independent computation from what `H3Pipeline` hands its DiT for the same keyframe (its fl2va packing: the
caption presented with the keyframe, the keyframe's latents held at 0.999 z + 0.001 n, their timestep) at the
video timestep of one of its steps. The pipeline's own parity with diffusers' modular pipeline is
tests/test_h3_pipeline.py's."""

from __future__ import annotations

import av
import helpers
import numpy as np
import pytest
import torch
from PIL import Image

from video_dit.diffusion.objective import AudioBatch, flow_matching_loss
from video_dit.families.minimax_h3 import FAMILY as H3
from video_dit.families.minimax_h3.audio_config import H3_AUDIO_VAE_TINY
from video_dit.families.minimax_h3.audio_vae import H3AudioVAE
from video_dit.families.minimax_h3.codec import H3AudioCodec
from video_dit.families.minimax_h3.dit import H3DiT
from video_dit.families.minimax_h3.encoders import VIDEO_TAG, tiny_h3_text_encoder
from video_dit.families.minimax_h3.pipeline import H3Pipeline, fit_keyframes
from video_dit.families.minimax_h3.presets import TINY_DIT
from video_dit.families.minimax_h3.vae import H3VideoVAE
from video_dit.families.minimax_h3.vae_config import H3_VAE_TINY
from video_dit.media import array_to_tensor, tensor_to_pil

FRAMES, HEIGHT, WIDTH, STEPS, SEED, STEP = 22, 32, 32, 3, 7, 1  # the pipeline's step STEP is compared
PROMPT = "a red ball bounces on a drum"
# measured (float32, one thread): the training loss vs the loss on the pipeline's inputs: 0 (the same DiT call: the
# keyframe rows, their timestep, the text rows and tags equal bit for bit); the tied audio timestep vs the audio
# schedule's at that step 1.4e-7 relative. Tolerances: 1e-6 relative on both (a float32 reordering's margin; ~7x
# the audio timestep's); the could-fail changes move the loss 1.0e-4 (the keyframe rows at the video's t) and
# 1.3e-3 (the caption without its keyframe), 100x and more the tolerance
LOSS_RTOL = AUDIO_T_RTOL = 1e-6


class Spy(torch.nn.Module):
    """The DiT, recording each call's arguments."""

    def __init__(self, dit):
        super().__init__()
        self.dit, self.calls = dit, []
        self.config = dit.config

    def forward(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.dit(*args, **kwargs)


@pytest.fixture(scope="module")
def parts():
    dit = helpers.randomize_all(H3DiT(TINY_DIT), seed=3, norm_std=0.2, vector_std=0.1).eval()
    vae = helpers.randomize_all(H3VideoVAE(H3_VAE_TINY), seed=1, norm_std=0.05, vector_std=0.02).eval()
    codec = H3AudioCodec(H3AudioVAE(H3_AUDIO_VAE_TINY).eval())
    rng = np.random.default_rng(0)
    clip = (rng.random((FRAMES, HEIGHT, WIDTH, 3)) * 255).astype("uint8")
    return dit, vae, codec, tiny_h3_text_encoder(0), clip


@pytest.fixture(scope="module")
def sampled(parts):
    return _pipeline_call(parts)


def _pipeline_call(parts):
    """What `H3Pipeline` hands its DiT at step STEP of an fl2va request with the clip's first frame as the first
    keyframe, and the keyframe noise it drew (its first draw from the request's generator)."""
    dit, vae, codec, encoder, clip = parts
    first = Image.fromarray(clip[0])
    shown, _ = fit_keyframes(first, None, HEIGHT, WIDTH)
    (embeds,) = encoder.encode([PROMPT], images=[shown])
    spy = Spy(dit)
    H3Pipeline(spy, vae, codec).generate_latents(embeds, num_frames=FRAMES, height=HEIGHT, width=WIDTH, steps=STEPS,
                                                 generator=torch.Generator().manual_seed(SEED), first_frame=first)
    (x, t, text), kwargs = spy.calls[STEP]
    shape = kwargs["keyframes"].shape
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(SEED))  # the request's first draw
    return t, text, kwargs, noise


def _training_batch(parts, with_keyframe: bool = True):
    """The clip as the trainer caches it: its latents (random here: any target), its first frame's latents
    (`Training.cache_item`), its caption presented with its first frame (the trainer's `keyframe_text_fn`:
    `Family.prompt_images` on the uint8 frame) and the dropout-free text entry."""
    dit, vae, codec, encoder, clip = parts
    video = array_to_tensor(clip).permute(1, 0, 2, 3)[None]  # (1, 3, F, H, W) in [-1, 1]
    with torch.no_grad():
        cond = H3.training.cache_item(vae, video, None, False, None)
    image = tensor_to_pil(video[0, :, 0])[0]
    images = [H3.prompt_images(image, None, HEIGHT, WIDTH)] if with_keyframe else None
    entry = H3.training.text_entry(encoder.encode([PROMPT], images=images)[0])
    return cond, {k: [v] for k, v in entry.items()}


def _losses(parts, t, cond, text_batch, noise_k, spy=None):
    """The training loss (the house's objective with the family's record) at video timestep t (1,), and the
    inputs: (loss, the DiT call's kwargs, video noise, audio noise, clean latents)."""
    dit, vae, codec, encoder, clip = parts
    g = torch.Generator().manual_seed(11)
    C, Fl = TINY_DIT.in_channels, vae.config.latent_frames(FRAMES)
    h, w = cond["first_frame_latents"].shape[-2:]
    x0, noise = torch.randn(1, C, Fl, h, w, generator=g), torch.randn(1, C, Fl, h, w, generator=g)
    a_shape = (1, *codec.latent_shape(FRAMES, 24.0))
    a0, a_noise = torch.randn(a_shape, generator=g), torch.randn(a_shape, generator=g)
    context, text_kwargs = H3.training.text_inputs(text_batch, "cpu", TINY_DIT)
    conditioning = H3.training.conditioning(None, TINY_DIT.patch_size, None, False)
    spy = spy or Spy(dit)
    with torch.no_grad():
        loss = flow_matching_loss(spy, x0, context, t, noise, conditioning=conditioning, cond=cond,
                                  active=torch.tensor([True]), text_kwargs={**text_kwargs, "fps": 24.0},
                                  audio=AudioBatch(a0, a_noise, H3.audio.tied_map(t), torch.tensor([True])),
                                  cond_noise=noise_k)
    return loss, spy.calls[-1], (x0, noise, a0, a_noise)


def _independent(parts, t, text, kw, data, keyframe_timestep=None):
    """The loss from the pipeline's DiT inputs (its text rows and tags, keyframe rows, their timestep, its audio
    timestep at that step) on the same clean latents and noise: MSE(v, n - x0) + MSE(a, n_a - a0)."""
    dit = parts[0]
    x0, noise, a0, a_noise = data
    s = t / 1000.0
    a_t = kw["audio_timestep"]
    sa = a_t / 1000.0
    with torch.no_grad():
        v, a = dit((1 - s) * x0 + s * noise, t, text, audio=(1 - sa) * a0 + sa * a_noise, audio_timestep=a_t,
                   text_tags=kw["text_tags"], keyframes=kw["keyframes"], keyframe_anchors=kw["keyframe_anchors"],
                   keyframe_timestep=kw["keyframe_timestep"] if keyframe_timestep is None else keyframe_timestep,
                   fps=24.0)
    return (v - (noise - x0)).square().mean() + (a - (a_noise - a0)).square().mean()


def test_training_sample_equals_the_pipelines_fl2va_packing(parts, sampled):
    t, text, kw, noise_k = sampled
    cond, text_batch = _training_batch(parts)
    loss, ((x_in, t_in, context), ours), data = _losses(parts, t, cond, text_batch, noise_k)
    # the inputs: the keyframe rows, their anchor and timestep, the caption's rows and tags, the audio timestep
    assert ours["keyframe_anchors"] == kw["keyframe_anchors"] == ("first",)
    assert torch.equal(ours["keyframes"], kw["keyframes"])
    assert torch.equal(ours["keyframe_timestep"], kw["keyframe_timestep"]) and float(kw["keyframe_timestep"]) == 1.0
    assert torch.equal(context, text) and torch.equal(ours["text_tags"], kw["text_tags"])
    assert bool((kw["text_tags"] == VIDEO_TAG).any())  # the vision block of the keyframe in the presentation
    assert torch.equal(t_in, t)  # the target's rows at the video's t: every latent frame noised (none replaced)
    a_err = float((ours["audio_timestep"] - kw["audio_timestep"]).abs().max() / kw["audio_timestep"].abs().max())
    ref = _independent(parts, t, text, kw, data)
    err = float((loss - ref).abs() / ref.abs())
    print(f"\nloss {float(loss):.6f} vs the pipeline's inputs {float(ref):.6f}: rel {err:.2e}; audio t rel {a_err:.2e}")
    assert a_err < AUDIO_T_RTOL  # the tied audio timestep (`audio_timesteps`) is the audio schedule's at the same step
    assert err < LOSS_RTOL, err


def test_keyframe_training_could_fail(parts, sampled):
    """Each piece matters: the keyframe rows' timestep at the video's t (not held), the caption without the
    keyframe in its presentation, and the keyframe without its conditioning noise each move the loss far beyond
    the tolerance; the batch rules and refusals are named."""
    t, text, kw, noise_k = sampled
    cond, text_batch = _training_batch(parts)
    loss, _, data = _losses(parts, t, cond, text_batch, noise_k)
    unheld = _independent(parts, t, text, kw, data, keyframe_timestep=t)
    plain_cond, plain_text = _training_batch(parts, with_keyframe=False)
    plain, _, _ = _losses(parts, t, plain_cond, plain_text, noise_k)
    moved = {name: float((x - loss).abs() / loss.abs()) for name, x in (("unheld", unheld), ("plain caption", plain))}
    print(f"\nrelative loss changes: {moved}")
    assert min(moved.values()) > 20 * LOSS_RTOL, moved
    # the keyframe's conditioning noise moves the loss by ~4e-7 only (0.001 of it, as the reference mixes it), so
    # the rows themselves are compared: without it they are not the pipeline's
    z = cond["first_frame_latents"]
    _, (_, clean), _ = _losses(parts, t, cond, text_batch, z.clone())  # 0.999 z + 0.001 z: z
    gap = float((clean["keyframes"] - kw["keyframes"]).abs().max())
    assert torch.allclose(clean["keyframes"], z) and gap > 1e-4, gap
    # the keyframe timestep: min(t, 1) on 0..1000 (MiniMax's max(t, 0.999))
    c = H3.training.conditioning(None, TINY_DIT.patch_size, None, False)
    first = cond["first_frame_latents"].expand(2, -1, -1, -1, -1)
    kws = c.dit_kwargs({"first_frame_latents": first}, t=torch.tensor([0.25, 900.0]), noise=torch.zeros_like(first))
    assert torch.allclose(kws["keyframe_timestep"], torch.tensor([0.25, 1.0]))
    # stills of a do_i2v dataset train as t2v; a batch mixing them with clips, a last frame are refused
    assert c.dit_kwargs({"first_frame_latents": first}, torch.tensor([False, False])) == {}
    with pytest.raises(ValueError, match="mixes keyframe-conditioned clips"):
        c.dit_kwargs({"first_frame_latents": first}, torch.tensor([True, False]), t=torch.ones(2), noise=first)
    with pytest.raises(ValueError, match="keyframe noise"):
        c.dit_kwargs({"first_frame_latents": first}, t=torch.ones(2))
    with pytest.raises(ValueError, match="first keyframe only"):
        H3.training.conditioning(None, TINY_DIT.patch_size, None, True)
    # two captions presented with keyframes of one canvas share their tags' prefix; another canvas is refused
    encoder, clip = parts[3], parts[4]
    image = Image.fromarray(clip[0])
    entries = [H3.training.text_entry(e) for e in encoder.encode([PROMPT, "a drum"], images=[[image], [image]])]
    batch = {k: [e[k] for e in entries] for k in entries[0]}
    context, kwargs = H3.training.text_inputs(batch, "cpu", TINY_DIT)
    assert torch.equal(kwargs["text_tags"], entries[0]["text_tags"].reshape(-1))
    assert kwargs["text_mask"].sum(1).tolist() == [e["text_embeds"].shape[0] for e in entries]
    other = H3.training.text_entry(encoder.encode(["a drum"], images=[[image.resize((64, 32))]])[0])
    with pytest.raises(ValueError, match="presents its keyframe otherwise"):
        H3.training.text_inputs({k: [entries[0][k], other[k]] for k in other}, "cpu", TINY_DIT)


@pytest.mark.slow  # 28 s measured (13.5 s of CPU) with the machine's load near 5: over the 20 s a CI test may take
@pytest.mark.multirank
def test_one_rank_do_i2v_job_caches_each_clips_caption_with_its_first_frame(tmp_path):
    """`video-dit train`'s trainer on one rank, tiny-h3, a do_i2v dataset of two clips with sound, one step and a
    preview from a held-out first frame (its prompt presented with it: the pipeline refuses a keyframe its prompt
    does not present): each clip's caption and the dropout's "" are cached presented with that clip's first frame
    (what the conditioner gives for the decoded frame, `fit_keyframes` on its canvas: 16 image tokens of 8 x 8 pixels + the vision
    start / end), the plain captions beside them; the latent entries hold the keyframe's latents; the step's
    loss is finite. (A DeepSpeed rank in a subprocess: -m slow, docs/tests.md 'Kept out of CI'.)"""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from video_dit.data.demo_av import make_demo_av_data
    from video_dit.media import read_video_frames
    from video_dit.train.metrics import read_metrics

    import ranks

    make_demo_av_data(tmp_path / "data", count=2, frames=FRAMES, size=WIDTH, holdout=1, fps=24)
    dataset = {"folder_path": str(tmp_path / "data"), "num_frames": FRAMES, "fps": 24, "resolution": [WIDTH],
               "do_i2v": True, "shrink_video_to_frames": False, "caption_ext": "txt"}
    job = helpers.write_job(tmp_path, "k", datasets=[dataset], size=WIDTH, keep=1, lr=1e-2, lora=False, steps=1,
                            save_every=1, train={"seed": 3, "warmup_steps": 1, "lr_scheduler": "constant"},
                            model={"preset": "tiny-h3", "name_or_path": "preset:tiny-h3"},
                            samples=[helpers.holdout_sample(tmp_path / "data")], sample_every=1,
                            sample={"num_frames": FRAMES, "fps": 24})
    ranks.run_jobs(tmp_path, [{"config": str(job)}], 1, timeout=300)
    # the preview from the held-out first frame (fl2va: its prompt presented with it, else the pipeline refuses)
    with av.open(str(tmp_path / "out/k/samples/000000001_0.mp4")) as c:
        assert c.streams.video[0].frames == FRAMES and c.streams.audio[0].rate == 32000
    loss = [r["loss"] for r in read_metrics(tmp_path / "out/k/metrics.jsonl") if r.get("loss") is not None]
    assert len(loss) == 1 and np.isfinite(loss[0]), loss
    entries = []
    for path in sorted((tmp_path / "data/_text_cache").glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            caption = f.metadata()["caption"]
        entries.append((caption, load_file(str(path))))
    presented = [(c, e) for c, e in entries if "text_tags" in e]
    captions = [p.read_text().strip() for p in sorted((tmp_path / "data").glob("*.txt"))]
    assert len(captions) == 2 and sorted(c for c, e in entries if "text_tags" not in e) == sorted(["", *captions])
    assert len(presented) == 4 and all(int((e["text_tags"] == VIDEO_TAG).sum()) == 18 for _, e in presented)
    encoder = tiny_h3_text_encoder(0)  # the preset's conditioner
    for clip, caption in zip(sorted((tmp_path / "data").glob("*.mp4")), captions):
        first = Image.fromarray(read_video_frames(clip, [0])[0])
        for text in (caption, ""):
            want = H3.training.text_entry(encoder.encode([text], images=[[first]])[0])
            errors = [float((e["text_embeds"] - want["text_embeds"]).abs().max()) for c, e in presented
                      if c == text and e["text_embeds"].shape == want["text_embeds"].shape]
            print(f"{clip.name} {text!r}: cached vs encoded {min(errors, default=float('nan')):.1e}")
            assert errors and min(errors) < 1e-5, (clip.name, text, errors)
    for path in (tmp_path / "data/_latent_cache").glob("*.safetensors"):
        side = WIDTH // H3_VAE_TINY.spatial_compression
        assert load_file(str(path))["first_frame_latents"].shape == (TINY_DIT.in_channels, 1, side, side)


def test_a_presented_captions_text_entry_is_keyed_on_its_clip(tmp_path):
    """`data.cache.item_text_path`: with a conditioner that presents the clip's first frame (`keyframe_text`), a
    conditioned clip's caption entry is keyed on the clip (another clip, or the same file touched or cropped
    otherwise, with the same caption: another entry), a still's (trained as t2v) and any entry of a job without it on
    the caption alone."""
    from dataclasses import replace

    from video_dit.data.cache import item_text_path, text_path
    from video_dit.data.dataset import DataItem

    clip = DataItem(path=str(tmp_path / "a.mp4"), kind="video", caption=PROMPT, bucket=(FRAMES, HEIGHT, WIDTH),
                    frames=tuple(range(FRAMES)), resize=(HEIGHT, WIDTH), crop=(0, 0),
                    source=(FRAMES, WIDTH, HEIGHT, 24.0), size=100, mtime_ns=1, do_i2v=True, cache_root=str(tmp_path))
    still = replace(clip, kind="image", bucket=(1, HEIGHT, WIDTH), frames=(0,))
    plain = text_path(tmp_path, PROMPT, "space")
    keyed = {item_text_path(c, PROMPT, "space", keyframe_text=True) for c in (
        clip, replace(clip, path=str(tmp_path / "b.mp4")), replace(clip, mtime_ns=2), replace(clip, crop=(1, 0)))}
    assert len(keyed) == 4 and plain not in keyed
    assert item_text_path(still, PROMPT, "space", keyframe_text=True) == plain
    assert item_text_path(clip, PROMPT, "space", keyframe_text=False) == plain


def test_an_unmasked_first_frame_is_accepted_as_the_reference_trains(tmp_path):
    """`mask_first_frame_loss: false` on a MiniMax H3 do_i2v job: its keyframe is rows of their own (nothing in the
    target overwritten), so every target frame in the loss is the reference's rule and false is accepted; on a
    replace-mode Wan preset the same key is refused (its frame 0 has no target)."""
    from video_dit.train.config import parse_job
    from video_dit.typed_config import ConfigError

    (tmp_path / "clips").mkdir()
    (tmp_path / "clips/a.png").write_bytes(b"")  # a name to list: the job is parsed, not its data read

    def job(preset: str, frames: int) -> dict:
        return {"job": "extension", "config": {"name": "j", "process": [{
            "datasets": [{"folder_path": str(tmp_path / "clips"), "do_i2v": True, "num_frames": frames, "fps": 24,
                          "shrink_video_to_frames": False}],
            "model": {"name_or_path": f"preset:{preset}", "model_kwargs": {"mask_first_frame_loss": False}}}]}}

    assert parse_job(job("tiny-h3", 22)).process.model.mask_first_frame_loss is False
    with pytest.raises(ConfigError, match=r"model\.mask_first_frame_loss.*needs i2v_mode 'concat'"):
        parse_job(job("tiny", 17))
