"""The trainer's side of sound (issue 47), on the tiny LTX-2 in this process (no launch):

- per-modality timesteps: the trainer's own draws (`Trainer.loss_of`: one generator per sample and stream) of the
  video's and the audio's timesteps follow the configured distribution: a Kolmogorov-Smirnov test of 2000 draws
  against the CDF of `TimestepSampler`'s distribution, written here from its definition (the shift map inverted;
  the logit-normal's normal CDF), for a shifted distribution conditioned on [100, 900] and a logit-normal one; a
  sibling distribution fails the same test. `train.audio_timesteps: tied` gives each sample's audio the video's t;
  `independent` its own draw from the same distribution, uncorrelated with the video's.
- a dataset of a clip with sound, a silent clip, a clip without an audio stream and one with a corrupt audio
  stream: the counts and the one warning of the scan, what each clip caches (`trainer.audio_entry`), and the
  masked loss (`flow_matching_loss` on a tiny LTX-2 DiT): the gradient of the loss w.r.t. the DiT's audio
  prediction is exactly zero for the clip without sound and not for the others (silence is sound), the video
  prediction's gradient is not zero for any, and the DiT reads the soundless clip's audio at t = 1000 (pure noise).
"""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import helpers
import pytest
import torch
from test_audio import _dataset  # the four clips of the sound tests

from video_dit.data.dataset import DatasetConfig, DataWarning, scan_dataset
from video_dit.diffusion.flow import TimestepSampler
from video_dit.diffusion.objective import AudioBatch, flow_matching_loss
from video_dit.families.ltx2 import FAMILY as LTX2
from video_dit.families.ltx2.dit import LTX2DiT
from video_dit.families.ltx2.presets import TINY_LTX2_DIT
from video_dit.train.trainer import Trainer, audio_entry
from video_dit.typed_config import parse

STEPS, BATCH = 500, 4  # 2000 draws per stream
KS_CRITICAL = 1.63 / math.sqrt(STEPS * BATCH)  # the two-sided KS statistic's 1% critical value, 0.036


def _draws(sampler: TimestepSampler, audio_timesteps: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The video and audio timesteps `Trainer.loss_of` draws over STEPS optimizer steps of BATCH samples (a
    stand-in trainer: the attributes loss_of reads; `loss_at` records what it is given)."""
    seen = []
    trainer = SimpleNamespace(p=SimpleNamespace(train=SimpleNamespace(seed=7, batch_size=BATCH)), dp_rank=0, step=0,
                              timesteps=sampler, audio_timesteps=audio_timesteps, _drawn_t=[], _parts={},
                              conditioning=None,
                              loss_at=lambda batch, t, noise, audio_t, audio_noise, parts, cond_noise: seen.append(
                                      (t, t if audio_t is None else audio_t)))  # None: tied (loss_at: t)
    batch = {"latents": torch.zeros(BATCH, 8, 1, 1, 1), "audio_latents": torch.zeros(BATCH, 2, 1, 4)}
    for step in range(STEPS):
        trainer.step = step
        Trainer.loss_of(trainer, batch, 0)
    return torch.cat([t for t, _ in seen]).double(), torch.cat([a for _, a in seen]).double()


def _shift_cdf(t, shift, lo, hi):
    """P(T <= t) of `shift`: T/1000 = shift u / (1 + (shift - 1) u), u ~ U(0, 1), conditioned on [lo, hi]."""
    def u(x):  # the shift map inverted: u = s / (shift - (shift - 1) s)
        s = x / 1000
        return s / (shift - (shift - 1) * s)
    return (u(t) - u(lo)) / (u(hi) - u(lo))


def _logit_normal_cdf(t, mean=0.0, std=1.0):
    s = (t / 1000).clamp(1e-12, 1 - 1e-12)
    z = (torch.log(s / (1 - s)) - mean) / std
    return 0.5 * (1 + torch.erf(z / math.sqrt(2)))


def _ks(x: torch.Tensor, cdf) -> float:
    """sup |empirical CDF - cdf| of the sample x."""
    x, _ = x.sort()
    n = x.numel()
    f = cdf(x)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return max((i / n - f).max().item(), (f - (i - 1) / n).max().item())


CASES = {
    "shift_3_on_100_900": (TimestepSampler("shift", shift=3.0, min_t=100, max_t=900),
                           lambda t: _shift_cdf(t, 3.0, 100.0, 900.0), lambda t: _shift_cdf(t, 2.5, 100.0, 900.0)),
    "logit_normal": (TimestepSampler("logit_normal"), _logit_normal_cdf, lambda t: _logit_normal_cdf(t, 0.2)),
}


@pytest.mark.parametrize("case", CASES)
def test_per_modality_timesteps_follow_the_configured_distribution(case):
    sampler, cdf, sibling = CASES[case]
    tied_v, tied_a = _draws(sampler, "tied")
    video, audio = _draws(sampler, "independent")
    stats = {"video": _ks(video, cdf), "audio": _ks(audio, cdf), "audio_sibling": _ks(audio, sibling)}
    print(f"\n{case}: KS video {stats['video']:.4f}, audio {stats['audio']:.4f} (critical {KS_CRITICAL:.4f}); "
          f"against the sibling distribution {stats['audio_sibling']:.4f}")
    assert stats["video"] < KS_CRITICAL and stats["audio"] < KS_CRITICAL
    assert stats["audio_sibling"] > KS_CRITICAL  # the test tells the distributions apart
    assert torch.equal(tied_v, video)  # the video's draws do not depend on the audio's choice
    assert torch.equal(tied_a, tied_v)  # tied: each sample's audio at its video t
    assert (audio != video).all()  # independent: its own draw for every sample ...
    r = torch.corrcoef(torch.stack([video, audio]))[0, 1].item()
    assert abs(r) < 3 / math.sqrt(video.numel()), r  # ... uncorrelated with the video's (|r| < 3 sigma)


def test_a_clip_without_sound_trains_the_picture_alone(tmp_path, capsys):
    _dataset(tmp_path / "d", size=64)  # sound.mp4, silent.mp4, nosound.mp4, corrupt.mp4 (24 frames at 16 fps)
    cfg = parse(DatasetConfig, {"folder_path": str(tmp_path / "d"), "num_frames": 9, "fps": 16, "resolution": [64],
                                "shrink_video_to_frames": False}, "ds")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scan = scan_dataset(cfg, 64, verbose=True, audio=LTX2.audio is not None)
    warned = [str(w.message) for w in caught if issubclass(w.category, DataWarning)]
    assert len(warned) == 1 and "corrupt.mp4: skipped: corrupt audio" in warned[0], warned
    assert scan.audio_counts() == {"sound": 2, "silent": 1, "none": 1, "corrupt": 1}
    out = capsys.readouterr().out
    assert "1 without an audio stream train the picture alone (audio loss masked)" in out  # said once, counted
    items = {it.path.rsplit("/", 1)[1]: it for it in scan.items}
    names = ["sound.mp4", "silent.mp4", "nosound.mp4"]
    assert sorted(items) == sorted(names)

    codec = LTX2.audio.load_codec(LTX2.random_source(LTX2.presets["tiny-ltx2-t2v"], "audio"))
    entries = [audio_entry(items[n], codec, LTX2.audio, 16, "cpu", torch.float32) for n in names]
    assert [bool(e["has_audio"]) for e in entries] == [True, True, False]
    # one shape, the encoder's for the span (9 frames at 16 fps: 9000 samples, 57 mel frames, 15 latents; the
    # sampled length, round(9 / 16 x 25), is 14): a bucket's clips with and without sound batch together
    assert [tuple(e["audio_latents"].shape) for e in entries] == [(1, 2, 15, 4)] * 3
    assert entries[1]["audio_latents"].abs().sum() > 0 and not entries[2]["audio_latents"].any()  # silence encoded
    assert [float(e["fps"]) for e in entries] == [16.0] * 3

    # the masked loss, hooked on a tiny DiT: its audio prediction's and video prediction's gradients
    dit = helpers.randomize_all(LTX2DiT(TINY_LTX2_DIT, init_seed=0), seed=1)
    preds, timesteps = {}, {}

    def keep(module, args, kwargs, out):
        timesteps["audio"] = kwargs["audio_timestep"]
        for name, p in zip(("video", "audio"), out):
            p.retain_grad()
            preds[name] = p
    dit.register_forward_hook(keep, with_kwargs=True)
    g = torch.Generator().manual_seed(0)
    B = len(names)
    a0 = torch.cat([e["audio_latents"] for e in entries])
    x0 = torch.randn(B, 8, 2, 2, 2, generator=g)
    t = torch.tensor([300.0, 600.0, 800.0])
    sound = AudioBatch(a0, torch.randn(a0.shape, generator=g), t, torch.cat([e["has_audio"] for e in entries]))
    context = torch.randn(B, 5, TINY_LTX2_DIT.hidden_size, generator=g)
    loss = flow_matching_loss(dit, x0, context, t, torch.randn(x0.shape, generator=g), audio=sound,
                              text_kwargs={"audio_context": torch.randn(B, 5, TINY_LTX2_DIT.audio_hidden_size,
                                                                        generator=g), "fps": 16.0})
    loss.backward()
    audio_grad, video_grad = preds["audio"].grad, preds["video"].grad
    assert timesteps["audio"].tolist() == [300.0, 600.0, 1000.0]  # no sound: its audio input is pure noise
    assert torch.equal(audio_grad[2], torch.zeros_like(audio_grad[2]))  # exactly zero: masked, not small
    assert audio_grad[0].abs().sum() > 0 and audio_grad[1].abs().sum() > 0  # sound, and silence as sound
    assert all(video_grad[i].abs().sum() > 0 for i in range(B))  # every clip's picture trains
