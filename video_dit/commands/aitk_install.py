"""`video-dit aitk-install AITK_DIR`: register the `video_dit` arch in an ai-toolkit checkout.

ai-toolkit imports every package under `AITK_DIR/extensions/` and collects its `AI_TOOLKIT_MODELS`
list (`toolkit/util/get_model.py`), so registering is one folder holding a two-line shim that
imports ours. Nothing in ai-toolkit itself is touched. The shim needs `video_dit` importable by
ai-toolkit's Python (for example `pip install --no-deps -e /path/to/video_dit` in its venv).

Running it again is a no-op; a folder of that name that this command did not write is never
overwritten.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

EXTENSION_NAME = "video_dit"
MARKER = "# Written by `video-dit aitk-install`: registers the video_dit arch with ai-toolkit."
SHIM = MARKER + "\nfrom video_dit.integrations.ai_toolkit import AI_TOOLKIT_MODELS  # noqa: F401\n"


class InstallError(RuntimeError):
    """AITK_DIR is not an ai-toolkit checkout, or the extension folder belongs to someone else."""


def install(aitk_dir: str | Path) -> tuple[Path, str]:
    """Write `AITK_DIR/extensions/video_dit/__init__.py`; returns (path, "installed" | "updated" |
    "unchanged"). Raises `InstallError` naming the folder when it is not ours to write."""
    root = Path(aitk_dir).expanduser().resolve()
    if not root.is_dir():
        raise InstallError(f"{root}: no such directory (expected an ai-toolkit checkout)")
    missing = [name for name in ("run.py", "toolkit") if not (root / name).exists()]
    if missing:
        raise InstallError(f"{root}: does not look like an ai-toolkit checkout "
                           f"(missing {', '.join(missing)}; expected run.py, toolkit/ and extensions/)")
    folder = root / "extensions" / EXTENSION_NAME
    shim = folder / "__init__.py"
    if folder.exists():
        if not folder.is_dir():
            raise InstallError(f"{folder}: exists and is not a folder; refusing to overwrite it")
        if not shim.is_file():
            raise InstallError(f"{folder}: exists without an __init__.py written by video-dit "
                               "aitk-install; refusing to overwrite a foreign folder (move it away first)")
        current = shim.read_text(encoding="utf-8", errors="replace")
        if not current.startswith(MARKER):
            raise InstallError(f"{folder}: holds an ai-toolkit extension that video-dit aitk-install "
                               "did not write; refusing to overwrite a foreign folder (move it away first)")
        if current == SHIM:
            return shim, "unchanged"
        status = "updated"
    else:
        status = "installed"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = shim.with_suffix(".py.tmp")
    tmp.write_text(SHIM, encoding="utf-8")
    tmp.replace(shim)  # atomic: ai-toolkit never imports a half-written shim
    return shim, status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("aitk_dir", metavar="AITK_DIR", help="root of an ai-toolkit checkout (holds run.py)")


def main(args: argparse.Namespace) -> int:
    try:
        shim, status = install(args.aitk_dir)
    except InstallError as exc:
        print(f"video-dit aitk-install: error: {exc}", file=sys.stderr)
        return 1
    print(f"{status}: {shim}")
    print("In the job file set `model.arch: video_dit` and `model.name_or_path: preset:tiny` (or a weights "
          "path with `model.model_kwargs.preset`). ai-toolkit's Python must be able to import video_dit.")
    return 0
