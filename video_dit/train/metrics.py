"""Per-step metrics: `metrics.jsonl` (one JSON object per optimizer step, rank 0), TensorBoard when
installed, and the figures that go in them (peak memory per rank, analytic MFU)."""

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

    def __init__(self, out_dir: Path, enabled: bool, resume_step: int = 0):
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self.tb = None
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

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


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
