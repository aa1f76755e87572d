"""Which experts of a two-expert model (Wan 2.2 A14B) a job trains, from where, and which one trains
which optimizer step. The timestep side of each expert is `diffusion.experts`.

Keys (ai-toolkit's, so one job file serves both trainers; the ai-toolkit arch reads the same ones):
    model.model_kwargs.train_high_noise / train_low_noise   default true / true for a two-expert preset
                                                            (ai-toolkit's wan22_14b defaults); refused on
                                                            a one-model preset
    train.switch_boundary_every                             ai-toolkit's: the expert alternates every N
                                                            optimizer steps (default 1), high-noise first
ours:
    model.boundary_ratio (or in model_kwargs)               default: the folder's model_index.json, else
                                                            the preset's (T2V 0.875, I2V 0.9)
    train.expert_choice                                     "alternate" (ai-toolkit's rule, above) or
                                                            "timestep": each step's expert is the one of a
                                                            timestep drawn from the job's (untruncated)
                                                            distribution by (seed, step), so the mix of
                                                            timesteps trained is that distribution's

Where the experts come from (`model.name_or_path`): a two-expert folder (diffusers' `transformer/` +
`transformer_2/`, or Wan's `high_noise_model/` + `low_noise_model/`), `preset:NAME` (the two seeded
random inits, `expert_seed`), or one expert's own weights (a single file or a one-DiT folder): then
exactly one of train_high_noise / train_low_noise must be true, and it names which expert those are.

The rule is a pure function of (the job, step), so every rank, a resumed run and a run on another
number of ranks agree on it without communicating (the trainer still checks the ranks agree).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from video_dit.diffusion.experts import HIGH, expert_at, expert_range
from video_dit.spec import EXPERT_KEYS, request_of_job, requested
from video_dit.spec import experts_of as model_experts
from video_dit.typed_config import ConfigError

PROCESS = "config.process[0]"
EXPERT_CHOICES = ("alternate", "timestep")


@dataclass(frozen=True)
class ExpertPlan:
    """A two-expert job: the boundary, the experts trained (in ai-toolkit's order, high first), and
    the (source, seed) of every expert the job can load (`sources`: both for a two-expert folder or
    preset, the trained one for one expert's weights; a loadable expert that is not trained is frozen
    and only renders previews)."""

    boundary: float
    trained: tuple[str, ...]
    sources: dict[str, tuple[str, int]]
    every: int
    choice: str


def check_ranges(train, trained: tuple[str, ...], boundary: float) -> None:
    """Each trained expert keeps some timesteps inside [train.min_t, train.max_t]."""
    for e in trained:
        if expert_range(e, boundary, train.min_t, train.max_t) is None:
            side = f"[{boundary * 1000:g}, 1000]" if e == HIGH else f"[0, {boundary * 1000:g}]"
            raise ConfigError(f"{PROCESS}.train.min_t",
                              f"[min_t, max_t] = [{train.min_t:g}, {train.max_t:g}] leaves no timestep for the "
                              f"{e.replace('_', '-')} expert, which trains on {side}; widen the range or set "
                              f"model.model_kwargs.{EXPERT_KEYS[e]}: false")


def plan_experts(process, preset) -> ExpertPlan | None:
    """The `ExpertPlan` of a parsed job (None for a one-model preset); reads the model folder (which
    experts it holds, its boundary: `spec.experts_of`). ConfigError naming the key or path otherwise."""
    t = process.train
    found = model_experts(request_of_job(process.model), preset)
    if found is None:
        return None
    check_ranges(t, found.trained, found.boundary)
    if t.expert_choice not in EXPERT_CHOICES:
        raise ConfigError(f"{PROCESS}.train.expert_choice", f"{t.expert_choice!r}; accepted: {', '.join(EXPERT_CHOICES)}")
    return ExpertPlan(found.boundary, found.trained, found.sources, t.switch_boundary_every, t.expert_choice)


class ExpertSchedule:
    """Which expert trains optimizer step s (0-based): with one trained expert, always that one; with
    both, "alternate" = ai-toolkit's rule (SDTrainer.hook_train_loop: `switch_boundary_every` steps of
    the high-noise expert, then as many of the low-noise one, ...; ai-toolkit counts micro-batches, we
    count optimizer steps: the same when gradient_accumulation is 1), or "timestep" = the expert of a
    timestep drawn from `sampler` (the job's distribution on [min_t, max_t], both sides) by a generator
    seeded from `seed_of(seed, "expert", s)`."""

    def __init__(self, plan: ExpertPlan, seed: int, sampler=None, seed_of=None):
        if plan.choice == "timestep" and len(plan.trained) > 1 and (sampler is None or seed_of is None):
            raise ValueError("expert_choice 'timestep' needs the job's timestep sampler and seed function")
        self.plan, self.seed, self.sampler, self.seed_of = plan, seed, sampler, seed_of
        self._cache: list[str] = []

    def expert_of(self, step: int) -> str:
        trained = self.plan.trained
        if len(trained) == 1:
            return trained[0]
        if self.plan.choice == "alternate":
            return trained[(step // self.plan.every) % len(trained)]
        gen = torch.Generator("cpu").manual_seed(self.seed_of(self.seed, "expert", step))
        return expert_at(float(self.sampler.sample(1, gen)[0]), self.plan.boundary)

    def steps_of(self, expert: str, total: int) -> list[int]:
        """The steps in [0, total) that train `expert`, in order."""
        while len(self._cache) < total:
            self._cache.append(self.expert_of(len(self._cache)))
        return [s for s in range(total) if self._cache[s] == expert]


__all__ = ["EXPERT_CHOICES", "ExpertPlan", "ExpertSchedule", "check_ranges", "plan_experts", "requested"]
