"""The optimizer and its learning-rate schedule, and `initialize`: the trainer's one call that gives a
DiT (its trainable parameters chosen and its dtypes set, `train/build.py`, `train/precision.py`) its
optimizer and LR scheduler and hands all three to DeepSpeed under the job's ZeRO layout
(`parallel/zero.py`).

    AdamW               torch's (fused on CUDA, `devices.fused_optimizer`: no JIT-compiled DeepSpeed
                        extension is built), `train.optimizer_params`
    LRSchedule          linear warmup, then constant or a cosine to 0; extended by a resume that
                        changes `train.steps`; stored in checkpoints
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from video_dit.devices import fused_optimizer
from video_dit.parallel.zero import Distribution


@dataclass(frozen=True)
class LRSchedule:
    """Multiplier of the peak LR at optimizer step s (0-based: step s + 1 of metrics.jsonl trains at
    lr x at(s)): linear warmup over `warmup` steps, then constant, or a cosine to 0 at step `total`.

    A run resumed at step s0 with another `train.steps` T follows `extended(s0, T)` (the rule; the
    trainer logs it and the checkpoint stores the result, so a later resume continues it):
      - constant: unchanged (the warmup does not depend on train.steps);
      - cosine, resumed inside the warmup: the warmup, then the cosine over the new total;
      - cosine, resumed after it: the cosine re-stretched from s0 to T, starting at the multiplier
        the checkpoint's schedule had at s0 (no jump): at(s) = c * (1 + cos(pi (s - s0) / (T - s0))) / 2,
        c = at_old(s0); when that schedule had already reached 0 (the run finished, c = 0) it restarts
        at c = 1 (a warm restart over the added steps; otherwise every added step would train at lr 0).
    `anchor`/`scale` hold s0 and c (0 and 1 for a schedule never extended).
    """

    kind: str
    warmup: int
    total: int
    anchor: int = 0
    scale: float = 1.0

    @classmethod
    def of(cls, train_cfg) -> "LRSchedule":
        return cls(train_cfg.lr_scheduler, train_cfg.warmup_steps, train_cfg.steps)

    def __call__(self, s: int) -> float:
        if s < self.warmup:
            return (s + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        start = max(self.warmup, self.anchor)
        progress = (s - start) / max(1, self.total - start)
        return self.scale * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    def extended(self, step: int, total: int) -> "LRSchedule":
        """The schedule of a run resumed at `step` whose train.steps is now `total` (see the class)."""
        if self.kind == "constant" or step < max(self.warmup, self.anchor) or total == self.total:
            return dataclasses.replace(self, total=total)
        scale = self(step)
        return dataclasses.replace(self, total=total, anchor=step, scale=scale if scale > 0 else 1.0)

    def describe(self, step: int, old: "LRSchedule") -> str:
        """One log line: what the resumed run's LR does from `step` on, and why."""
        if self.kind == "constant":
            return f"train.steps {old.total} -> {self.total}: the constant LR schedule is unchanged"
        if self.anchor != step:
            return (f"train.steps {old.total} -> {self.total} inside the warmup: the cosine now ends at step "
                    f"{self.total}")
        how = ("the checkpoint's cosine had finished (LR 0), so a new cosine (warm restart) runs over the added "
               "steps" if old(step) <= 0 else "the cosine is re-stretched from the LR it had at the resumed step "
               "(no jump)")
        return (f"train.steps {old.total} -> {self.total}: {how}, x{self.scale:.4g} of the peak at step {step + 1} "
                f"down to 0 at step {self.total}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def at_steps(schedule, steps: list[int] | None, total: int):
    """The LR multiplier of an optimizer that steps only at the global optimizer steps `steps` (one
    expert of a two-expert job): its k-th step trains at `schedule(steps[k])`, the job's schedule at
    that global step (as ai-toolkit's one scheduler gives); past the last listed step, at the steps
    after `total`. `steps` None: every step (the schedule itself)."""
    if steps is None:
        return schedule
    return lambda k: schedule(steps[k] if k < len(steps) else total + k - len(steps))


def schedule_change(meta: dict, train_cfg) -> tuple[str, str] | None:
    """(key, message) when the job changes what a resumed run cannot change about the LR schedule
    of the checkpoint described by `meta` (its meta.json): the peak `lr`, `warmup_steps` or
    `lr_scheduler` (DeepSpeed restores the schedule's state; a new value would apply silently or not
    at all). `train.steps` may change (`LRSchedule.extended`). None when nothing conflicts."""
    saved = meta.get("lr_schedule")
    if saved is None:
        return None
    was = {"lr": meta.get("lr"), "warmup_steps": saved["warmup"], "lr_scheduler": saved["kind"]}
    for key, old in was.items():
        new = getattr(train_cfg, key)
        if old is not None and new != old:
            return key, (f"{new!r}, but checkpoint step {meta.get('step')} was trained with {old!r}, and a resumed "
                         "run continues the checkpoint's LR schedule (only train.steps may change: the schedule is "
                         f"then re-stretched, see the README). Accepted: {old!r}, or save.resume: none (a new run "
                         "from step 0)")
    return None


def lr_lambda(warmup_steps: int, total_steps: int, kind: str):
    """The LR multiplier of a fresh schedule (`LRSchedule`) as a plain function of the step."""
    return LRSchedule(kind, warmup_steps, total_steps)


def build_optimizer(params, train_cfg, schedule: LRSchedule | None = None, steps: list[int] | None = None):
    """AdamW and its LambdaLR over `schedule` (default: `LRSchedule.of(train_cfg)`); `steps`: the global
    steps this optimizer steps at (`at_steps`)."""
    o = train_cfg.optimizer_params
    kwargs = dict(lr=train_cfg.lr, betas=tuple(o.betas), eps=o.eps,
                  weight_decay=o.weight_decay if train_cfg.optimizer == "adamw" else 0.0)
    if fused_optimizer():
        kwargs["fused"] = True
    optimizer = torch.optim.AdamW(params, **kwargs)
    schedule = schedule or LRSchedule.of(train_cfg)
    fn = at_steps(schedule, steps, train_cfg.steps)
    # a plain function, not the dataclass: LambdaLR.state_dict() saves a callable object's __dict__ and
    # load_state_dict() writes it back, which would put the checkpoint's schedule over an extended one
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: fn(s))
    return optimizer, scheduler


def sync_lr(scheduler) -> None:
    """Set the optimizer's LR (and `get_last_lr()`) to the schedule's value at the scheduler's step.
    After a resume, DeepSpeed restores the LR the checkpoint's optimizer had after its last step; with
    an extended schedule that is the old schedule's value (0.0 at the end of a finished cosine), which
    the first resumed step would train at."""
    step = scheduler.last_epoch
    lrs = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = lrs


def initialize(model, job, world_size: int, load_universal: bool = False, schedule: LRSchedule | None = None,
               steps: list[int] | None = None, distribution: Distribution | None = None):
    """(engine, optimizer, scheduler) for `model` whose trainable parameters have requires_grad (and
    whose dtypes `precision.cast_for_training` set: DeepSpeed keeps them as they are); `schedule`: the
    LR schedule (default: the job's own, `LRSchedule.of(job.process.train)`); `steps`: the global
    optimizer steps it trains at (one expert of two; None: every step); `distribution`: the job's
    ZeRO layout (default: `Distribution.of(job, world_size)`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    optimizer, scheduler = build_optimizer(params, job.process.train, schedule, steps)
    distribution = distribution or Distribution.of(job, world_size)
    return distribution.initialize(model, optimizer, scheduler, load_universal=load_universal)
