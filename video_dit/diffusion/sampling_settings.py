"""Which sampling settings a render uses, and where each one came from.

Precedence, highest first:
1. the command line (`video-dit sample --solver/--steps/--shift/--cfg/--cfg-2/--negative`) or the job's
   `sample:` keys (`sampler`, `sample_steps`, `shift`, `guidance_scale`, `guidance_scale_2`, `neg`; a
   `samples[i]` key before the block's); `--cfg-2` / `guidance_scale_2`: a two-expert model's low-noise
   expert's scale (`--cfg` / `guidance_scale` is then the high-noise one's, and both when given alone);
2. a diffusers model folder's `scheduler/scheduler_config.json`: the solver (its class) and the shift,
   and diffusers' sigma grid (`flow.diffusers_schedule`, grid "diffusers") where the family samples on it
   (`Family.sampling_grids`); a family's own scheduler class (`Family.scheduler_classes`) its shift on the
   family's own grid; a dynamic-shifting Euler scheduler (LTX-2's folders) gives the shift at its
   longest anchor, exp(max_shift), and grid `flow.DYNAMIC_GRID` (the family's pipeline shifts by its token
   count), refused for a family without it; and its `guider/guider_config.json`: the guidance scale;
3. the preset's `sample_*` fields (the reference's defaults for that model);
4. for a model with no preset, its family's defaults (`Family.sampling_defaults`: the reference's own).
Otherwise a render samples on the family's own grid ("reference": `Family.sampling_schedule`), with the
solvers the family has (`Family.solvers`).
`SamplingSettings.describe()` is the one line `video-dit sample` and the trainer print.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from video_dit.diffusion.flow import DYNAMIC_GRID, SOLVERS
from video_dit.models.layouts import preset_name

FIELDS: tuple[str, ...] = ("solver", "steps", "shift", "guidance", "guidance_2", "negative")
SCHEDULER_CONFIG = Path("scheduler") / "scheduler_config.json"
GUIDER_CONFIG = Path("guider") / "guider_config.json"
# diffusers' ClassifierFreeGuidance keys that must keep the value we implement (v_u + s (v_c - v_u) at
# every step): key -> (accepted values, diffusers' default when absent)
_GUIDER_KEYS = {"guidance_rescale": ((0.0, 0), 0.0), "use_original_formulation": ((False,), False),
                "start": ((0.0, 0), 0.0), "stop": ((1.0, 1), 1.0)}

# diffusers scheduler classes we sample exactly: class -> (our solver, the key holding the shift, the
# keys that must keep a value we implement: key -> (accepted values, diffusers' default when absent)).
# Keys not listed (beta_*, timestep_spacing, steps_offset, ...) have no effect on the flow-sigma path.
_SCHEDULERS = {
    "UniPCMultistepScheduler": ("unipc", "flow_shift", {
        "prediction_type": (("flow_prediction",), "epsilon"),
        "use_flow_sigmas": ((True,), False),
        "solver_order": ((2,), 2),
        "solver_type": (("bh2", "midpoint", "heun", "logrho"), "bh2"),  # diffusers maps the last 3 to bh2
        "predict_x0": ((True,), True),
        "lower_order_final": ((True,), True),
        "final_sigmas_type": (("zero",), "zero"),
        "disable_corrector": (([],), []),
        "solver_p": ((None,), None),
        "thresholding": ((False,), False),
        "use_dynamic_shifting": ((False,), False),
        "use_karras_sigmas": ((False,), False),
        "use_exponential_sigmas": ((False,), False),
        "use_beta_sigmas": ((False,), False),
        "shift_terminal": ((None,), None),
        "num_train_timesteps": ((1000,), 1000),
    }),
    "FlowMatchEulerDiscreteScheduler": ("euler", "shift", {
        "use_dynamic_shifting": ((False,), False),
        "invert_sigmas": ((False,), False),
        "shift_terminal": ((None,), None),
        "use_karras_sigmas": ((False,), False),
        "use_exponential_sigmas": ((False,), False),
        "use_beta_sigmas": ((False,), False),
        "stochastic_sampling": ((False,), False),
        "num_train_timesteps": ((1000,), 1000),
    }),
}


# FlowMatchEulerDiscreteScheduler with `use_dynamic_shifting` (grid `flow.DYNAMIC_GRID`): the keys that must keep
# the values the family's dynamic grid implements (diffusers' LTX-2 folders: scripts/convert_ltx2_to_diffusers.py
# base_shift 0.95 at 1024 tokens, max_shift at 4096, shift_terminal 0.1); the shift read is exp(max_shift)
_DYNAMIC_EULER = {
    "base_shift": ((0.95,), 0.5),
    "base_image_seq_len": ((1024,), 256),
    "max_image_seq_len": ((4096,), 4096),
    "shift_terminal": ((0.1,), None),
    "time_shift_type": (("exponential",), "exponential"),
    "invert_sigmas": ((False,), False),
    "use_karras_sigmas": ((False,), False),
    "use_exponential_sigmas": ((False,), False),
    "use_beta_sigmas": ((False,), False),
    "stochastic_sampling": ((False,), False),
    "num_train_timesteps": ((1000,), 1000),
}


@dataclass(frozen=True)
class SchedulerConfig:
    """What a diffusers folder's scheduler config says: our solver, its shift, its sigma grid."""

    solver: str
    shift: float
    grid: str
    path: Path


def _folder_json(model, name: str) -> tuple[Path, dict] | None:
    """(path, contents) of the JSON file `name` inside the model folder `model`; None when `model` is
    not a folder holding one (a preset, a single weights file); an unreadable one is a `ValueError`."""
    if model is None or preset_name(model) is not None:
        return None
    path = Path(model) / name
    if not path.is_file():
        return None
    try:
        return path, json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from exc


def read_scheduler_config(model, own: dict | None = None) -> SchedulerConfig | None:
    """`<model>/scheduler/scheduler_config.json` as a `SchedulerConfig`; None when `model` is not a
    folder holding one. `own`: the scheduler classes the families sample on their own grids
    (`families.scheduler_classes()`, which the callers above pass; None: diffusers' classes only). A scheduler we cannot sample exactly is a `ValueError` naming the file, the key,
    its value and what is accepted (pass the solver and shift explicitly to sample without it)."""
    found = _folder_json(model, SCHEDULER_CONFIG)
    if found is None:
        return None
    path, cfg = found
    name = cfg.get("_class_name")
    own = own or {}  # a family's own scheduler class: sampled on that family's grid ("reference")
    if name not in _SCHEDULERS and name not in own:
        raise ValueError(f"{path}: scheduler class {name!r} is not one we sample; accepted: "
                         f"{', '.join([*_SCHEDULERS, *own])} (or give the solver and shift explicitly)")
    solver, shift_key, required = _SCHEDULERS[name] if name in _SCHEDULERS else own[name]
    grid = "diffusers" if name in _SCHEDULERS else "reference"
    if name == "FlowMatchEulerDiscreteScheduler" and cfg.get("use_dynamic_shifting", False) is True:
        shift_key, required, grid = "max_shift", _DYNAMIC_EULER, DYNAMIC_GRID
    for key, (accepted, default) in required.items():
        value = cfg.get(key, default)
        if value not in accepted:
            raise ValueError(f"{path}: {key} = {value!r} is not supported for {name}; accepted: "
                             f"{', '.join(map(repr, accepted))} (or give the solver and shift explicitly)")
    shift = cfg.get(shift_key, 1.0)
    if not isinstance(shift, (int, float)) or isinstance(shift, bool) or (shift <= 0 and grid != DYNAMIC_GRID):
        raise ValueError(f"{path}: {shift_key} = {shift!r}; expected a number > 0")
    return SchedulerConfig(solver, math.exp(shift) if grid == DYNAMIC_GRID else float(shift), grid, path)


@dataclass(frozen=True)
class GuiderConfig:
    """What a diffusers folder's guider config says: the classifier-free guidance scale."""

    guidance: float
    path: Path


def read_guider_config(model) -> GuiderConfig | None:
    """`<model>/guider/guider_config.json` (diffusers' `ClassifierFreeGuidance`, as HunyuanVideo 1.5
    folders carry it: 6.0, 1.0 for the distilled models) as a `GuiderConfig`; None when `model` is not a
    folder holding one. Another guider, or one we do not sample exactly, is a `ValueError` naming the
    file, the key and what is accepted (pass the guidance scale explicitly to sample without it)."""
    found = _folder_json(model, GUIDER_CONFIG)
    if found is None:
        return None
    path, cfg = found
    if cfg.get("_class_name") != "ClassifierFreeGuidance":
        raise ValueError(f"{path}: guider class {cfg.get('_class_name')!r} is not one we sample; accepted: "
                         "ClassifierFreeGuidance (or give the guidance scale explicitly)")
    for key, (accepted, default) in _GUIDER_KEYS.items():
        if cfg.get(key, default) not in accepted:
            raise ValueError(f"{path}: {key} = {cfg[key]!r} is not supported; accepted: {accepted[0]!r} (or give "
                             "the guidance scale explicitly)")
    scale = 1.0 if cfg.get("enabled", True) is False else cfg.get("guidance_scale", 7.5)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or scale < 0:
        raise ValueError(f"{path}: guidance_scale = {scale!r}; expected a number >= 0")
    return GuiderConfig(float(scale), path)


@dataclass(frozen=True)
class SamplingSettings:
    solver: str
    steps: int
    shift: float
    guidance: float               # two experts (Wan 2.2 A14B): the high-noise expert's scale
    negative: str
    guidance_2: float | None = None  # two experts: the low-noise expert's scale; None for one model
    grid: str = "reference"       # the family's own sigma grid, or "diffusers" (flow.SCHEDULE_GRIDS)
    sources: dict[str, str] = field(default_factory=dict)  # field -> where its value came from
    negative_names: dict[str, str] = field(default_factory=dict)  # the family's default prompts -> their names
    reference: str = "the reference"  # whose own grid "reference" is (the family's title)

    @property
    def guided(self) -> bool:
        """Whether any step runs the unconditional pass (so the negative prompt is encoded)."""
        return self.guidance != 1.0 or (self.guidance_2 is not None and self.guidance_2 != 1.0)

    def describe(self) -> str:
        """One line: the values, then which came from where."""
        solver = self.solver + (" on diffusers' grid" if self.solver == "unipc" and self.grid == "diffusers"
                                else f" on {self.reference}'s grid" if self.solver == "unipc"
                                else " on diffusers' grid shifted by the token count" if self.grid == DYNAMIC_GRID
                                else "")
        guided = self.guided
        neg = f", negative prompt {self._negative_name()}" if guided else " (off: no negative pass)"
        guidance = (f"guidance {self.guidance:g}" if self.guidance_2 is None else
                    f"guidance {self.guidance:g} (high-noise expert) / {self.guidance_2:g} (low-noise expert)")
        by_source: dict[str, list[str]] = {}
        for name in FIELDS:
            if (name != "negative" or guided) and (name != "guidance_2" or self.guidance_2 is not None):
                by_source.setdefault(self.sources.get(name, "?"), []).append(name)
        where = "; ".join(f"{', '.join(names)}: {source}" for source, names in by_source.items())
        return f"sampling: {solver}, {self.steps} steps, shift {self.shift:g}, {guidance}{neg} [{where}]"

    def _negative_name(self) -> str:
        text = self.negative
        if text in self.negative_names:
            return self.negative_names[text]
        return "none ('')" if not text else repr(text if len(text) <= 40 else text[:37] + "...")


def resolve_sampling(preset, scheduler: SchedulerConfig | None = None,
                     given: dict[str, tuple[object, str]] | None = None,
                     two_experts: bool | None = None, guider: GuiderConfig | None = None,
                     *, family) -> SamplingSettings:
    """The settings of a render. preset: a `Preset` or None (then the family's defaults); scheduler:
    `read_scheduler_config(model)`; guider: `read_guider_config(model)`; given: field -> (value, where it
    was given, e.g. "--steps" or "sample.sample_steps") for the values the command or job sets (others
    absent). family: the model's `families.Family` (its solvers, grids, defaults, default negative
    prompts). two_experts (default: the preset's):
    a two-expert model, whose `guidance_2` (the low-noise expert's scale) is the given one, else the
    given `guidance` when only that is given (as diffusers' guidance_scale_2 = None), else the preset's
    pair; a one-model render refuses a given guidance_2."""
    given = dict(given or {})
    unknown = set(given) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling settings {sorted(unknown)}; accepted: {', '.join(FIELDS)}")
    two = two_experts if two_experts is not None else bool(preset is not None and preset.two_experts)
    if not two and "guidance_2" in given:
        raise ValueError(f"{given['guidance_2'][1]}: the low-noise expert's guidance scale is for a two-expert model "
                         "(Wan 2.2 A14B); this one is one model: give one guidance scale")
    if preset is not None:
        values = dict(solver=preset.sample_solver, steps=preset.sample_steps, shift=preset.sample_shift,
                      guidance=preset.sample_guidance, negative=preset.sample_negative)
        origin = f"preset {preset.name}"
    else:
        values, origin = dict(family.sampling_defaults), family.sampling_origin
    sources = dict.fromkeys(FIELDS, origin)
    if two:
        pair = preset.sample_guidance_2 if preset is not None else None
        values["guidance_2"] = pair if pair is not None else values["guidance"]
        if "guidance" in given and "guidance_2" not in given:
            given["guidance_2"] = (given["guidance"][0], f"{given['guidance'][1]} (both experts)")
    if scheduler is not None:
        values.update(solver=scheduler.solver, shift=scheduler.shift)
        sources.update(solver=str(scheduler.path), shift=str(scheduler.path))
    if guider is not None:
        values["guidance"], sources["guidance"] = guider.guidance, str(guider.path)
    for name, (value, where) in given.items():
        values[name], sources[name] = value, where
    solvers = family.solvers
    if values["solver"] not in solvers:
        what = "unknown solver" if values["solver"] not in SOLVERS else f"{family.title} does not sample with"
        raise ValueError(f"{sources['solver']}: {what} {values['solver']!r}; accepted: {', '.join(solvers)}")
    # the family's own grid; diffusers' only when the folder's own scheduler is what samples and the family
    # samples on diffusers' grids at all
    folder = scheduler is not None and values["solver"] == scheduler.solver
    if folder and scheduler.grid == DYNAMIC_GRID and DYNAMIC_GRID not in family.sampling_grids \
            and sources["shift"] == str(scheduler.path):
        raise ValueError(f"{scheduler.path}: use_dynamic_shifting = True (the shift follows the token count) is not "
                         f"one {family.title} samples; accepted: a scheduler without it (or give the shift explicitly)")
    grid = scheduler.grid if folder and scheduler.grid in family.sampling_grids else "reference"
    return SamplingSettings(**values, grid=grid, sources=sources, negative_names=dict(family.negative_prompts),
                            reference=family.title)
