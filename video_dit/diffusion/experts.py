"""Wan 2.2 A14B's two experts, written down once: which expert denoises which timesteps.

A two-expert model (a preset with `boundary_ratio`) is two DiTs of one shape. With b = boundary_ratio:

    t >= b * 1000   the high-noise expert   Wan's `high_noise_model`, diffusers' `transformer`
    t <  b * 1000   the low-noise expert    Wan's `low_noise_model`,  diffusers' `transformer_2`

(Wan 2.2 text2video.py / image2video.py `_prepare_model_for_timestep`: `t.item() >= boundary`, and
`guide_scale[1] if t.item() >= boundary else guide_scale[0]`; diffusers' `WanPipeline`: `t >=
boundary_timestep` runs `transformer` at `guidance_scale`, else `transformer_2` at `guidance_scale_2`.)
The release's boundaries: 0.875 for T2V-A14B, 0.900 for I2V-A14B (wan/configs/wan_t2v_A14B.py,
wan_i2v_A14B.py). Sampling picks the expert by each step's (scalar) timestep; training restricts
each expert's timesteps to its own side (`expert_range`). Names are ai-toolkit's LoRA file suffixes.

`TwoExperts` holds the pair for sampling: `flow_sample` asks it for the expert (and guidance scale)
of every step; `offload` names the experts that wait on the CPU while the other one runs.
"""

from __future__ import annotations

import torch
from torch import nn

HIGH, LOW = "high_noise", "low_noise"
EXPERTS: tuple[str, str] = (HIGH, LOW)  # ai-toolkit's order (boundary index 0 = high noise, 1 = low noise)
NUM_TRAIN_TIMESTEPS = 1000.0


def check_boundary(boundary: float, where: str = "boundary_ratio") -> float:
    """`boundary` as a float in (0, 1); ValueError naming `where` otherwise."""
    if isinstance(boundary, bool) or not isinstance(boundary, (int, float)) or not 0.0 < float(boundary) < 1.0:
        raise ValueError(f"{where}: {boundary!r}; accepted: a number strictly between 0 and 1 (the high-noise "
                         "expert denoises t >= boundary_ratio x 1000; Wan 2.2: 0.875 for T2V-A14B, 0.9 for I2V-A14B)")
    return float(boundary)


def expert_at(t: float, boundary: float) -> str:
    """The expert that denoises timestep `t` (0..1000): HIGH when t >= boundary x 1000, else LOW."""
    return HIGH if float(t) >= boundary * NUM_TRAIN_TIMESTEPS else LOW


def expert_range(expert: str, boundary: float, min_t: float = 0.0, max_t: float = NUM_TRAIN_TIMESTEPS
                 ) -> tuple[float, float] | None:
    """[lo, hi] of the training timesteps of `expert`: its side of the boundary within [min_t, max_t]
    (high: [b x 1000, 1000], low: [0, b x 1000]); None when the two do not overlap."""
    if expert not in EXPERTS:
        raise ValueError(f"unknown expert {expert!r}; accepted: {', '.join(EXPERTS)}")
    cut = boundary * NUM_TRAIN_TIMESTEPS
    lo, hi = (max(cut, min_t), max_t) if expert == HIGH else (min_t, min(cut, max_t))
    return (lo, hi) if lo < hi else None


class TwoExperts(nn.Module):
    """The two experts of one model, for sampling: `high` denoises t >= boundary x 1000, `low` the rest.

    Not called itself: `flow_sample` calls `select(t)` once per step and runs the expert it returns,
    at `guidance[expert]` (`guidance_scale` for the high-noise expert, `guidance_scale_2` for the
    low-noise one, diffusers' names). `offload` (the named option): experts that wait on the CPU while
    the other runs, moved to `device` when their first step comes (Wan's `offload_model`, diffusers'
    model offload); an expert that is not offloaded stays where it is (e.g. a DeepSpeed engine's module).
    Both experts must have one config (`.config`); `.parameters()` holds both.
    """

    def __init__(self, high: nn.Module, low: nn.Module, boundary: float, *, offload: tuple[str, ...] = (),
                 device=None):
        super().__init__()
        self.high, self.low = high, low
        self.boundary = check_boundary(boundary)
        configs = [getattr(m, "config", None) for m in (high, low)]
        if configs[0] != configs[1]:
            raise ValueError(f"the two experts differ in shape: high-noise {configs[0]}, low-noise {configs[1]}")
        unknown = set(offload) - set(EXPERTS)
        if unknown:
            raise ValueError(f"offload: unknown experts {sorted(unknown)}; accepted: {', '.join(EXPERTS)}")
        if offload and device is None:
            raise ValueError("offload needs the device the active expert runs on")
        self.offload, self.compute_device = tuple(offload), device

    @property
    def config(self):
        return self.high.config

    @property
    def device(self):
        """Where the experts run: the offload device, else the high-noise expert's (as a DiT's `.device`)."""
        return torch.device(self.compute_device) if self.compute_device is not None else self.high.device

    @property
    def dtype(self):
        return self.high.dtype

    def expert(self, name: str) -> nn.Module:
        return self.high if name == HIGH else self.low

    def to(self, *args, **kwargs):
        """Each expert's own `to`: a DiT's casts to a dtype as `cast_dit` does (its float32 islands stay
        float32; ai-toolkit's trainer calls `unet.to(device, dtype)` on the model it is given)."""
        for module in (self.high, self.low):
            module.to(*args, **kwargs)
        return self

    def select(self, t: float) -> tuple[str, nn.Module]:
        """(name, module) of the expert for timestep `t`, on the compute device (an offloaded expert is
        moved there now, and the other offloaded one back to the CPU)."""
        name = expert_at(t, self.boundary)
        if self.offload:
            other = LOW if name == HIGH else HIGH
            if other in self.offload:
                self.expert(other).to("cpu")
            if name in self.offload:
                self.expert(name).to(self.compute_device)
        return name, self.expert(name)

    def park(self) -> None:
        """Every offloaded expert back to the CPU (after sampling)."""
        for name in self.offload:
            self.expert(name).to("cpu")

    def forward(self, *args, **kwargs):
        raise TypeError("TwoExperts is not called: flow_sample picks one expert per step with select(t)")
