"""Wan's sampling schedules (`Family.sampling_schedule`), computed as the references compute them (numpy
float64 grids, float32 sigmas) so sigmas and timesteps are bit-equal to them.

UniPC, grid "reference": Wan 2.1 / 2.2 `FlowUniPCMultistepScheduler(shift=1).set_timesteps(steps,
shift=shift)` (wan/utils/fm_solvers_unipc.py, used by generate.py for every task):
    s = shift(linspace(s_max, 0, steps + 1)[:-1]), s_max = float32(0.999), the first of its 1000
    training sigmas 1 - linspace(1, 1/1000, 1000)[::-1]
    timesteps = int(s * 1000) (999, 978, 952, ... for 10 steps at shift 5); sigmas = float32(s) + [0]
UniPC, grid "diffusers": diffusers' `UniPCMultistepScheduler` (`flow.diffusers_schedule`), the scheduler of
diffusers' Wan folders. Wan and diffusers disagree here: Wan's grid is diffusers' minus 1/1000 (0.999 - k h
vs 1 - k h, h = 0.999 / steps). We follow Wan by default; "diffusers" is for a diffusers folder whose
scheduler_config.json names that scheduler, so the folder samples as diffusers samples it.
Euler (either grid; Wan has no Euler solver): diffusers' `FlowMatchEulerDiscreteScheduler`.
"""

from __future__ import annotations

import numpy as np

from video_dit.diffusion.flow import (
    NUM_TRAIN_TIMESTEPS,
    SCHEDULE_GRIDS,
    SamplingSchedule,
    check_schedule,
    diffusers_schedule,
    shift_sigmas,
    unipc_schedule,
)


def wan_schedule(steps: int, shift: float, solver: str = "unipc", grid: str = "reference") -> SamplingSchedule:
    """The schedule Wan samples `steps` steps on at `shift` with `solver`, on its own grid or diffusers'."""
    check_schedule(steps, shift, solver)
    if grid not in SCHEDULE_GRIDS:
        raise ValueError(f"unknown schedule grid {grid!r}; accepted: {', '.join(SCHEDULE_GRIDS)}")
    if solver == "euler" or grid == "diffusers":
        return diffusers_schedule(steps, shift, solver)
    s_max = float(np.float32(1.0 - 1.0 / NUM_TRAIN_TIMESTEPS))
    return unipc_schedule(shift_sigmas(np.linspace(s_max, 0.0, steps + 1)[:-1], shift))
