"""How a job ended, as the launcher reports it. A rank that ends the job on purpose (a checkpoint it
could not write, a step out of device memory) records its exit code in `<out>/exit_code` before it
exits. DeepSpeed's launcher reports the exit code of the first rank it finds ended, which under load
can be a peer that merely lost its connection to that rank (exit 1, a gloo / NCCL error): the
launcher (`train/launcher.py`) clears the record before the ranks start and, when the job fails,
exits with the recorded code instead."""

from __future__ import annotations

import os
from pathlib import Path

EXIT_FILE = "exit_code"


def record(out_dir: Path, code: int) -> None:
    """Record `code` as the job's exit code (atomically: a reader sees the whole number or nothing)."""
    path = Path(out_dir) / EXIT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{EXIT_FILE}.{os.getpid()}")
    tmp.write_text(f"{code}\n")
    os.replace(tmp, path)


def recorded(out_dir: Path) -> int | None:
    """The recorded exit code, or None (none recorded, or not a number)."""
    path = Path(out_dir) / EXIT_FILE
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def clear(out_dir: Path) -> None:
    (Path(out_dir) / EXIT_FILE).unlink(missing_ok=True)
