"""The flow-matching training objective, written once. The DeepSpeed trainer's step and any loss
computed "as training does" (validation) call `flow_matching_loss`; the ai-toolkit arch runs the
same conditioning object and weights inside ai-toolkit's own loop (tests/test_objective.py checks
that both give the same number for the same t and noise).

    x_t    = (1 - t/1000) x0 + t/1000 noise                        (flow.add_noise)
    target = noise - x0                                              (flow.velocity_target)
    model_in, timestep, mask = conditioning.apply(x_t, t, cond, active)   (i2v; else x_t, t, no mask)
    loss   = mean_i [ masked_mse(pred_i, target_i, mask_i) * weight_i ]   (per-sample masked mean)

A family whose DiT generates sound (`Family.audio`) trains both streams in one step (`AudioBatch`):
    a_t    = (1 - t_a/1000) a0 + t_a/1000 noise_a,  t_a = 1000 for a sample without sound
    (pred, a_pred) = model(model_in, timestep, context, audio=a_t, audio_timestep=t_a, ...)
    loss   = video loss + w_a mean_i [ present_i mse(a_pred_i, noise_a_i - a0_i) weight(t_a_i) ]
as Lightricks' ltx-trainer computes it (training_strategies/text_to_video.py `compute_loss`: the video's
masked mean plus the audio's mean, per sample, then the batch mean; w_a its 1). A sample without sound
(a clip without an audio stream: `DataItem.has_audio` False) trains the picture alone: its audio input is
pure noise (t_a = 1000: nothing of a made-up track reaches the video stream) and its audio loss is 0, so
its gradient through the audio prediction is exactly zero.

Everything random (t, noise) is an argument: the caller draws them (the trainer from its
(seed, rank, step, micro) generator), so the same inputs give the same loss anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from video_dit.diffusion.conditioning import FirstFrameConditioning, masked_mse
from video_dit.diffusion.flow import NUM_TRAIN_TIMESTEPS, add_noise, velocity_target


def training_inputs(x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor,
                    conditioning: FirstFrameConditioning | None = None, cond: dict | None = None,
                    active: torch.Tensor | None = None):
    """(model_input, timestep, target, loss_mask or None) for clean latents x0 (B, C, F', h, w),
    timesteps t (B,) on 0..1000 and noise like x0. With `conditioning`, `cond` holds its tensors and
    `active` (B,) bool picks the samples it conditions (None: all)."""
    x_t, target = add_noise(x0, noise, t), velocity_target(x0, noise)
    if conditioning is None:
        return x_t, t, target, None
    model_in, timestep, mask = conditioning.apply(x_t, t, cond, active)
    return model_in, timestep, target, mask


def weighted_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None,
                  weight: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over samples of each sample's masked MSE (float32) times its weight (B,) (None: 1)."""
    B = pred.shape[0]
    per_sample = torch.stack([masked_mse(pred[i:i + 1], target[i:i + 1], None if mask is None else mask[i:i + 1])
                              for i in range(B)])  # (B,)
    if weight is not None:
        per_sample = per_sample * weight.to(per_sample.device, torch.float32)
    return per_sample.mean()


@dataclass
class AudioBatch:
    """The audio stream of a batch, for a DiT that generates sound (module docstring)."""

    x0: torch.Tensor         # (B, ...) the clips' normalized audio latents (zeros for a sample without sound)
    noise: torch.Tensor      # like x0
    t: torch.Tensor          # (B,) on 0..1000: the audio stream's timesteps (the video's when tied)
    present: torch.Tensor    # (B,) bool: the sample has sound (its audio loss counts)
    loss_weight: float = 1.0  # the audio loss's weight beside the video's 1
    weight: torch.Tensor | None = None  # (B,) per-sample weights at t (`TimestepSampler.loss_weight`) or None


def audio_loss(a_pred: torch.Tensor, audio: AudioBatch) -> torch.Tensor:
    """Mean over the batch of each sample's audio MSE (float32), 0 for samples without sound."""
    target = velocity_target(audio.x0, audio.noise)
    per_sample = (a_pred.float() - target.float()).square().flatten(1).mean(1)  # (B,)
    if audio.weight is not None:
        per_sample = per_sample * audio.weight.to(per_sample.device, torch.float32)
    return (per_sample * audio.present.to(per_sample.device, torch.float32)).mean()


def flow_matching_loss(model: Callable, x0: torch.Tensor, context, t: torch.Tensor, noise: torch.Tensor, *,
                       conditioning: FirstFrameConditioning | None = None, cond: dict | None = None,
                       active: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                       text_kwargs: dict | None = None, audio: AudioBatch | None = None,
                       parts: dict | None = None, cond_noise: torch.Tensor | None = None) -> torch.Tensor:
    """The training loss of one batch at given timesteps and noise: `model(model_in, timestep, context,
    **text_kwargs, **conditioning.dit_kwargs(cond, active, t=t, noise=cond_noise))` (a DiT or a DeepSpeed engine) on
    `training_inputs`, reduced by `weighted_loss`; with `audio`, both streams (module docstring).

    x0: (B, C, F', h, w) float32; context: the DiT's text argument (Wan: B embeddings (Lt_i, D);
    HunyuanVideo 1.5: (B, Lt, D) padded, its mask and glyphs in `text_kwargs`); t: (B,); noise: like x0;
    weight: (B,) per-sample loss weights (`TimestepSampler.loss_weight(t)`) or None. `parts`: a dict that
    receives each stream's loss (detached floats: "video", and with audio "audio"). `cond_noise`: (B, C, 1, h, w)
    the conditioning's own noise of this step (MiniMax H3's keyframe rows, held at 0.999 z + 0.001 noise), drawn by
    the caller like `noise`; the conditioning reads it and t in `dit_kwargs`.
    """
    model_in, timestep, target, mask = training_inputs(x0, t, noise, conditioning, cond, active)
    # the image branch's embeds (Wan, HunyuanVideo 1.5); MiniMax H3's keyframe rows at this step's t
    extra = conditioning.dit_kwargs(cond, active, t=t, noise=cond_noise) if conditioning is not None else {}
    kwargs = {**(text_kwargs or {}), **extra}
    if audio is None:
        pred = model(model_in, timestep, context, **kwargs)  # (B, C, F', h, w)
        loss = weighted_loss(pred, target, mask, weight)
        if parts is not None:
            parts["video"] = float(loss.detach())
        return loss
    t_a = torch.where(audio.present.to(audio.t.device), audio.t, torch.full_like(audio.t, NUM_TRAIN_TIMESTEPS))
    a_in = add_noise(audio.x0, audio.noise, t_a)
    pred, a_pred = model(model_in, timestep, context, audio=a_in, audio_timestep=t_a, **kwargs)
    video = weighted_loss(pred, target, mask, weight)
    sound = audio_loss(a_pred, AudioBatch(audio.x0, audio.noise, t_a, audio.present, audio.loss_weight, audio.weight))
    if parts is not None:
        parts.update(video=float(video.detach()), audio=float(sound.detach()))
    return video + audio.loss_weight * sound
