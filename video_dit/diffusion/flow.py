"""Flow-matching conventions, written down once for the whole package.

- Time crosses every API on the 0..1000 scale, float, 1000 = pure noise, 0 = clean data.
- Interpolation (rectified flow): x_t = (1 - t/1000) * x0 + (t/1000) * noise.
- The network predicts the velocity dx_t/d(t/1000) = noise - x0 (the training target).
- Shift (SD3 / Wan): s' = shift * s / (1 + (shift - 1) * s) on s = t/1000; shift > 1 spends more time
  at high noise. Wan trains and samples with shift 3 (480p) to 5 (720p); presets carry the value.

Training step in four lines (the trainer's whole use of this module):
    t = sampler.sample(B, generator, device)                   # (B,) on [min_t, max_t] (conditioned)
    noise = torch.randn_like(x0)
    x_t, target = add_noise(x0, noise, t), velocity_target(x0, noise)
    loss = masked_mse(dit(x_t, t, context), target, mask) * sampler.loss_weight(t) (optional)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from video_dit.diffusion.aitk_weights import AITK_WEIGHTS

NUM_TRAIN_TIMESTEPS = 1000.0

TimestepKind = Literal["uniform", "logit_normal", "shift", "sigmoid", "weighted", "bell", "linear"]
TIMESTEP_KINDS: tuple[str, ...] = ("uniform", "logit_normal", "shift", "sigmoid", "weighted", "bell", "linear")


def _per_sample(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`t` (B,) on 0..1000 as s = t/1000 shaped (B, 1, ..., 1) to broadcast over `like` (any rank)."""
    if t.ndim != 1 or t.shape[0] != like.shape[0]:
        raise ValueError(f"timesteps must have shape (B,) = ({like.shape[0]},), got {tuple(t.shape)}")
    s = t.to(device=like.device, dtype=torch.float32) / NUM_TRAIN_TIMESTEPS
    return s.view(-1, *([1] * (like.ndim - 1)))


def add_noise(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - t/1000) * x0 + (t/1000) * noise.

    x0, noise: same shape (B, ...) of any rank (latents are (B, C, F', h, w)); t: (B,) float on
    0..1000. The blend is computed in float32 and returned in x0's dtype.
    """
    if noise.shape != x0.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} differs from x0 shape {tuple(x0.shape)}")
    s = _per_sample(t, x0)
    return ((1.0 - s) * x0.float() + s * noise.float()).to(x0.dtype)


def velocity_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The flow-matching training target, the velocity d x_t / d(t/1000) = noise - x0."""
    return noise - x0


def shift_timesteps(t: torch.Tensor, shift: float) -> torch.Tensor:
    """Apply the SD3/Wan time shift to `t` on 0..1000: s' = shift*s / (1 + (shift-1)*s), s = t/1000.

    shift = 1 is the identity; 0 and 1000 are fixed points; shift > 1 moves mass toward 1000.
    """
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    s = t / NUM_TRAIN_TIMESTEPS
    return NUM_TRAIN_TIMESTEPS * (shift * s / (1.0 + (shift - 1.0) * s))


SOLVERS: tuple[str, ...] = ("unipc", "euler")
# "reference": the family's own model code's grid (`Family.sampling_schedule`); "diffusers": diffusers'
# scheduler's (`diffusers_schedule`), for a diffusers folder whose scheduler config names it
SCHEDULE_GRIDS: tuple[str, ...] = ("reference", "diffusers")
# diffusers' FlowMatchEulerDiscreteScheduler with dynamic shifting (`use_dynamic_shifting`, as LTX-2's folders
# carry it): the shift follows the video token count, so only a family listing this grid in its
# `sampling_grids` (whose pipeline knows its tokens) samples it; the schedule's `shift` is the one at
# `max_image_seq_len` tokens, exp(max_shift)
DYNAMIC_GRID = "diffusers-dynamic"
# the grid names exports of earlier versions recorded (`video_dit_sources.json` "sampling"): each family's own
# grid had its name then; today's name for it is "reference"
LEGACY_GRIDS = {"wan": "reference", "hunyuan": "reference"}


@dataclass(frozen=True)
class SamplingSchedule:
    """What a solver integrates over: step i goes from noise level sigmas[i] to sigmas[i + 1] and tells
    the DiT `timesteps[i]`. Made by `sampling_schedule`."""

    solver: str               # "unipc" or "euler"
    sigmas: torch.Tensor      # (steps + 1,) float32, descending, last 0: s = t/1000 before each step
    timesteps: torch.Tensor   # (steps,) float32 on 0..1000: the DiT's t (integer-valued for UniPC)

    @property
    def steps(self) -> int:
        return len(self.timesteps)


def shift_sigmas(s, shift: float):
    """The shift map on noise levels s in 0..1 (numpy or torch, in their own dtype)."""
    return shift * s / (1.0 + (shift - 1.0) * s)


def diffusers_schedule(steps: int, shift: float, solver: str = "unipc") -> SamplingSchedule:
    """diffusers' sampling schedules for `solver`, computed as diffusers computes them (numpy float64
    grids, float32 sigmas) so sigmas and timesteps are bit-equal to its schedulers'. shift(s) is the SD3
    shift of `shift_timesteps`; int() truncates toward zero, as the reference's int64 cast does. A
    family's own grid (its model code's scheduler) is the family's: `Family.sampling_schedule`.

    UniPC: diffusers' `UniPCMultistepScheduler(use_flow_sigmas=True, flow_shift=shift,
    prediction_type="flow_prediction")`, the scheduler of diffusers' Wan folders:
        s = shift(linspace(1, 1/1000, steps + 1)[:-1]), then s[0] -= 1e-6 when within 1e-6 of 1
        timesteps = int(s * 1000) (999, 978, 952, 921, ...); sigmas = float32(s) + [0]
    Euler: diffusers' `FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(steps)`:
        s_min = shift(1/1000) in float32 (the last of its training sigmas, shifted at construction)
        s = shift(linspace(1, s_min, steps)): both ends kept, s_min shifted a second time, as there
        timesteps = float32(s) * 1000 (not rounded: 1000.0, 975.743, ...); sigmas = float32(s) + [0]
    """
    check_schedule(steps, shift, solver)
    n = int(NUM_TRAIN_TIMESTEPS)
    if solver == "euler":
        train_ends = torch.tensor([float(n), 1.0]) / n  # float32, as its training grid is
        s_max, s_min = (shift * train_ends / (1 + (shift - 1) * train_ends)).tolist()
        s = shift_sigmas(np.linspace(s_max * n, s_min * n, steps) / n, shift)
        sigmas = torch.from_numpy(s).float()
        return SamplingSchedule(solver, torch.cat([sigmas, sigmas.new_zeros(1)]), sigmas * n)
    s = shift_sigmas(np.linspace(1.0, 1 / n, steps + 1)[:-1], shift)
    if abs(s[0] - 1.0) < 1e-6:
        s[0] -= 1e-6
    return unipc_schedule(s)


def unipc_schedule(s: np.ndarray) -> SamplingSchedule:
    """A UniPC schedule over the float64 noise levels `s` (descending, < 1): timesteps int(s * 1000),
    sigmas float32(s) + [0] (UniPC cannot start at s = 1: its log-SNR is -inf there)."""
    n = int(NUM_TRAIN_TIMESTEPS)
    sigmas = torch.from_numpy(s).float()
    timesteps = torch.from_numpy((s * n).astype(np.int64)).float()
    return SamplingSchedule("unipc", torch.cat([sigmas, sigmas.new_zeros(1)]), timesteps)


def check_schedule(steps: int, shift: float, solver: str, solvers: tuple[str, ...] = SOLVERS) -> None:
    """ValueError naming the value when `steps`, `shift` or `solver` cannot make a schedule."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    if solver not in solvers:
        raise ValueError(f"unknown solver {solver!r}; accepted: {', '.join(solvers)}")


def _normal_cdf(x: float) -> float:
    """Phi(x), accurate in the lower tail (erfc), with Phi(-inf) = 0 and Phi(inf) = 1."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _logit(s: float) -> float:
    return -math.inf if s <= 0.0 else math.inf if s >= 1.0 else math.log(s / (1.0 - s))


def _unshift(s: float, shift: float) -> float:
    """Inverse of the shift map on 0..1: v with shift*v / (1 + (shift-1)*v) = s."""
    return s / (shift - (shift - 1.0) * s)


def aitk_weight(t: torch.Tensor) -> torch.Tensor:
    """ai-toolkit's `timestep_type: weighted` loss weight of timesteps `t` (any shape, 0..1000), float32.

    ai-toolkit trains on the grid linspace(1000, 1, 1000) and multiplies each sample's loss by its
    measured table at the timestep's index i (t = 1000 - i) as is; see `aitk_weights.py` for the source.
    A timestep off the grid takes its nearest grid point's weight (t < 1 takes t = 1's).
    """
    table = torch.tensor(AITK_WEIGHTS, dtype=torch.float32, device=t.device)
    index = (NUM_TRAIN_TIMESTEPS - t.double()).round().clamp(0, len(AITK_WEIGHTS) - 1).long()
    return table[index]


class TimestepSampler:
    """Training timesteps, float32 (B,) on [min_t, max_t] within 0..1000.

    Every kind is a distribution over the whole 0..1000; `min_t` / `max_t` CONDITION it on the range
    (restrict, not rescale): a draw is what the full distribution would give, kept only if it falls
    in [min_t, max_t]. That is how DiffSynth's timestep boundaries, ai-toolkit's multistage
    boundaries and diffusion-pipe restrict timesteps, and what a Wan 2.2 A14B expert trains on
    (shift 5 on [900, 1000]: median 958.3, where rescaling the whole distribution into the range
    gave 983.3). Each kind is a monotone map of a variable with a known CDF, so a draw is an exact
    inverse-CDF draw from the truncated distribution: one uniform number per sample from `generator`
    (float64), no rejection, the same values on every rank and after a resume.

    - "uniform" / "linear": t/1000 ~ U(0, 1). ("linear" is ai-toolkit's name for uniform over its grid.)
    - "logit_normal": t/1000 = sigmoid(mean + std * z), z ~ N(0, 1) (SD3's logit-normal).
    - "sigmoid": ai-toolkit's name for logit-normal: identical to "logit_normal" (mean, std apply).
    - "shift": t/1000 = shift(u), u ~ U(0, 1) (Wan's training schedule; ai-toolkit "shift").
    - "weighted": ai-toolkit's meaning: uniform timesteps, and `loss_weight(t)` is ai-toolkit's
      measured table (`aitk_weight`; ai-toolkit's own weights, not renormalised over the range).
    - "bell": ours (not an ai-toolkit `timestep_type`): uniform timesteps, and `loss_weight(t)` is the
      bell exp(-2 (s - 1/2)^2), s = t/1000, shifted to a minimum of 0 and normalised to mean 1 over
      U(0, 1): the continuous form of the weights ai-toolkit applies with `linear_timesteps: true`.
    `loss_weight(t)` is 1 for every other kind, so a trainer can always multiply by it.
    """

    def __init__(self, kind: TimestepKind = "uniform", shift: float = 3.0, min_t: float = 0.0,
                 max_t: float = 1000.0, mean: float = 0.0, std: float = 1.0):
        if kind not in TIMESTEP_KINDS:
            raise ValueError(f"unknown timestep kind {kind!r}; accepted: {', '.join(TIMESTEP_KINDS)}")
        if not 0.0 <= min_t < max_t <= NUM_TRAIN_TIMESTEPS:
            raise ValueError(f"need 0 <= min_t < max_t <= 1000, got min_t={min_t}, max_t={max_t}")
        if shift <= 0:
            raise ValueError(f"shift must be > 0, got {shift}")
        if std <= 0:
            raise ValueError(f"std must be > 0, got {std}")
        self.kind, self.shift, self.min_t, self.max_t = kind, float(shift), float(min_t), float(max_t)
        self.mean, self.std = float(mean), float(std)

    def __repr__(self) -> str:
        return (f"TimestepSampler(kind={self.kind!r}, shift={self.shift}, min_t={self.min_t}, "
                f"max_t={self.max_t}, mean={self.mean}, std={self.std})")

    def sample(self, batch_size: int, generator: torch.Generator | None = None,
               device: torch.device | str | None = None) -> torch.Tensor:
        """(batch_size,) float32 timesteps on [min_t, max_t], drawn with `generator` on its device
        (CPU when None), then moved to `device`."""
        gen_device = generator.device if generator is not None else "cpu"
        u = torch.rand(batch_size, generator=generator, device=gen_device, dtype=torch.float64)
        lo, hi = self.min_t / NUM_TRAIN_TIMESTEPS, self.max_t / NUM_TRAIN_TIMESTEPS
        if self.kind in ("logit_normal", "sigmoid"):
            # z ~ N(0, 1) truncated to [za, zb]: z = Phi^-1(U(Phi(za), Phi(zb))), computed in the lower
            # tail (flipping the sign when the range lies above 0) so narrow ranges far out stay exact
            za, zb = ((_logit(lo) - self.mean) / self.std, (_logit(hi) - self.mean) / self.std)
            flip = za > 0.0
            if flip:
                za, zb = -zb, -za
            pa, pb = _normal_cdf(za), _normal_cdf(zb)
            z = torch.special.ndtri(pa + (pb - pa) * u)
            s = torch.sigmoid(self.mean + self.std * (-z if flip else z))
        elif self.kind == "shift":
            va, vb = _unshift(lo, self.shift), _unshift(hi, self.shift)
            s = shift_timesteps((va + (vb - va) * u) * NUM_TRAIN_TIMESTEPS, self.shift) / NUM_TRAIN_TIMESTEPS
        else:
            s = lo + (hi - lo) * u
        t = (s * NUM_TRAIN_TIMESTEPS).float().clamp(self.min_t, self.max_t)
        return t.to(device=device if device is not None else gen_device)

    def loss_weight(self, t: torch.Tensor) -> torch.Tensor:
        """Per-sample loss weight (B,) for timesteps `t` (B,): ai-toolkit's table for "weighted", the
        bell for "bell", else 1."""
        if self.kind == "weighted":
            return aitk_weight(t)
        if self.kind != "bell":
            return torch.ones_like(t, dtype=torch.float32)
        s = t.float() / NUM_TRAIN_TIMESTEPS
        bell = torch.exp(-2.0 * (s - 0.5) ** 2)
        low = math.exp(-0.5)  # the bell's minimum on [0, 1], at s = 0 and s = 1
        # mean of (bell - low) over U(0, 1): integral of exp(-2 (s - 1/2)^2) ds minus `low`
        mean = math.sqrt(math.pi / 2.0) * math.erf(1.0 / math.sqrt(2.0)) - low
        return (bell - low) / mean
