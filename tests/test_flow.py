"""Flow-matching conventions: interpolation identities, shift, schedules, timestep samplers, Euler."""

import math

import numpy as np
import pytest
import torch

from video_dit.diffusion.flow import (
    TIMESTEP_KINDS,
    TimestepSampler,
    add_noise,
    aitk_weight,
    shift_timesteps,
    velocity_target,
)
from video_dit.diffusion.sampler import flow_sample
from video_dit.families.wan.schedule import wan_schedule as sampling_schedule


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


def test_shift():
    t = torch.linspace(0, 1000, 11)
    torch.testing.assert_close(shift_timesteps(t, 1.0), t)
    s = shift_timesteps(t, 3.0)
    assert s[0] == 0 and s[-1] == 1000 and bool((s[1:-1] > t[1:-1]).all())  # more time at high noise
    assert math.isclose(float(shift_timesteps(torch.tensor(500.0), 3.0)), 750.0, rel_tol=1e-6)


def _shifted(s, shift):
    return [shift * v / (1 + (shift - 1) * v) for v in s]


@pytest.mark.parametrize("steps,shift", [(1, 1.0), (4, 3.0), (10, 5.0), (50, 5.0), (40, 12.0)])
def test_sampling_schedules_follow_the_reference_formulas(steps, shift):
    """Each schedule against its rule written out here in plain Python (not our code's numpy):
    Wan's UniPC grid linspace(0.999, 0, n + 1)[:-1], diffusers' UniPC grid linspace(1, 1/1000, n + 1)[:-1]
    (first sigma 1 - 1e-6 when it shifts to 1), both shifted and fed to the DiT as int(sigma * 1000);
    diffusers' flow-matching Euler: shift(linspace(1, shift(1/1000), n)), fed as float sigma * 1000."""
    def lin(a, b, n):
        return [a + (b - a) * k / (n - 1) for k in range(n)] if n > 1 else [a]

    wan = _shifted(lin(0.999, 0.0, steps + 1)[:-1], shift)
    dif = _shifted(lin(1.0, 0.001, steps + 1)[:-1], shift)
    dif[0] = dif[0] - 1e-6 if abs(dif[0] - 1) < 1e-6 else dif[0]
    s_min = _shifted([0.001], shift)[0]
    eul = _shifted(lin(1.0, s_min, steps), shift)
    for grid, solver, ref, integer in [("reference", "unipc", wan, True), ("diffusers", "unipc", dif, True),
                                       ("reference", "euler", eul, False), ("diffusers", "euler", eul, False)]:
        sched = sampling_schedule(steps, shift, solver, grid)
        assert sched.solver == solver and sched.steps == steps
        assert sched.sigmas.dtype == torch.float32 and sched.timesteps.dtype == torch.float32
        torch.testing.assert_close(sched.sigmas, torch.tensor(ref + [0.0]), rtol=0, atol=2e-7)
        expected_t = [float(math.floor(v * 1000)) for v in ref] if integer else [v * 1000 for v in ref]
        if integer:  # exact, but for a value within rounding of an integer (none in these cases)
            assert sched.timesteps.tolist() == expected_t
        else:
            torch.testing.assert_close(sched.timesteps, torch.tensor(expected_t), rtol=0, atol=1e-4)
    if steps == 10 and shift == 5.0:  # the numbers the issue quotes
        assert sampling_schedule(10, 5.0, "unipc", "reference").timesteps[:3].tolist() == [999, 978, 952]
        assert sampling_schedule(10, 5.0, "unipc", "diffusers").timesteps[:4].tolist() == [999, 978, 952, 921]


def test_sampling_schedules_equal_diffusers_schedulers():
    """Bit-equal sigmas and timesteps to diffusers' own schedulers (the UniPC of its Wan folders and
    the flow-matching Euler), over step counts and shifts."""
    diffusers = pytest.importorskip("diffusers")
    for steps in (1, 2, 7, 30, 50):
        for shift in (1.0, 3.0, 5.0, 7.3):
            unipc = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                      flow_shift=shift)
            unipc.set_timesteps(steps)
            ours = sampling_schedule(steps, shift, "unipc", "diffusers")
            assert torch.equal(ours.sigmas, unipc.sigmas) and torch.equal(ours.timesteps, unipc.timesteps.float())
            euler = diffusers.FlowMatchEulerDiscreteScheduler(shift=shift)
            euler.set_timesteps(steps)
            ours = sampling_schedule(steps, shift, "euler")
            assert torch.equal(ours.sigmas, euler.sigmas) and torch.equal(ours.timesteps, euler.timesteps)


def test_sampling_schedule_validation():
    for args, message in [((0, 5.0), "steps"), ((4, 0.0), "shift"), ((4, 5.0, "dpm"), "accepted: unipc, euler"),
                          ((4, 5.0, "unipc", "comfy"), "accepted: reference, diffusers")]:
        with pytest.raises(ValueError, match=message):
            sampling_schedule(*args)


def _ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the two empirical CDFs."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, grid, side="right") / len(a)
    cdf_b = np.searchsorted(b, grid, side="right") / len(b)
    return float(np.abs(cdf_a - cdf_b).max())


def _ks_critical(n: int, m: int, alpha: float = 1e-3) -> float:
    """Asymptotic critical value c(alpha) sqrt((n + m) / (n m)), c = sqrt(-ln(alpha / 2) / 2)."""
    return math.sqrt(-math.log(alpha / 2) / 2) * math.sqrt((n + m) / (n * m))


def _full_distribution(kind: str, n: int, rng: np.random.Generator, shift=3.0, mean=0.0, std=1.0) -> np.ndarray:
    """Draws of t on 0..1000 from the untruncated formula of each kind (independent of flow.py)."""
    if kind in ("logit_normal", "sigmoid"):
        return 1000.0 / (1.0 + np.exp(-(mean + std * rng.standard_normal(n))))
    u = rng.random(n)
    if kind == "shift":
        return 1000.0 * shift * u / (1.0 + (shift - 1.0) * u)
    return 1000.0 * u


def _rejection_reference(kind, lo, hi, n, seed, **kw) -> np.ndarray:
    """`n` draws of the full distribution that fall in [lo, hi] (the definition of "conditioned")."""
    rng, kept = np.random.default_rng(seed), []
    while sum(len(k) for k in kept) < n:
        t = _full_distribution(kind, 1_000_000, rng, **kw)
        kept.append(t[(t >= lo) & (t <= hi)])
    return np.concatenate(kept)[:n]


CONDITIONED_CASES = [  # kind, min_t, max_t, sampler kwargs
    ("shift", 900.0, 1000.0, {"shift": 5.0}),   # Wan 2.2 A14B high-noise expert
    ("shift", 0.0, 900.0, {"shift": 5.0}),      # ... and its low-noise expert
    ("shift", 250.0, 750.0, {"shift": 3.0}),
    ("uniform", 100.0, 900.0, {}),
    ("linear", 0.0, 1000.0, {}),
    ("logit_normal", 0.0, 1000.0, {}),
    ("logit_normal", 875.0, 1000.0, {}),         # the upper tail (sampled in the flipped variable)
    ("sigmoid", 0.0, 50.0, {}),                  # the lower tail: 0.16% of the full mass
    ("logit_normal", 400.0, 600.0, {"mean": 0.5, "std": 1.5}),
]


@pytest.mark.parametrize("kind,lo,hi,kw", CONDITIONED_CASES)
def test_timesteps_are_the_distribution_conditioned_on_the_range(kind, lo, hi, kw):
    n = 20000
    sampler = TimestepSampler(kind, min_t=lo, max_t=hi, **kw)
    t = sampler.sample(n, generator=torch.Generator().manual_seed(1))
    assert t.shape == (n,) and t.dtype == torch.float32
    assert float(t.min()) >= lo and float(t.max()) <= hi
    assert torch.equal(t, sampler.sample(n, generator=torch.Generator().manual_seed(1)))  # resume, ranks
    ref = _rejection_reference(kind, lo, hi, n, seed=7, **kw)
    assert _ks_statistic(t.double().numpy(), ref) < _ks_critical(n, n)
    if (lo, hi) != (0.0, 1000.0) and kind not in ("uniform", "linear"):
        # the test has the power to see the old behaviour: the whole distribution rescaled into the range
        rescaled = lo + (hi - lo) * _full_distribution(kind, n, np.random.default_rng(3), **kw) / 1000.0
        assert _ks_statistic(rescaled, ref) > 3 * _ks_critical(n, n)


def test_wan22_high_noise_expert_median():
    """shift 5 on [900, 1000]: the shifted distribution's own median within the range, derived here:
    v = unshift(0.9) = 0.9 / (5 - 4 * 0.9) = 9/14, median v = (9/14 + 1) / 2 = 23/28, t = 1000 * shift(23/28)."""
    v = (9 / 14 + 1) / 2
    expected = 1000 * 5 * v / (1 + 4 * v)  # 958.33
    assert 958.0 < expected < 958.5
    t = TimestepSampler("shift", shift=5.0, min_t=900.0, max_t=1000.0).sample(
        40000, generator=torch.Generator().manual_seed(0))
    assert abs(float(t.median()) - expected) < 0.5


@pytest.mark.parametrize("kind", TIMESTEP_KINDS)
def test_loss_weights(kind):
    sampler = TimestepSampler(kind, shift=3.0, min_t=100.0, max_t=900.0)
    t = sampler.sample(1000, generator=torch.Generator().manual_seed(1))
    w = sampler.loss_weight(t)
    assert w.shape == t.shape and w.dtype == torch.float32
    if kind == "weighted":
        torch.testing.assert_close(w, aitk_weight(t))
    elif kind == "bell":
        full = TimestepSampler("bell").loss_weight(torch.linspace(0, 1000, 100001))
        assert abs(float(full.mean()) - 1.0) < 1e-3 and float(full.min()) >= 0  # mean 1 over U(0, 1)
        assert float(full[50000]) == pytest.approx(float(full.max()))  # bell peaks mid-schedule
    else:
        assert torch.equal(w, torch.ones_like(t))


def test_weighted_is_ai_toolkits_measured_table():
    """Values read from ai-toolkit's default_weighing_scheme.py (27a03a91), looked up as its
    CustomFlowMatchEulerDiscreteScheduler does: index i of t on linspace(1000, 1, 1000), t = 1000 - i."""
    from video_dit.diffusion.aitk_weights import AITK_WEIGHTS

    assert len(AITK_WEIGHTS) == 1000 and abs(sum(AITK_WEIGHTS) / 1000 - 1.0) < 1e-6
    known = {0: 0.905706524848938, 8: 1.01659095287323, 124: 1.5226575136184692, 999: 0.4472601115703583}
    assert {i: AITK_WEIGHTS[i] for i in known} == known and max(AITK_WEIGHTS) == known[124]
    grid = torch.linspace(1000, 1, 1000)
    idx = torch.tensor([0, 8, 124, 999])
    assert aitk_weight(grid[idx]).tolist() == [float(torch.tensor(known[int(i)])) for i in idx]
    # off the grid: the nearest grid point; below t = 1 the last entry
    assert aitk_weight(torch.tensor([875.6, 0.0, 1000.0])).tolist() == [
        float(torch.tensor(AITK_WEIGHTS[124])), float(torch.tensor(known[999])), float(torch.tensor(known[0]))]
    assert TimestepSampler("weighted", min_t=100.0, max_t=900.0).loss_weight(grid[idx]).tolist() == \
        aitk_weight(grid[idx]).tolist()  # not renormalised over the range, as in ai-toolkit


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
    out = flow_sample(PerfectVelocity(x0, noise), noise, [torch.zeros(1, 8)] * 2,
                      sampling_schedule(steps, shift, "euler"))
    torch.testing.assert_close(out, x0, atol=1e-5, rtol=1e-5)


class Nonlinear(torch.nn.Module):
    """A velocity field nonlinear in x that also depends on t, so the timesteps fed matter."""

    def __init__(self):
        super().__init__()
        self.A = torch.nn.Parameter(torch.randn(6, 6, generator=torch.Generator().manual_seed(0)) * 0.5)

    def forward(self, x, t, context):
        tt = torch.as_tensor(t, dtype=torch.float32).reshape(-1)[:1] / 1000  # diffusers hands int64 t
        return torch.tanh(torch.einsum("bcfhw,cd->bdfhw", x, self.A)) * (1 + tt) + 0.3 * x


def _diffusers_run(scheduler):
    """(model, noise, the sample diffusers' `scheduler` reaches from noise with model's velocities)."""
    model = Nonlinear()
    noise = torch.randn(2, 6, 2, 4, 4, generator=torch.Generator().manual_seed(1))
    ref = noise.clone()
    with torch.no_grad():
        for t in scheduler.timesteps:
            ref = scheduler.step(model(ref, t, None), t, ref).prev_sample
    return model, noise, ref


@pytest.mark.parametrize("steps,shift,order", [(1, 3.0, 2), (3, 5.0, 2), (12, 3.0, 2), (7, 3.0, 3)])
def test_unipc_matches_diffusers(steps, shift, order):
    """Our UniPC steps against diffusers' scheduler on its own schedule, through `flow_sample` as the
    pipeline runs it (order 2), or the solver alone (order 3)."""
    from video_dit.diffusion.flow import SamplingSchedule
    from video_dit.diffusion.sampler import UniPC

    diffusers = pytest.importorskip("diffusers")
    scheduler = diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                  flow_shift=shift, solver_order=order)
    scheduler.set_timesteps(steps)
    model, noise, ref = _diffusers_run(scheduler)
    with torch.no_grad():
        if order == 2:
            schedule = sampling_schedule(steps, shift, "unipc", "diffusers")
            out = flow_sample(model, noise, [torch.zeros(1, 8)] * 2, schedule)
        else:
            schedule = SamplingSchedule("unipc", scheduler.sigmas, scheduler.timesteps.float())
            solver, out = UniPC(schedule.sigmas.tolist(), order=order), noise
            for i in range(steps):
                out = solver.step(i, out, model(out, schedule.timesteps[i], None))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_euler_matches_diffusers():
    diffusers = pytest.importorskip("diffusers")
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=5.0)
    scheduler.set_timesteps(6)
    model, noise, ref = _diffusers_run(scheduler)
    with torch.no_grad():
        out = flow_sample(model, noise, [torch.zeros(1, 8)] * 2, sampling_schedule(6, 5.0, "euler"))
    assert torch.equal(out, ref)  # the same float32 operations in the same order


@pytest.mark.parametrize("grid", ["reference", "diffusers"])
def test_unipc_with_perfect_velocity_recovers_x0(grid):
    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 4, 3, 4, 4, generator=g), torch.randn(2, 4, 3, 4, 4, generator=g)
    schedule = sampling_schedule(6, 5.0, "unipc", grid)
    s0 = float(schedule.sigmas[0])  # 0.9998 (Wan) or 1 - 1e-6 (diffusers): start on the path there
    out = flow_sample(PerfectVelocity(x0, noise), (1 - s0) * x0 + s0 * noise, [torch.zeros(1, 8)] * 2, schedule)
    torch.testing.assert_close(out, x0, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"sigmas in \(0, 1\)"):
        from video_dit.diffusion.sampler import UniPC

        UniPC([1.0, 0.5, 0.0])
