"""Helpers to put the ai-toolkit stand-in (`toolkit/` here) on sys.path for one test module and
take it off again, so no other test ever sees a `toolkit` package."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
_OURS = ("toolkit", "extensions", "video_dit.integrations.ai_toolkit")


def _forget() -> None:
    for name in list(sys.modules):
        if any(name == p or name.startswith(p + ".") for p in _OURS):
            del sys.modules[name]


def activate():
    """Import `video_dit.integrations.ai_toolkit` against the stand-in; returns the package."""
    _forget()
    sys.path.insert(0, str(ROOT))
    import toolkit

    if Path(toolkit.__file__).resolve().parent != ROOT / "toolkit":  # a real ai-toolkit must not sneak in
        raise RuntimeError(f"`toolkit` resolved to {toolkit.__file__}, not the stand-in under {ROOT}")
    import video_dit.integrations.ai_toolkit as aitk

    return aitk


def deactivate() -> None:
    while str(ROOT) in sys.path:
        sys.path.remove(str(ROOT))
    _forget()
