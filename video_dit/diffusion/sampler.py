"""Flow-matching ODE solvers with classifier-free guidance and first-frame conditioning.

Conventions are those of `flow.py`: noise level s = t/1000, the DiT predicts velocity v = noise - x0,
so x0 is predicted as x - s * v. Steps follow a `flow.SamplingSchedule` (the reference's sigmas and
the timesteps the DiT is told, integer for UniPC as in Wan and diffusers).
- "euler": x <- x + (sigmas[i + 1] - sigmas[i]) * v, diffusers' `FlowMatchEulerDiscreteScheduler.step`.
  A perfect velocity recovers x0 exactly.
- "unipc": UniPC-2 (B2(h), x0-prediction, predictor + corrector), Wan's default solver; the update of
  Wan's `FlowUniPCMultistepScheduler` and diffusers' `UniPCMultistepScheduler(prediction_type=
  "flow_prediction", use_flow_sigmas=True)` with their defaults (solver_order 2, bh2,
  lower_order_final), which share it; ours runs its coefficients in float64, theirs in float32.
Both make one DiT call per step (conditional and unconditional halves batched under guidance); with a
two-expert model (`experts.TwoExperts`, Wan 2.2 A14B) the call goes to the expert of the step's timestep.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from video_dit.diffusion.conditioning import FirstFrameConditioning
from video_dit.diffusion.experts import HIGH, LOW, TwoExperts
from video_dit.diffusion.flow import SOLVERS, SamplingSchedule
from video_dit.models.common import module_dtype_device as first_float_dtype_device


def module_dtype_device(module: nn.Module) -> tuple[torch.dtype, torch.device]:
    """dtype and device of `module`'s first floating parameter (works through wrappers such as a
    DeepSpeed engine, whose ZeRO-3 placeholders keep their dtype and device); for `TwoExperts` the
    high-noise expert's dtype and the device the experts run on."""
    if isinstance(module, TwoExperts):
        dtype, device = module_dtype_device(module.high)
        return dtype, torch.device(module.compute_device) if module.compute_device is not None else device
    return first_float_dtype_device(module)


def _lam(s: float) -> float:
    """UniPC's log-SNR lambda = log(alpha / sigma) on the flow path (alpha = 1 - s, sigma = s)."""
    return math.inf if s == 0 else math.log(1.0 - s) - math.log(s)


class UniPC:
    """UniPC multistep solver (B2(h) variant, x0-prediction) on flow sigmas s = t/1000.

    One `step(i, x, v)` per timestep: v is the velocity predicted at (x, sigmas[i]); returns x at
    sigmas[i + 1]. The corrector refines the current x with the new prediction before the predictor
    extrapolates. Order warms up from 1 and drops to 1 on the final step (diffusers' lower_order_final).
    Every sigma but the last must be < 1 (log-SNR is -inf at pure noise): `flow.sampling_schedule`
    starts at 0.9998 (Wan) or 1 - 1e-6 (diffusers).
    """

    def __init__(self, sigmas: Sequence[float], order: int = 2):
        if order not in (1, 2, 3):
            raise ValueError(f"UniPC order must be 1, 2 or 3, got {order}")
        self.sigmas = [float(v) for v in sigmas]
        if any(not 0.0 < v < 1.0 for v in self.sigmas[:-1]) or not 0.0 <= self.sigmas[-1] < 1.0:
            raise ValueError(f"UniPC needs sigmas in (0, 1) and a last one in [0, 1), got {self.sigmas}")
        self.order, self.history, self.last_x, self.last_order = order, [], None, 1

    def _coefficients(self, i_t: int, i_0: int, points: list[int]):
        """h-dependent terms for a step from sigmas[i_0] to sigmas[i_t] using history `points`."""
        s_t, s_0 = self.sigmas[i_t], self.sigmas[i_0]
        h = _lam(s_t) - _lam(s_0)
        hh = -h  # x0-prediction
        h_phi_1 = math.expm1(hh)
        b_h = math.expm1(hh)  # bh2
        rks = [(_lam(self.sigmas[k]) - _lam(s_0)) / h for k in points] + [1.0]
        h_phi_k, factorial, b = h_phi_1 / hh - 1.0, 1, []
        for n in range(1, len(rks) + 1):
            b.append(h_phi_k * factorial / b_h)
            factorial *= n + 1
            h_phi_k = h_phi_k / hh - 1.0 / factorial
        R = torch.tensor([[r ** (n - 1) for r in rks] for n in range(1, len(rks) + 1)], dtype=torch.float64)
        return s_t / s_0, (1.0 - s_t) * h_phi_1, (1.0 - s_t) * b_h, rks[:-1], R, torch.tensor(b, dtype=torch.float64)

    def step(self, i: int, x: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m = x - self.sigmas[i] * v  # x0 prediction
        if i > 0:  # corrector: redo the last step from last_x with the new prediction m
            p = self.last_order
            points = [i - 1 - k for k in range(1, p)]
            ratio, c0, cb, rks, R, b = self._coefficients(i, i - 1, points)
            m0 = self.history[-1]
            d1s = [(self.history[-(k + 1)] - m0) / rk for k, rk in zip(range(1, p), rks)]
            rhos = [0.5] if p == 1 else torch.linalg.solve(R, b).tolist()
            corr = sum((rho * d for rho, d in zip(rhos[:-1], d1s)), torch.zeros_like(x))
            x = ratio * self.last_x - c0 * m0 - cb * (corr + rhos[-1] * (m - m0))
        self.history = (self.history + [m])[-self.order:]
        p = min(self.order, len(self.sigmas) - 1 - i, i + 1)  # warm-up and lower-order final step
        points = [i - k for k in range(1, p)]
        ratio, c0, cb, rks, R, b = self._coefficients(i + 1, i, points)
        m0 = self.history[-1]
        d1s = [(self.history[-(k + 1)] - m0) / rk for k, rk in zip(range(1, p), rks)]
        rhos = [] if p == 1 else [0.5] if p == 2 else torch.linalg.solve(R[:-1, :-1], b[:-1]).tolist()
        pred = sum((rho * d for rho, d in zip(rhos, d1s)), torch.zeros_like(x))
        self.last_x, self.last_order = x, p
        return ratio * x - c0 * m0 - cb * pred


@torch.no_grad()
def flow_sample(dit: nn.Module, noise: torch.Tensor, context: Sequence[torch.Tensor], schedule: SamplingSchedule,
                *, negative_context: Sequence[torch.Tensor] | None = None, guidance_scale: float = 1.0,
                guidance_scale_2: float | None = None, conditioning: FirstFrameConditioning | None = None,
                cond: dict[str, torch.Tensor] | None = None, progress: bool = False) -> torch.Tensor:
    """Integrate the flow ODE from `noise` along `schedule`; returns float32 latents at sigma 0.

    dit: called exactly once per step as `dit(x, t, context)` (x in the DiT's dtype, t float32 (B,) or
    (B, L), context a list of (Lt_i, D) tensors), so a DeepSpeed engine can stand in for the model.
    Or a `TwoExperts` (Wan 2.2 A14B): each step runs the expert of its timestep (t >= boundary x 1000:
    the high-noise one) at its own scale: `guidance_scale` for the high-noise expert, `guidance_scale_2`
    (None: the same) for the low-noise one, as diffusers' `WanPipeline(transformer_2=, boundary_ratio=)`.
    noise (B, C, F', h, w): the initial latents (float32 state); context: B per-prompt embeds;
    schedule: `flow.sampling_schedule(steps, shift, solver, grid)`. negative_context: B embeds; with
    a step's scale != 1 the conditional and unconditional passes run batched in one forward (2B) and
    combine as v_u + s * (v_c - v_u) (Wan's and diffusers' order); a scale of 1 runs the conditional
    pass alone (decided per step: diffusers decides once, by `guidance_scale`, which differs only when
    the high-noise scale is <= 1 and the low-noise one is not). conditioning + cond: first-frame
    conditioning, re-applied to the model input before every forward; the returned latent has the
    clean first frame restored. The DiT's extra inputs (`conditioning.dit_kwargs(cond)`: the CLIP
    features of a Wan 2.1 I2V / FLF2V DiT) are the same at every step and for both guidance halves
    (Wan gives the negative prompt the same image).
    """
    if schedule.solver not in SOLVERS:
        raise ValueError(f"unknown solver {schedule.solver!r}; accepted: {', '.join(SOLVERS)}")
    B = noise.shape[0]
    context = list(context)
    if len(context) != B:
        raise ValueError(f"{len(context)} prompt embeds for a batch of {B} noise latents")
    experts = dit if isinstance(dit, TwoExperts) else None
    if experts is None and guidance_scale_2 is not None:
        raise ValueError("guidance_scale_2 is the low-noise expert's scale: it needs a TwoExperts model")
    scales = {HIGH: guidance_scale, LOW: guidance_scale if guidance_scale_2 is None else guidance_scale_2}
    guided = any(s != 1.0 for s in (scales.values() if experts is not None else [guidance_scale]))
    if guided:
        if negative_context is None:
            raise ValueError(f"guidance scale {next(s for s in scales.values() if s != 1.0)} needs negative embeds "
                             "(encode '' or a negative prompt); use a guidance scale of 1 for none")
        negative_context = list(negative_context)
        if len(negative_context) != B:
            raise ValueError(f"{len(negative_context)} negative embeds for a batch of {B}")
    if conditioning is not None and cond is None:
        raise ValueError("first-frame conditioning needs its cond tensors (encode_conditioning)")
    dtype, device = module_dtype_device(dit)
    ctx = [c.to(device=device, dtype=dtype) for c in context + (negative_context if guided else [])]
    extra = {k: v.to(device=device, dtype=dtype) for k, v in conditioning.dit_kwargs(cond).items()} \
        if conditioning is not None else {}
    extra_pair = {k: torch.cat([v, v]) for k, v in extra.items()}
    x = noise.to(device=device, dtype=torch.float32)
    sigmas = schedule.sigmas.float()
    unipc = UniPC(sigmas.tolist()) if schedule.solver == "unipc" else None
    steps = range(schedule.steps)
    if progress:
        steps = tqdm(steps, desc="sampling", unit="step")

    for i in steps:
        # 1. this step's time for every sample, its model and its guidance: one DiT and one scale, or
        #    the expert whose side of the boundary holds t (by the step's scalar t, not the per-token t)
        t = schedule.timesteps[i].to(device=device, dtype=torch.float32).expand(B)  # (B,)
        model, scale = dit, guidance_scale
        if experts is not None:
            name, model = experts.select(float(schedule.timesteps[i]))
            scale = scales[name]
        # 2. the conditioned model input
        model_in, t_in = x, t
        if conditioning is not None:
            model_in, t_in, _ = conditioning.apply(x, t, cond)
        # 3. one forward: conditional and unconditional halves batched together under guidance
        pair = scale != 1.0
        step_ctx = ctx if pair else ctx[:B]
        if pair:
            model_in, t_in = torch.cat([model_in, model_in]), torch.cat([t_in, t_in])
        v = model(model_in.to(dtype), t_in, step_ctx, **(extra_pair if pair else extra)).float()
        if pair:
            v_cond, v_uncond = v.chunk(2)
            v = v_uncond + scale * (v_cond - v_uncond)
        # 4. the solver step (Euler's dt in float32, as diffusers computes it)
        x = x + float(sigmas[i + 1] - sigmas[i]) * v if unipc is None else unipc.step(i, x, v)

    if experts is not None:
        experts.park()
    if conditioning is not None:
        x = conditioning.restore(x, cond)
    return x
