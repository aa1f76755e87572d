"""Flow-matching conventions: interpolation identities, shift, schedules, timestep samplers, Euler."""

import math

import pytest
import torch

from video_dit.diffusion.flow import (TIMESTEP_KINDS, TimestepSampler, add_noise, sampling_schedule,
                                      shift_timesteps, velocity_target)
from video_dit.diffusion.sampler import flow_sample


def test_interpolation_endpoints_and_velocity():
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 4, 2, 6, 8, generator=g), torch.randn(3, 4, 2, 6, 8, generator=g)
    assert torch.equal(add_noise(x0, noise, torch.zeros(3)), x0)
    assert torch.equal(add_noise(x0, noise, torch.full((3,), 1000.0)), noise)
    t = torch.tensor([0.0, 250.0, 1000.0])
    xt = add_noise(x0, noise, t)
    torch.testing.assert_close(xt[1], 0.75 * x0[1] + 0.25 * noise[1])
    # the velocity is the time derivative of x_t on the 0..1 scale (finite difference, any rank)
    x2, n2 = x0.flatten(1), noise.flatten(1)
    dt = 1.0
    fd = (add_noise(x2, n2, t.clamp(max=999) + dt) - add_noise(x2, n2, t.clamp(max=999))) / (dt / 1000)
    torch.testing.assert_close(fd, velocity_target(x2, n2), atol=2e-2, rtol=1e-2)
    with pytest.raises(ValueError, match=r"\(B,\)"):
        add_noise(x0, noise, torch.zeros(2))


def test_shift_and_schedule():
    t = torch.linspace(0, 1000, 11)
    torch.testing.assert_close(shift_timesteps(t, 1.0), t)
    s = shift_timesteps(t, 3.0)
    assert s[0] == 0 and s[-1] == 1000 and bool((s[1:-1] > t[1:-1]).all())  # more time at high noise
    assert math.isclose(float(shift_timesteps(torch.tensor(500.0), 3.0)), 750.0, rel_tol=1e-6)
    sched = sampling_schedule(10, 5.0)
    assert sched.shape == (11,) and sched[0] == 1000 and sched[-1] == 0
    assert bool((sched[1:] < sched[:-1]).all())


@pytest.mark.parametrize("kind", TIMESTEP_KINDS)
def test_timestep_samplers(kind):
    sampler = TimestepSampler(kind, shift=3.0, min_t=100.0, max_t=900.0)
    t = sampler.sample(4000, generator=torch.Generator().manual_seed(1))
    assert t.shape == (4000,) and t.dtype == torch.float32
    assert float(t.min()) >= 100.0 and float(t.max()) <= 900.0
    again = sampler.sample(4000, generator=torch.Generator().manual_seed(1))
    assert torch.equal(t, again)
    u = (t - 100.0) / 800.0
    if kind in ("uniform", "linear", "weighted"):
        assert abs(float(u.mean()) - 0.5) < 0.02 and abs(float(u.std()) - math.sqrt(1 / 12)) < 0.02
    elif kind == "shift":  # E[shift(u)] for shift 3 = integral of 3u / (1 + 2u) du = 1.5 - 0.75 ln 3
        assert abs(float(u.mean()) - (1.5 - 0.75 * math.log(3))) < 0.02
    else:  # logit-normal: logit(u) ~ N(0, 1)
        z = torch.logit(u)
        assert abs(float(z.mean())) < 0.06 and abs(float(z.std()) - 1.0) < 0.05
    w = sampler.loss_weight(t)
    if kind == "weighted":
        full = TimestepSampler("weighted").loss_weight(torch.linspace(0, 1000, 100001))
        assert abs(float(full.mean()) - 1.0) < 1e-3 and float(full.min()) >= 0  # mean 1 over U(0, 1)
        assert float(full[50000]) == pytest.approx(float(full.max()))  # bell peaks mid-schedule
    else:
        assert torch.equal(w, torch.ones_like(t))


def test_sampler_validation():
    with pytest.raises(ValueError, match="accepted: uniform"):
        TimestepSampler("lognorm")
    with pytest.raises(ValueError, match="min_t"):
        TimestepSampler("uniform", min_t=500.0, max_t=400.0)


class PerfectVelocity(torch.nn.Module):
    """Returns the exact velocity noise - x0 whatever the input: the ideal flow model."""

    def __init__(self, x0, noise):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.v = noise - x0

    def forward(self, x, t, context):
        return self.v * self.scale


@pytest.mark.parametrize("steps,shift", [(1, 1.0), (7, 5.0)])
def test_euler_with_perfect_velocity_recovers_x0(steps, shift):
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 4, 3, 4, 4, generator=g), torch.randn(2, 4, 3, 4, 4, generator=g)
    out = flow_sample(PerfectVelocity(x0, noise), noise, [torch.zeros(1, 8)] * 2, sampling_schedule(steps, shift))
    torch.testing.assert_close(out, x0, atol=1e-5, rtol=1e-5)


class Nonlinear(torch.nn.Module):
    """A velocity field that depends nonlinearly on x (not on t: diffusers hands its model int64 t)."""

    def __init__(self):
        super().__init__()
        self.A = torch.nn.Parameter(torch.randn(6, 6, generator=torch.Generator().manual_seed(0)) * 0.5)

    def forward(self, x, t, context):
        return torch.tanh(torch.einsum("bcfhw,cd->bdfhw", x, self.A)) + 0.3 * x


@pytest.mark.parametrize("steps,shift,order", [(1, 3.0, 2), (3, 5.0, 2), (12, 3.0, 2), (7, 3.0, 3)])
def test_unipc_matches_diffusers(steps, shift, order):
    from video_dit.diffusion.sampler import UniPC

    diffusers = pytest.importorskip("diffusers")
    scheduler = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                  flow_shift=shift, solver_order=order)
    scheduler.set_timesteps(steps)
    model = Nonlinear()
    noise = torch.randn(2, 6, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    ref = noise.clone()
    with torch.no_grad():
        for t in scheduler.timesteps:
            ref = scheduler.step(model(ref, t, None), t, ref).prev_sample
        if order == 2:  # through the sampler, as the pipeline runs it
            out = flow_sample(model, noise, [torch.zeros(1, 8)] * 2, scheduler.sigmas * 1000, solver="unipc")
        else:
            solver, out = UniPC(scheduler.sigmas.tolist(), order=order), noise
            for i in range(steps):
                out = solver.step(i, out, model(out, None, None))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_unipc_with_perfect_velocity_recovers_x0():
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 4, 3, 4, 4, generator=g), torch.randn(2, 4, 3, 4, 4, generator=g)
    out = flow_sample(PerfectVelocity(x0, noise), noise, [torch.zeros(1, 8)] * 2, sampling_schedule(6, 5.0),
                       solver="unipc")
    # the schedule starts at exactly 1000; UniPC treats it as 1 - 1e-6, so x0 is off by ~1e-6 * |noise|
    torch.testing.assert_close(out, x0, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="accepted: euler, unipc"):
        flow_sample(PerfectVelocity(x0, noise), noise, [torch.zeros(1, 8)] * 2, sampling_schedule(2, 1.0),
                     solver="dpm")
