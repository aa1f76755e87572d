"""Flow-matching Euler sampler with classifier-free guidance and first-frame conditioning.

Conventions are those of `flow.py`: time on 0..1000, the DiT predicts velocity v = noise - x0, so one
Euler step from t to t_next is x <- x + (t_next - t)/1000 * v. A perfect velocity recovers x0 exactly.

UniPC (Wan's default solver) is not provided: only Euler is exact to this package's conventions and
tested; more steps of Euler reach the same quality.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from video_dit.diffusion.conditioning import FirstFrameConditioning
from video_dit.diffusion.flow import NUM_TRAIN_TIMESTEPS


def module_dtype_device(module: nn.Module) -> tuple[torch.dtype, torch.device]:
    """dtype and device of `module`'s first floating parameter (works through wrappers such as a
    DeepSpeed engine, whose ZeRO-3 placeholders keep their dtype and device)."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype, p.device
    raise ValueError(f"{type(module).__name__} has no floating-point parameters")


@torch.no_grad()
def euler_sample(dit: nn.Module, noise: torch.Tensor, context: Sequence[torch.Tensor],
                 timesteps: torch.Tensor, *, negative_context: Sequence[torch.Tensor] | None = None,
                 guidance_scale: float = 1.0, conditioning: FirstFrameConditioning | None = None,
                 cond: dict[str, torch.Tensor] | None = None, progress: bool = False) -> torch.Tensor:
    """Integrate the flow ODE from `noise` at timesteps[0] to timesteps[-1]; returns float32 latents.

    dit: called exactly once per step as `dit(x, t, context)` (x in the DiT's dtype, t float32 (B,) or
    (B, L), context a list of (Lt_i, D) tensors), so a DeepSpeed engine can stand in for the model.
    noise (B, C, F', h, w); context: B per-prompt embeds; timesteps: (steps + 1,) on 0..1000, descending
    (`flow.sampling_schedule`). negative_context: B embeds; with guidance_scale != 1 the conditional and
    unconditional passes run batched in one forward (2B) and combine as v_u + s * (v_c - v_u);
    guidance_scale == 1 runs the conditional pass alone. conditioning + cond: first-frame conditioning,
    re-applied before every forward; the returned latent has the clean first frame restored.
    """
    B = noise.shape[0]
    context = list(context)
    if len(context) != B:
        raise ValueError(f"{len(context)} prompt embeds for a batch of {B} noise latents")
    guided = guidance_scale != 1.0
    if guided:
        if negative_context is None:
            raise ValueError(f"guidance_scale={guidance_scale} needs negative embeds "
                             "(encode '' or a negative prompt); use guidance_scale=1 for none")
        negative_context = list(negative_context)
        if len(negative_context) != B:
            raise ValueError(f"{len(negative_context)} negative embeds for a batch of {B}")
    if conditioning is not None and cond is None:
        raise ValueError("first-frame conditioning needs its cond tensors (encode_conditioning)")
    dtype, device = module_dtype_device(dit)
    ctx = [c.to(device=device, dtype=dtype) for c in context + (negative_context if guided else [])]
    x = noise.to(device=device, dtype=torch.float32)
    steps = range(len(timesteps) - 1)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc="sampling", unit="step")

    for i in steps:
        # 1. the current time for every sample, and the conditioned model input
        t = timesteps[i].to(device=device, dtype=torch.float32).expand(B)
        dt = float(timesteps[i + 1] - timesteps[i]) / NUM_TRAIN_TIMESTEPS
        model_in, t_in = x, t
        if conditioning is not None:
            model_in, t_in, _ = conditioning.apply(x, t, cond)
        # 2. one forward: conditional and unconditional halves batched together under guidance
        if guided:
            model_in, t_in = torch.cat([model_in, model_in]), torch.cat([t_in, t_in])
        v = dit(model_in.to(dtype), t_in, ctx).float()
        if guided:
            v_cond, v_uncond = v.chunk(2)
            v = v_uncond + guidance_scale * (v_cond - v_uncond)
        # 3. the Euler step
        x = x + dt * v

    if conditioning is not None:
        x = conditioning.restore(x, cond)
    return x
