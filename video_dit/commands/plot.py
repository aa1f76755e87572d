"""`video-dit plot OUTPUT_DIR`: loss, throughput and memory curves from `OUTPUT_DIR/metrics.jsonl`.

Writes `loss.png` (raw loss, an exponentially smoothed line and, when the job validates, the
held-out `val_loss` (and `val_loss_ema`); a model with sound adds a second panel with each stream's
held-out loss, `val_loss_video` / `val_loss_audio` (and their `_ema` twins)), `throughput.png` (samples/s and
tokens/s, stacked) and `memory.png` (peak memory per rank, GB) next to the metrics, or into `--out`.
A line that is not a JSON object with a `step` (a half-written last line of a running job, say) is
skipped with a warning naming the file and line. After a resume, a step logged twice keeps its
last record. matplotlib is installed with the package; a finished training job calls
`plot_metrics` on its own output folder.
"""

from __future__ import annotations

import argparse
import math
import warnings
from pathlib import Path

from video_dit.train.metrics import read_metrics

METRICS_FILE = "metrics.jsonl"
# the per-stream validation losses of a model with sound (train/validation.py `Validator.run`:
# val_loss_<stream>, and val_loss_<stream>_ema with the EMA weights)
STREAMS = (("video", "tab:red"), ("audio", "tab:green"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output_dir", metavar="OUTPUT_DIR",
                        help=f"a training output folder holding {METRICS_FILE} (or the file itself)")
    parser.add_argument("--out", default=None, help="folder for the PNGs (default: next to the metrics)")
    parser.add_argument("--smooth", type=float, default=0.9,
                        help="EMA weight of the smoothed loss line, in [0, 1) (default 0.9)")


def ema(values: list[float], weight: float) -> list[float]:
    """TensorBoard-style smoothing: an EMA with bias correction, so the first points are not pulled
    towards 0. Non-finite values are passed through and do not enter the average."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing weight {weight} is outside [0, 1)")
    out, avg, norm = [], 0.0, 0.0
    for v in values:
        if not math.isfinite(v):
            out.append(v)
            continue
        avg = weight * avg + (1.0 - weight) * v
        norm = weight * norm + (1.0 - weight)
        out.append(avg / norm)
    return out


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that carry a number under `key`."""
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def _rank_series(records: list[dict], key: str) -> dict[str, tuple[list[int], list[float]]]:
    """`key` as one series, or one per rank when the trainer logs a list (one value per rank)."""
    if any(isinstance(r.get(key), list) for r in records):
        ranks: dict[str, tuple[list[int], list[float]]] = {}
        for r in records:
            for i, v in enumerate(r.get(key) or []):
                if isinstance(v, (int, float)):
                    xs, ys = ranks.setdefault(f"rank {i}", ([], []))
                    xs.append(int(r["step"]))
                    ys.append(float(v))
        return ranks
    xs, ys = _series(records, key)
    return {key: (xs, ys)} if xs else {}


def _log_if_positive(ax, values: list[float]) -> None:
    """A log y axis when every finite value drawn on `ax` is positive."""
    if all(y > 0 for y in values if math.isfinite(y)):
        ax.set_yscale("log")


def plot_metrics(metrics: str | Path, out_dir: str | Path | None = None,
                 smooth: float = 0.9) -> dict[Path, dict[str, tuple[list[float], list[float]]]]:
    """Draw the curves of `metrics` (a metrics.jsonl or the folder holding it) to PNGs.

    Returns {png path: {curve label: (x, y)}}, the data actually drawn, read back from the axes.
    A figure whose keys appear in no record is not written (a warning says which).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # headless servers: never open a window
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("video-dit plot needs matplotlib, a dependency of video_dit: reinstall the package "
                           "(pip install -e .) or pip install matplotlib") from exc

    metrics = Path(metrics)
    if metrics.is_dir():
        metrics = metrics / METRICS_FILE
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics}: no such file (a training output folder has {METRICS_FILE})")
    records = read_metrics(metrics)
    if not records:
        raise ValueError(f"{metrics}: no usable records (each line must be a JSON object with a 'step')")
    out_dir = Path(out_dir) if out_dir is not None else metrics.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    title = metrics.parent.name
    drawn: dict[Path, dict[str, tuple[list[float], list[float]]]] = {}

    def save(fig, axes, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        drawn[path] = {line.get_label(): (list(map(float, line.get_xdata())), list(map(float, line.get_ydata())))
                       for ax in axes for line in ax.get_lines()}

    # 1. loss: raw (faint) and smoothed; the held-out validation loss beside it (and its EMA-weights twin);
    #    a model with sound: each stream's held-out loss in a second panel (their scales differ from the sum's)
    xs, ys = _series(records, "loss")
    if xs:
        streams = [(f"val_loss_{name}{suffix}", color, style, *_series(records, f"val_loss_{name}{suffix}"))
                   for name, color in STREAMS for suffix, style in (("", "-"), ("_ema", "--"))]
        streams = [s for s in streams if s[3]]
        fig, axes = plt.subplots(2 if streams else 1, 1, figsize=(7, 7 if streams else 4), sharex=True,
                                 squeeze=False)
        axes = list(axes[:, 0])
        ax = axes[0]
        ax.plot(xs, ys, color="tab:blue", alpha=0.3, linewidth=1, label="loss")
        ax.plot(xs, ema(ys, smooth), color="tab:blue", linewidth=2, label=f"loss (EMA {smooth:g})")
        shown = list(ys)
        for key, color in (("val_loss", "tab:red"), ("val_loss_ema", "tab:purple")):
            vx, vy = _series(records, key)
            if vx:
                ax.plot(vx, vy, color=color, marker="o", markersize=3, linewidth=1.5, label=f"{key} (held out)")
                shown += vy
        ax.set(ylabel="loss", title=f"{title}: loss")
        _log_if_positive(ax, shown)
        if streams:
            sub = axes[1]
            for key, color, style, vx, vy in streams:
                sub.plot(vx, vy, color=color, linestyle=style, marker="o", markersize=3, linewidth=1.5,
                         label=f"{key} (held out)")
            sub.set(ylabel="loss per stream", title="held-out loss per stream")
            _log_if_positive(sub, [y for s in streams for y in s[4]])
        axes[-1].set_xlabel("step")
        for a in axes:
            a.grid(alpha=0.3)
            a.legend()
        save(fig, axes, "loss.png")
    else:
        warnings.warn(f"{metrics}: no 'loss' values; loss.png not written", stacklevel=2)

    # 2. throughput: samples/s and tokens/s stacked (proportional at a fixed shape, so one twin-axis
    #    plot would draw one line on top of the other)
    series = [(k, c, *_series(records, k)) for k, c in (("samples_per_s", "tab:green"), ("tokens_per_s", "tab:orange"))]
    series = [s for s in series if s[2]]
    if series:
        fig, axes = plt.subplots(len(series), 1, figsize=(7, 2.5 + 1.5 * len(series)), sharex=True, squeeze=False)
        axes = list(axes[:, 0])
        for ax, (key, color, x, y) in zip(axes, series):
            ax.plot(x, y, color=color, label=key)
            ax.set_ylabel(key.replace("_per_s", " / s"))
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        axes[0].set_title(f"{title}: throughput")
        axes[-1].set_xlabel("step")
        save(fig, axes, "throughput.png")
    else:
        warnings.warn(f"{metrics}: no 'samples_per_s' / 'tokens_per_s' values; throughput.png not written",
                      stacklevel=2)

    # 3. memory: peak GB, per rank when logged as a list
    mem = _rank_series(records, "peak_mem_gb")
    if mem:
        fig, ax = plt.subplots(figsize=(7, 4))
        for label, (x, y) in mem.items():
            ax.plot(x, y, label=label)
        ax.set(xlabel="step", ylabel="GB", title=f"{title}: peak memory")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, [ax], "memory.png")
    else:
        warnings.warn(f"{metrics}: no 'peak_mem_gb' values; memory.png not written", stacklevel=2)
    return drawn


def write_plots(out_dir: str | Path, log=print) -> list[Path]:
    """What a finished training job does (launch/train.py, rank 0): its curves beside its metrics.jsonl;
    a failure (no matplotlib, no metrics) is one warning line, never an error of the job."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a figure without data is just not drawn
            drawn = list(plot_metrics(out_dir))
    except (RuntimeError, OSError, ValueError) as exc:
        log(f"[video_dit] warning: no plots written ({exc})")
        return []
    log(f"[video_dit] plots: {', '.join(str(q) for q in drawn)}")
    return drawn


def main(args: argparse.Namespace) -> int:
    try:
        drawn = plot_metrics(args.output_dir, args.out, smooth=args.smooth)
    except (RuntimeError, FileNotFoundError, ValueError) as exc:
        print(f"video-dit plot: {exc}")
        return 2
    for path in drawn:
        print(path)
    return 0
