"""Per-step metrics: `metrics.jsonl` (one JSON object per optimizer step, rank 0), TensorBoard when
installed, Weights & Biases when the job asks (`logging.use_wandb`, `WandbLog`), and the figures that go in
them (peak memory per rank, analytic MFU)."""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import warnings
from pathlib import Path

import torch

from video_dit.parallel.memory import run_peak_gb


def peak_memory_gb() -> float:
    """This rank's peak memory: CUDA allocator peak on GPU, the process's max RSS on CPU."""
    if torch.cuda.is_available():  # the activation meter resets the counter; it keeps the run's peak

        return run_peak_gb(torch.cuda.current_device())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2 ** 30 if sys.platform == "darwin" else 2 ** 20)


def step_flops(dit_config, latent_shape, text_len: int, flops) -> tuple[float, int]:
    """(model FLOPs of one forward+backward of a micro-batch, tokens per sample): the analytic DiT
    forward count x 3 (backward ~ 2x forward). latent_shape: (B, C, F', h, w); `flops`: the family's
    forward count (`Family.flops`; Wan's by default)."""
    B, _, Fl, h, w = latent_shape
    pt, ph, pw = dit_config.patch_size
    tokens = (Fl // pt) * (h // ph) * (w // pw)
    return 3.0 * flops(dit_config, tokens, text_len, B), tokens


class MetricsLog:
    """Appends rows to `<out>/metrics.jsonl` (rank 0 only; other ranks get a no-op logger).

    The file is the run's history: opened at `resume_step` (the step a run starts or resumes from), it
    first keeps only the rows of earlier steps (those a killed run wrote past its last checkpoint are
    done again now, and a fresh start begins an empty history); a half-written last line goes too."""

    def __init__(self, out_dir: Path, enabled: bool, resume_step: int = 0, wandb: "WandbLog | None" = None):
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self.tb = None
        self.wandb = wandb if enabled else None
        if self.wandb is not None:
            self.wandb.start()
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._truncate(resume_step)
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                SummaryWriter = None
            if SummaryWriter is not None:
                self.tb = SummaryWriter(str(Path(out_dir) / "tensorboard"))

    def _truncate(self, step: int) -> None:
        if not self.path.is_file():
            return
        keep = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
                    keep.append(line if line.endswith("\n") else line + "\n")
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(keep), encoding="utf-8")
        os.replace(tmp, self.path)

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(clean) + "\n")
        if self.tb is not None:
            for k, v in clean.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(f"train/{k}", v, row["step"])
        if self.wandb is not None:
            self.wandb.write(clean)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


class WandbLog:
    """What ai-toolkit sends Weights & Biases (toolkit/logging_aitk.py `WandbLogger`, BaseSDTrainProcess's
    loop, at 27a03a91): `wandb.init(project=, name=, config=the job file)`; every `log_every` optimizer
    steps `learning_rate` and `loss/loss`, with our step's other figures under their metrics.jsonl names
    (ai-toolkit's `additional_logs`), committed at that step; `finish()` at the end. Validation rows (not a
    multiple of `log_every`) are sent when they come. Previews are not sent (ai-toolkit's arch does not
    send its video previews either). Offline runs: `WANDB_MODE=offline`, as wandb reads it."""

    def __init__(self, project: str, run_name: str | None, config: dict, every: int, folder: Path,
                 key: str = "config.process[0].logging.use_wandb"):
        self.project, self.run_name, self.config, self.every = project, run_name, config, every
        self.folder, self.key, self.run = Path(folder), key, None

    def start(self) -> None:
        try:
            import wandb  # optional: only a job with logging.use_wandb imports it
        except ImportError as exc:
            raise ImportError(f"{self.key}: true needs Weights & Biases, which is not installed here: pip install "
                              f"wandb (or set use_wandb: false) ({exc})") from exc
        self.folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=self.project, name=self.run_name, config=self.config, dir=str(self.folder))

    def write(self, row: dict) -> None:
        step = row["step"]
        if step % self.every and not any(k.startswith("val_") for k in row):
            return
        out = {}
        if "lr" in row:
            out["learning_rate"] = row["lr"]
        if "loss" in row:
            out["loss/loss"] = row["loss"]
        out.update({k: v for k, v in row.items() if k not in ("step", "lr", "loss")
                    and isinstance(v, (int, float)) and not isinstance(v, bool)})
        self.run.log(out, step=step)

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


def read_metrics(path: str | Path) -> list[dict]:
    """Records of a metrics.jsonl, sorted by step, one per step (the last one logged wins)."""
    path = Path(path)
    by_step: dict[int, dict] = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                warnings.warn(f"{path}:{lineno}: skipped, not valid JSON ({exc.msg})", stacklevel=2)
                continue
            if not isinstance(record, dict) or not isinstance(record.get("step"), (int, float)) \
                    or isinstance(record.get("step"), bool):
                warnings.warn(f"{path}:{lineno}: skipped, expected a JSON object with a numeric 'step'",
                              stacklevel=2)
                continue
            by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]
