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

from video_dit.diffusion.experts import EXPERTS, HIGH, LOW, check_boundary, expert_at, expert_range
from video_dit.typed_config import ConfigError

PROCESS = "config.process[0]"
EXPERT_CHOICES = ("alternate", "timestep")
KEY_OF = {HIGH: "train_high_noise", LOW: "train_low_noise"}


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


MODEL = f"{PROCESS}.model"


def requested(model, preset, where: str = MODEL) -> tuple[str, ...]:
    """The experts `model` (a parsed `ModelConfig`, or the ai-toolkit arch's `ModelKwargs`) asks to
    train, checked (ConfigError naming the key under `where`, the model block's key path)."""
    kw = where if where.endswith("model_kwargs") else f"{where}.model_kwargs"
    asked = {e: getattr(model, KEY_OF[e]) for e in EXPERTS}
    if not preset.two_experts:
        for e, value in asked.items():
            if value is not None:
                raise ConfigError(f"{kw}.{KEY_OF[e]}",
                                  f"preset {preset.name!r} is one model, not two experts; this key is for the "
                                  "Wan 2.2 A14B presets (wan2.2-t2v-a14b, wan2.2-i2v-a14b)")
        return ()
    trained = tuple(e for e in EXPERTS if asked[e] is not False)  # None (unset) = true, as in ai-toolkit
    if not trained:
        raise ConfigError(f"{kw}.train_low_noise",
                          "train_high_noise and train_low_noise are both false: no expert to train; accepted: "
                          "at least one of them true (both: the experts alternate)")
    return trained


def boundary_of(model, preset, folder_boundary: float | None = None, where: str = MODEL) -> float:
    """`model.boundary_ratio`, else the folder's model_index.json value, else the preset's; checked."""
    if model.boundary_ratio is not None:
        if not preset.two_experts:
            raise ConfigError(f"{where}.boundary_ratio", f"preset {preset.name!r} is one model, not two "
                                                         "experts; boundary_ratio is for the A14B presets")
        try:
            return check_boundary(model.boundary_ratio, "boundary_ratio")
        except ValueError as exc:
            raise ConfigError(f"{where}.boundary_ratio", str(exc)) from exc
    if folder_boundary is not None:
        return check_boundary(folder_boundary, "model_index.json boundary_ratio")
    return preset.boundary_ratio


def check_ranges(train, trained: tuple[str, ...], boundary: float) -> None:
    """Each trained expert keeps some timesteps inside [train.min_t, train.max_t]."""
    for e in trained:
        if expert_range(e, boundary, train.min_t, train.max_t) is None:
            side = f"[{boundary * 1000:g}, 1000]" if e == HIGH else f"[0, {boundary * 1000:g}]"
            raise ConfigError(f"{PROCESS}.train.min_t",
                              f"[min_t, max_t] = [{train.min_t:g}, {train.max_t:g}] leaves no timestep for the "
                              f"{e.replace('_', '-')} expert, which trains on {side}; widen the range or set "
                              f"model.model_kwargs.{KEY_OF[e]}: false")


def model_experts(name_or_path: str, model, preset, seed: int = 0, where: str = MODEL,
                  path_key: str | None = None) -> tuple[tuple[str, ...], float, dict[str, tuple[str, int]]]:
    """(trained experts, boundary, {expert: (source, seed)} of every loadable expert) of a two-expert
    preset's model `name_or_path` (reads the folder: which experts it holds, its boundary);
    ConfigError naming the key (`path_key`: the key of name_or_path) for what cannot work."""
    from video_dit.models.loading import WeightsError, expert_seed, expert_sources, folder_boundary

    path_key = path_key or f"{where}.name_or_path"
    trained = requested(model, preset, where)
    try:
        found = expert_sources(name_or_path)
        boundary = boundary_of(model, preset, folder_boundary(name_or_path) if found else None, where)
    except WeightsError as exc:
        raise ConfigError(path_key, str(exc)) from exc
    if name_or_path.startswith("preset:"):
        sources = {e: (name_or_path, expert_seed(seed, e)) for e in EXPERTS}
    elif found is not None:
        sources = {e: (found[e], seed) for e in EXPERTS}
    else:  # one expert's weights: they are the one expert asked for
        if len(trained) != 1:
            raise ConfigError(path_key,
                              f"{name_or_path!r} holds one DiT, but both experts are asked for (train_high_noise and "
                              "train_low_noise are true, the default for an A14B preset). Accepted: a two-expert "
                              "folder (transformer/ + transformer_2/, or high_noise_model/ + low_noise_model/), or "
                              "set model.model_kwargs.train_high_noise or train_low_noise to false so these weights "
                              "are the other expert")
        sources = {trained[0]: (name_or_path, seed)}
    return trained, boundary, sources


def plan_experts(process, preset) -> ExpertPlan | None:
    """The `ExpertPlan` of a parsed job (None for a one-model preset); reads the model folder (which
    experts it holds, its boundary). ConfigError naming the key or path for what cannot work."""
    m, t = process.model, process.train
    if not preset.two_experts:
        requested(m, preset)
        return None
    trained, boundary, sources = model_experts(m.name_or_path, m, preset, m.seed)
    check_ranges(t, trained, boundary)
    if t.expert_choice not in EXPERT_CHOICES:
        raise ConfigError(f"{PROCESS}.train.expert_choice", f"{t.expert_choice!r}; accepted: {', '.join(EXPERT_CHOICES)}")
    return ExpertPlan(boundary, trained, sources, t.switch_boundary_every, t.expert_choice)


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
        import torch

        gen = torch.Generator("cpu").manual_seed(self.seed_of(self.seed, "expert", step))
        return expert_at(float(self.sampler.sample(1, gen)[0]), self.plan.boundary)

    def steps_of(self, expert: str, total: int) -> list[int]:
        """The steps in [0, total) that train `expert`, in order."""
        while len(self._cache) < total:
            self._cache.append(self.expert_of(len(self._cache)))
        return [s for s in range(total) if self._cache[s] == expert]


__all__ = ["EXPERT_CHOICES", "ExpertPlan", "ExpertSchedule", "KEY_OF", "boundary_of", "check_ranges", "model_experts",
           "plan_experts", "requested"]
