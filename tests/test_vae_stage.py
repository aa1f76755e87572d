"""The tiny-VAE stage of the embedded default: it learns, saves what `load_vae` reads, its latent
statistics normalize the data, and it is idempotent and deterministic."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from video_dit.cli import main as cli_main
from video_dit.data.demo import make_demo_data
from video_dit.families.wan.loading import load_vae
from video_dit.families.wan.vae import VAEConfig
from video_dit.families.wan.vae_stage import CONFIG_NAME, _clips, train_tiny_vae, train_tiny_vae_result


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo")
    make_demo_data(d, count=4, frames=9, size=32, seed=0, holdout=1)
    return d


@pytest.fixture(scope="module")
def trained(demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("vae") / "tiny_vae.safetensors"
    return train_tiny_vae_result(demo, out, steps=40, seed=0, batch_size=2, frames=5, crop=None,
                                 lr=3e-3, threads=1, verbose=False)


def _recon_error(vae, clips: torch.Tensor) -> float:
    with torch.no_grad():
        return float((vae.decode(vae.encode(clips).mode()) - clips).abs().mean())


def test_reconstruction_loss_falls(trained, demo):
    # The training losses are of random windows (one clip is all background, the next a shape), so
    # first-vs-last steps is noise; measure instead the whole clips through the same-seed untrained
    # VAE and through the trained one.
    from video_dit.families.wan.presets import VAE_PRESETS
    from video_dit.families.wan.vae import CausalVideoVAE

    assert len(trained.losses) == 40
    clips = torch.stack([c[:, :5] for c in _clips(demo)])                 # (4, 3, 5, 32, 32)
    torch.manual_seed(0)
    untrained = CausalVideoVAE(VAE_PRESETS["tiny"]).eval()
    before, after = _recon_error(untrained, clips), _recon_error(trained.vae.eval(), clips)
    assert after < 0.5 * before, (before, after)


def test_saved_weights_load_and_round_trip(trained, demo):
    cfg = json.loads((trained.path.parent / CONFIG_NAME).read_text())
    config = VAEConfig.from_dict(cfg)                   # only VAEConfig fields, mean/std included
    assert config.mean == trained.mean and config.std == trained.std and len(config.mean) == config.z_dim
    vae = load_vae(trained.path).eval()                 # reads the config.json beside the file
    assert tuple(vae.config.mean) == tuple(config.mean) and tuple(vae.config.std) == tuple(config.std)
    sd = load_file(str(trained.path))
    assert sd.keys() == vae.state_dict().keys()
    clips = torch.stack([c[:, :9] for c in _clips(demo)])     # (4, 3, 9, 32, 32)
    with torch.no_grad():
        z = vae.encode(clips).mode()
        z_ref = trained.vae.encode(clips).mode()
        torch.testing.assert_close(z, z_ref, rtol=0, atol=0)
        torch.testing.assert_close(vae.decode(z), trained.vae.decode(z_ref), rtol=0, atol=0)
        # The measured statistics normalize the data's latents to zero mean, unit std per channel.
        zn = vae.normalize(z).transpose(0, 1).flatten(1)          # (C, N)
    torch.testing.assert_close(zn.mean(1), torch.zeros(config.z_dim), atol=1e-3, rtol=0)
    torch.testing.assert_close(zn.std(1, unbiased=False), torch.ones(config.z_dim), atol=1e-3, rtol=0)


def test_idempotent_and_deterministic(trained, demo, tmp_path):
    before = trained.path.stat().st_mtime_ns
    assert train_tiny_vae(demo, trained.path, steps=1, verbose=False) == trained.path
    assert trained.path.stat().st_mtime_ns == before    # existing file kept, nothing retrained

    runs = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        out = tmp_path / name / "vae.safetensors"
        train_tiny_vae(demo, out, steps=2, seed=seed, batch_size=2, frames=5, crop=16, threads=1, verbose=False)
        runs[name] = load_file(str(out))
    assert all(torch.equal(runs["a"][k], runs["b"][k]) for k in runs["a"])
    assert not all(torch.equal(runs["a"][k], runs["c"][k]) for k in runs["a"])


def test_bad_arguments(demo, tmp_path):
    with pytest.raises(ValueError, match="4k \\+ 1"):
        train_tiny_vae(demo, tmp_path / "v.safetensors", frames=6)
    with pytest.raises(ValueError, match="multiple of the VAE's 8x"):
        train_tiny_vae(demo, tmp_path / "v.safetensors", crop=12, steps=1)
    with pytest.raises(FileNotFoundError, match="no videos"):
        train_tiny_vae(tmp_path, tmp_path / "v.safetensors", steps=1)
    assert not (tmp_path / "v.safetensors").exists()


def test_cli(demo, tmp_path, capsys):
    assert cli_main(["train-vae", "--data", str(demo), "--out", str(tmp_path / "v.bin")]) == 2
    assert "must end in .safetensors" in capsys.readouterr().out
    assert cli_main(["train-vae", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "v.safetensors")]) == 2
    assert "no videos" in capsys.readouterr().out


def test_reconstruction_figures_of_a_known_error():
    """PSNR and shape colour error of a stand-in VAE that shifts every pixel by a known amount: 0.1 in
    [-1, 1] is 0.05 in [0, 1], so PSNR = 20 log10(1 / 0.05) = 26.02 dB and the colour error 12.75/255;
    a second clip shifted only on its background keeps its shape colour exactly."""
    from video_dit.families.wan.vae_stage import reconstruction_figures

    class Shift:
        def __init__(self, bg_only=False):
            self.bg_only = bg_only

        def encode(self, x):
            return type("P", (), {"mode": lambda _: x})()

        def decode(self, z):
            shift = torch.full_like(z, 0.1)
            shift[:, :, :, 2:4, 2:4] = 0.0 if self.bg_only else 0.1   # the shape's pixels
            return (z + shift).clamp(-1, 1)

    clip = torch.full((3, 5, 8, 8), -0.9)
    clip[:, :, 2:4, 2:4] = torch.tensor([0.5, -0.5, 0.2]).view(3, 1, 1, 1)   # shape: brightest > -0.8
    fig = reconstruction_figures(Shift(), [clip])
    assert fig["psnr"] == [round(20 * math.log10(1 / 0.05), 2)] and fig["colour_err"] == [12.8]
    fig = reconstruction_figures(Shift(bg_only=True), [clip, clip])
    mse = (0.05 ** 2) * (64 - 4) / 64                                        # 60 of 64 pixels off by 0.05
    assert fig["psnr"] == [round(10 * math.log10(1 / mse), 2)] * 2 and fig["colour_err"] == [0.0, 0.0]


def test_a_real_folder_of_mixed_sizes_is_read_as_a_dataset_and_checked_before_decoding(tmp_path, monkeypatch,
                                                                                        capsys):
    """Clips of several sizes train together (scaled and centre-cropped to the smallest shorter side);
    the folder is read as a dataset is (recursively, as ai-toolkit does: sub-folders but dot-folders, and
    not `_controls/`); unusable clips are found from their headers, never decoded."""
    import numpy as np

    from video_dit import media
    from video_dit.data.dataset import DataWarning
    from video_dit.families.wan import vae_stage

    rng = np.random.default_rng(0)
    d = tmp_path / "real"
    for name, (frames, w, h) in {"wide.mp4": (9, 64, 40), "square.mov": (9, 32, 32), "tall.mkv": (13, 40, 56),
                                 "short.mp4": (3, 32, 32), "sub/extra.mp4": (9, 32, 32),
                                 ".hidden/dot.mp4": (9, 32, 32), "_controls/control.mp4": (9, 32, 32)}.items():
        media.write_video(rng.integers(0, 255, (frames, h, w, 3), dtype=np.uint8), d / name, fps=8)
    (d / "broken.mp4").write_bytes(b"\0" * 100)
    from PIL import Image

    Image.new("RGB", (32, 32)).save(d / "still.png")  # not a clip: ignored
    decoded = []
    read = media.read_video_frames
    monkeypatch.setattr(media, "read_video_frames", lambda p, idx=None: decoded.append(p.name) or read(p, idx))
    with pytest.warns(DataWarning) as caught:
        clips = vae_stage._clips(d, frames=5, cell=8)
    # never short.mp4, broken.mp4, .hidden/ or _controls/
    assert sorted(decoded) == ["extra.mp4", "square.mov", "tall.mkv", "wide.mp4"]
    # sorted by path: square.mov, sub/extra.mp4, tall.mkv, wide.mp4
    assert [tuple(c.shape) for c in clips] == [(3, 9, 32, 32), (3, 9, 32, 32), (3, 13, 32, 32), (3, 9, 32, 32)]
    warned = " | ".join(str(w.message) for w in caught)
    assert "short.mp4: skipped by the VAE stage: 3 frames, fewer than the 5-frame training windows" in warned
    assert "broken.mp4: skipped by the VAE stage" in warned
    # the wide clip: scaled to cover 32 px of height, its centre 32 columns kept (crop_plan, as the trainer does)
    wide = media.read_video(d / "wide.mp4")  # (F, 3, 40, 64)
    resized = torch.nn.functional.interpolate(wide, size=(32, 51), mode="bicubic", antialias=True,
                                              align_corners=False).clamp(-1, 1)
    torch.testing.assert_close(clips[3].permute(1, 0, 2, 3), resized[:, :, :, 9:41], rtol=0, atol=1e-6)
    # the stage trains on it, through the command
    with pytest.warns(DataWarning):
        assert cli_main(["train-vae", "--data", str(d), "--out", str(tmp_path / "v.safetensors"), "--steps", "2",
                         "--frames", "5", "--threads", "1"]) == 0
    assert load_vae(tmp_path / "v.safetensors").config.z_dim == len(VAEConfig.from_dict(
        json.loads((tmp_path / CONFIG_NAME).read_text())).mean)
    # nothing usable: an error before any decode
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "broken.mp4").write_bytes(b"\0" * 100)
    decoded.clear()
    with pytest.raises(ValueError, match="no clip the VAE stage can use.*broken.mp4"):
        vae_stage._clips(bad, frames=5, verbose=False)
    assert decoded == []


# one step at lr 1e-12 on one 9-frame window, whole frames: the first loss is the init's, on a fixed window
AT_INIT = dict(steps=1, seed=0, batch_size=1, frames=9, crop=None, lr=1e-12, sample_posterior=False, threads=1,
               verbose=False)


def test_recipe_latent_init_scale_and_cell_term(tmp_path):
    """`latent_init_scale` multiplies the initial posterior mean (quant_conv's mean half, not its
    logvar half); `cell_weight` adds w x the mean |error of each 8x8 cell's mean colour| to the loss,
    recomputed here from the same init and window (one 9-frame clip, whole frames: the window is fixed)."""
    from torch.nn.functional import avg_pool3d

    from video_dit.families.wan.presets import VAE_PRESETS
    from video_dit.families.wan.vae import CausalVideoVAE

    d = tmp_path / "one"
    make_demo_data(d, count=1, frames=9, size=32, seed=0, holdout=0)
    base = train_tiny_vae_result(d, tmp_path / "a.safetensors", **AT_INIT)
    scaled = train_tiny_vae_result(d, tmp_path / "b.safetensors", latent_init_scale=100.0, **AT_INIT)
    celled = train_tiny_vae_result(d, tmp_path / "c.safetensors", cell_weight=4.0, **AT_INIT)
    z = base.vae.config.z_dim
    a, b = base.vae.conv1.weight.detach(), scaled.vae.conv1.weight.detach()
    torch.testing.assert_close(b[:z], 100 * a[:z], rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(b[z:], a[z:], rtol=1e-5, atol=1e-9)

    torch.manual_seed(0)
    vae = CausalVideoVAE(VAE_PRESETS["tiny"]).train()
    x = torch.stack(_clips(d, 9, 8, verbose=False))                     # (1, 3, 9, 32, 32)
    with torch.no_grad():
        err = vae.decode(vae.encode(x, chunked=False).mode(), chunked=False, clamp=False) - x
    expected = 4.0 * float(avg_pool3d(err, (1, 8, 8)).abs().mean())
    assert abs((celled.losses[0] - base.losses[0]) - expected) < 1e-5 * max(1.0, expected), \
        (celled.losses[0], base.losses[0], expected)


def test_clamped_error_frees_only_overshoot_that_the_clamp_corrects():
    """decode clamps to [-1, 1]: past -1 on a black truth pixel (or past 1 on a white one) the pixel
    comes out right, so its error is 0; everywhere else it is recon - x (here by hand, pixel by pixel)."""
    from video_dit.families.wan.vae_stage import clamped_error

    x = torch.tensor([-1.0, -1.0, -1.0, 1.0, 1.0, 0.2, 0.2, -0.5])
    r = torch.tensor([-1.7, -0.6, -1.0, 1.4, 0.7, -1.3, 1.3, -0.5])
    expected = torch.tensor([0.0, 0.4, 0.0, 0.0, -0.3, -1.5, 1.1, 0.0])
    torch.testing.assert_close(clamped_error(r, x), expected)


def _static_clip(folder, frames=9, size=32):
    """One clip whose frames are all the same (a red square): every frame of it is the same shot."""
    from video_dit.media import write_video

    folder.mkdir()
    clip = torch.zeros(frames, size, size, 3, dtype=torch.uint8)
    clip[:, 8:24, 8:24] = torch.tensor([230, 40, 40], dtype=torch.uint8)
    write_video(clip.numpy(), folder / "0000.mp4", fps=16)
    (folder / "0000.txt").write_text("a red square moving right on a black background\n")
    return folder


def test_recipe_images_add_the_first_frame_path_loss(tmp_path):
    """`images=k` adds, to each step's window loss, the same weighted loss of k single frames through
    the first-frame path (recomputed here from the init: one static clip, so every shot is its frame)."""
    from video_dit.families.wan.presets import VAE_PRESETS
    from video_dit.families.wan.vae import CausalVideoVAE
    from video_dit.families.wan.vae_stage import _foreground, clamped_error

    d = _static_clip(tmp_path / "one")
    kw = dict(AT_INIT, fg_weight=8.0)
    base = train_tiny_vae_result(d, tmp_path / "a.safetensors", **kw)
    shots = train_tiny_vae_result(d, tmp_path / "b.safetensors", images=2, **kw)

    torch.manual_seed(0)
    vae = CausalVideoVAE(VAE_PRESETS["tiny"]).train()
    x = torch.stack(_clips(d, 9, 8, verbose=False))[:, :, :1].repeat(2, 1, 1, 1, 1)     # (2, 3, 1, 32, 32)
    with torch.no_grad():
        err = clamped_error(vae.decode(vae.encode(x, chunked=False).mode(), chunked=False, clamp=False), x)
    w = 1.0 + 8.0 * _foreground(x).unsqueeze(1)
    expected = float((w * (err.abs() + err.pow(2))).mean() / w.mean())
    # to 1e-4: the shots are the clip's frames, which its MP4 decodes equal to within 2 grey levels
    assert abs((shots.losses[0] - base.losses[0]) - expected) < 1e-4 * max(1.0, expected), \
        (shots.losses[0], base.losses[0], expected)


def _weighted_loss_at_init(d, frames, ring=0, bright=0.0):
    """The first step's weighted loss (fg_weight 8) of the static clip's first `frames` frames through
    the same-seed `tiny` init, the weight dilated by hand: 9 on every pixel within `ring` px (a
    (2 ring + 1)^2 square) of a shape pixel, shifted mask by shifted mask, else 1. `bright` adds that
    times the same weighted loss of each pixel's brightest channel (max over R, G, B)."""
    from video_dit.families.wan.presets import VAE_PRESETS
    from video_dit.families.wan.vae import CausalVideoVAE
    from video_dit.families.wan.vae_stage import _foreground, clamped_error

    torch.manual_seed(0)
    vae = CausalVideoVAE(VAE_PRESETS["tiny"]).train()
    x = torch.stack(_clips(d, 9, 8, verbose=False))[:, :, :frames]                   # (1, 3, frames, 32, 32)
    with torch.no_grad():
        recon = vae.decode(vae.encode(x, chunked=False).mode(), chunked=False, clamp=False)
    err = clamped_error(recon, x)
    top = clamped_error(recon.amax(1, keepdim=True), x.amax(1, keepdim=True))       # (1, 1, frames, 32, 32)
    fg = _foreground(x)                                                              # (1, frames, 32, 32)
    near = torch.zeros_like(fg)
    padded = torch.nn.functional.pad(fg, (ring, ring, ring, ring))
    for dy in range(2 * ring + 1):
        for dx in range(2 * ring + 1):
            near = torch.maximum(near, padded[..., dy:dy + fg.shape[-2], dx:dx + fg.shape[-1]])
    w = 1.0 + 8.0 * near.unsqueeze(1)
    return float(((w * (err.abs() + err.pow(2))).mean() + bright * (w * (top.abs() + top.pow(2))).mean()) / w.mean())


def test_recipe_fg_ring_weighs_both_sides_of_an_edge(tmp_path):
    """`fg_ring=r` puts fg_weight on every pixel within r px of a shape, outside it too (the blur of an
    edge costs on both sides): the first step's loss is the loss recomputed with that weight, and
    differs from the plain one."""
    d = _static_clip(tmp_path / "one")
    kw = dict(AT_INIT, fg_weight=8.0)
    plain = train_tiny_vae_result(d, tmp_path / "a.safetensors", **kw)
    ring = train_tiny_vae_result(d, tmp_path / "b.safetensors", fg_ring=2, **kw)
    expected_plain, expected_ring = _weighted_loss_at_init(d, 9), _weighted_loss_at_init(d, 9, ring=2)
    assert abs(expected_ring - expected_plain) > 1e-3 * expected_plain
    assert abs(plain.losses[0] - expected_plain) < 1e-4 * expected_plain, (plain.losses[0], expected_plain)
    assert abs(ring.losses[0] - expected_ring) < 1e-4 * expected_ring, (ring.losses[0], expected_ring)


def test_recipe_bright_weight_adds_the_brightest_channel_error(tmp_path):
    """`bright_weight=w` adds w x the weighted loss of each pixel's brightest channel (a shape's outline
    on black whatever its colour; the per-channel terms count a red edge's error in about one channel
    where a white edge's counts in three): step 0's loss is the one recomputed with it."""
    d = _static_clip(tmp_path / "one")
    kw = dict(AT_INIT, fg_weight=8.0, fg_ring=1)
    plain = train_tiny_vae_result(d, tmp_path / "a.safetensors", **kw)
    bright = train_tiny_vae_result(d, tmp_path / "b.safetensors", bright_weight=3.0, **kw)
    expected_plain, expected = _weighted_loss_at_init(d, 9, ring=1), _weighted_loss_at_init(d, 9, ring=1, bright=3.0)
    assert expected > 1.2 * expected_plain
    assert abs(plain.losses[0] - expected_plain) < 1e-4 * expected_plain, (plain.losses[0], expected_plain)
    assert abs(bright.losses[0] - expected) < 1e-4 * expected, (bright.losses[0], expected)


def test_recipe_image_steps_train_single_frames_first(tmp_path):
    """During the first `image_steps` steps a step is single frames alone (images + batch x frames of
    them, through the first-frame path): on the static clip, step 0's loss is one frame's loss
    (recomputed from the init), not the window's plus the frames'."""
    d = _static_clip(tmp_path / "one")
    kw = dict(AT_INIT, fg_weight=8.0, images=2)
    first = train_tiny_vae_result(d, tmp_path / "a.safetensors", image_steps=1, **kw)
    mixed = train_tiny_vae_result(d, tmp_path / "b.safetensors", **kw)     # the window's loss + the frames'
    expected = _weighted_loss_at_init(d, 1)
    # to 2e-3: the shots are random frames of the clip, which its MP4 decodes equal to frame 0 within
    # 2 grey levels; the window-and-frames step is ~2x that
    assert abs(first.losses[0] - expected) < 2e-3 * expected, (first.losses[0], expected)
    assert mixed.losses[0] > 1.5 * expected, (mixed.losses[0], expected)


def test_two_ranks_take_the_one_rank_step(tmp_path):
    """`ranks=2`: two processes (gloo), each a share of every step's windows and frames, gradients
    summed. Against the same recipe in one process: every loss term's share is normalized by the
    whole step, so step 1's logged loss is the same sum; step 2's loss follows step 1's update, so it
    matches only if the summed gradient is the whole step's (a rank's half alone moves other weights).
    Later steps agree to float-summation noise, which Adam's sign-like first updates amplify."""
    d = tmp_path / "data"
    make_demo_data(d, count=6, frames=9, size=32, seed=0, holdout=0)
    kw = dict(steps=4, frames=5, batch_size=2, crop=None, images=3, image_steps=1, fg_ring=1, cell_weight=4.0,
              bright_weight=2.0, sample_posterior=True, colour_path=True, preset="tiny-p2", threads=1, verbose=False)
    one = train_tiny_vae_result(d, tmp_path / "a" / "v.safetensors", ranks=1, **kw)
    two = train_tiny_vae_result(d, tmp_path / "b" / "v.safetensors", ranks=2, **kw)
    assert len(two.losses) == 4 and (tmp_path / "b" / "v.safetensors").is_file()
    for step in (0, 1):
        assert abs(two.losses[step] - one.losses[step]) < 1e-5 * one.losses[step], (one.losses, two.losses)
    for step in (2, 3):
        assert abs(two.losses[step] - one.losses[step]) < 2e-3 * one.losses[step], (one.losses, two.losses)


def test_recipe_ema_saves_the_moving_average_of_the_weights(tmp_path):
    """`ema=d` saves and returns the exponential moving average of the weights in place of the last
    step's (torch's AveragedModel: the first step's weights, then ema = d ema + (1 - d) w). Two steps
    at d = 0.5 must give the mean of the weights after step 1 (a 1-step run: the first step's
    learning rate is the same whatever the step count) and after step 2 (a 2-step run without EMA)."""
    from safetensors.torch import load_file

    d = _static_clip(tmp_path / "one")
    kw = dict(AT_INIT, lr=1e-2, fg_weight=8.0)
    w1 = train_tiny_vae_result(d, tmp_path / "a" / "v.safetensors", **kw).vae.state_dict()
    w2 = train_tiny_vae_result(d, tmp_path / "b" / "v.safetensors", **dict(kw, steps=2)).vae.state_dict()
    avg = train_tiny_vae_result(d, tmp_path / "c" / "v.safetensors", **dict(kw, steps=2, ema=0.5))
    saved = load_file(tmp_path / "c" / "v.safetensors")
    names = [n for n, _ in avg.vae.named_parameters()]
    assert max(float((w2[n] - w1[n]).abs().max()) for n in names) > 1e-4      # step 2 moved the weights
    for n in names:
        torch.testing.assert_close(avg.vae.state_dict()[n], (w1[n] + w2[n]) / 2, atol=1e-6, rtol=0)
        torch.testing.assert_close(saved[n], (w1[n] + w2[n]) / 2, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="ema"):
        train_tiny_vae_result(d, tmp_path / "d" / "v.safetensors", **dict(kw, ema=1.0))


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU has no native bf16")
def test_recipe_bf16_is_the_same_loss_in_bfloat16(tmp_path):
    """`bf16` runs the VAE under bfloat16 autocast: the first step's loss differs from float32's (it did
    run in bf16) by bf16 rounding only (< 2%), and the weights stay float32."""
    d = _static_clip(tmp_path / "one")
    fp32 = train_tiny_vae_result(d, tmp_path / "a.safetensors", **AT_INIT)
    bf16 = train_tiny_vae_result(d, tmp_path / "b.safetensors", bf16=True, **AT_INIT)
    assert fp32.losses[0] != bf16.losses[0]
    assert abs(bf16.losses[0] - fp32.losses[0]) < 0.02 * fp32.losses[0], (fp32.losses[0], bf16.losses[0])
    assert all(p.dtype == torch.float32 for p in bf16.vae.parameters())


@pytest.mark.parametrize("preset", ["tiny", "tiny-p2"])
def test_colour_path_init_starts_as_a_mean_colour_codec(preset):
    """`init_colour_path`: before the encoder head, channels 0-2 are each latent cell's mean RGB (the
    first frame alone, then each group of 4: avg_pool3d here); z[:, :3] is that after the head's
    norm and SiLU; before the decoder head, channels 0-2 are z[:, :3] copied over the cell's pixels
    and the group's frames (repeat_interleave here), and the output's R, G, B are that after the
    head's norm and SiLU. The attention blocks' constant bias is zeroed so the paths compare bare;
    the other channels stay random (the test would pass for a no-op on them, not on 0-2). With the
    2x2 patchify (`tiny-p2`) the decoder head runs on 2x2 blocks, each pixel of a block its colour."""
    import dataclasses

    import torch.nn.functional as F

    from video_dit.families.wan.presets import VAE_PRESETS
    from video_dit.families.wan.vae import CausalVideoVAE
    from video_dit.families.wan.vae_layers import AttentionBlock
    from video_dit.families.wan.vae_stage import init_colour_path

    torch.manual_seed(0)
    vae = CausalVideoVAE(VAE_PRESETS[preset])
    p = vae.config.patch_size
    init_colour_path(vae)
    with torch.no_grad():
        for m in vae.modules():
            if isinstance(m, AttentionBlock):
                m.proj.bias.zero_()
    seen = {}
    for name, coder in (("enc", vae.encoder), ("dec", vae.decoder)):
        coder.head[2].register_forward_pre_hook(lambda m, args, name=name: seen.__setitem__(name, args[0].detach()))
    x = torch.rand(2, 3, 9, 32, 32) * 2 - 1
    z = vae.encode(x, chunked=False).mode()                                 # autograd path: one call each
    out = vae.decode(z, chunked=False, clamp=False).detach()
    z = z.detach()

    groups = torch.cat([x[:, :, :1], x[:, :, 1:].unflatten(2, (-1, 4)).mean(3)], 2)   # (2, 3, 3, 32, 32)
    torch.testing.assert_close(seen["enc"][:, :3], F.avg_pool3d(groups, (1, 8, 8)), atol=1e-5, rtol=1e-5)
    norm_silu = lambda h: F.silu(F.normalize(h, dim=1) * h.shape[1] ** 0.5)[:, :3]    # gammas are one
    torch.testing.assert_close(z[:, :3], norm_silu(seen["enc"]), atol=1e-5, rtol=1e-5)
    copies = torch.cat([z[:, :3, :1], z[:, :3, 1:].repeat_interleave(4, dim=2)], 2)
    copies = copies.repeat_interleave(8 // p, dim=3).repeat_interleave(8 // p, dim=4)  # (2, 3, 9, 32/p, 32/p)
    torch.testing.assert_close(seen["dec"][:, :3], copies, atol=1e-5, rtol=1e-5)
    pixels = norm_silu(seen["dec"]).repeat_interleave(p, dim=3).repeat_interleave(p, dim=4)
    torch.testing.assert_close(out, pixels, atol=1e-5, rtol=1e-5)
    assert seen["enc"][:, 3:].std() > 0.1 and seen["dec"][:, 3:].std() > 0.1      # the rest: random features

    with pytest.raises(ValueError, match="Wan 2.1 block layout"):
        init_colour_path(CausalVideoVAE(dataclasses.replace(VAE_PRESETS["tiny"], is_residual=True)))


@pytest.mark.parametrize("key,value", [("latent_init_scale", -1.0), ("cell_weight", -0.5), ("fg_weight", -2.0),
                                       ("bright_weight", -1.0),
                                       ("images", -1), ("fg_ring", -1), ("image_steps", -1), ("image_steps", 151),
                                       ("ranks", 0), ("ranks", 3), ("preset", "tiny-nope"), ("ema", 1.0),
                                       ("ema", -0.1)])
def test_prepare_refuses_a_bad_recipe_value_naming_the_key(tmp_path, key, value):
    from video_dit.train.validate import prepare
    from video_dit.typed_config import ConfigError

    raw = {"job": "extension", "config": {"name": "x", "process": [{
        "type": "sd_trainer", "model": {"vae_path": str(tmp_path / "v.safetensors")},
        "prepare": {"tiny_vae": {"data": str(tmp_path), key: value}}}]}}
    with pytest.raises(ConfigError) as err:
        prepare(raw, log=lambda *_: None)
    assert f"prepare.tiny_vae.{key}" in str(err.value) and str(value) in str(err.value)
    assert not (tmp_path / "v.safetensors").exists()
