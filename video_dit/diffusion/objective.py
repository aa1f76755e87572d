"""The flow-matching training objective, written once. The DeepSpeed trainer's step and any loss
computed "as training does" (validation) call `flow_matching_loss`; the ai-toolkit arch runs the
same conditioning object and weights inside ai-toolkit's own loop (tests/test_objective.py checks
that both give the same number for the same t and noise).

    x_t    = (1 - t/1000) x0 + t/1000 noise                        (flow.add_noise)
    target = noise - x0                                              (flow.velocity_target)
    model_in, timestep, mask = conditioning.apply(x_t, t, cond, active)   (i2v; else x_t, t, no mask)
    loss   = mean_i [ masked_mse(pred_i, target_i, mask_i) * weight_i ]   (per-sample masked mean)

Everything random (t, noise) is an argument: the caller draws them (the trainer from its
(seed, rank, step, micro) generator), so the same inputs give the same loss anywhere.
"""

from __future__ import annotations

from typing import Callable

import torch

from video_dit.diffusion.conditioning import FirstFrameConditioning, masked_mse
from video_dit.diffusion.flow import add_noise, velocity_target


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


def flow_matching_loss(model: Callable, x0: torch.Tensor, context, t: torch.Tensor, noise: torch.Tensor, *,
                       conditioning: FirstFrameConditioning | None = None, cond: dict | None = None,
                       active: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                       text_kwargs: dict | None = None) -> torch.Tensor:
    """The training loss of one batch at given timesteps and noise: `model(model_in, timestep, context,
    **text_kwargs, **conditioning.dit_kwargs(cond, active))` (a DiT or a DeepSpeed engine) on
    `training_inputs`, reduced by `weighted_loss`.

    x0: (B, C, F', h, w) float32; context: the DiT's text argument (Wan: B embeddings (Lt_i, D);
    HunyuanVideo 1.5: (B, Lt, D) padded, its mask and glyphs in `text_kwargs`); t: (B,); noise: like x0;
    weight: (B,) per-sample loss weights (`TimestepSampler.loss_weight(t)`) or None.
    """
    model_in, timestep, target, mask = training_inputs(x0, t, noise, conditioning, cond, active)
    extra = conditioning.dit_kwargs(cond, active) if conditioning is not None else {}  # the image branch's embeds
    pred = model(model_in, timestep, context, **(text_kwargs or {}), **extra)  # (B, C, F', h, w)
    return weighted_loss(pred, target, mask, weight)
