"""`video-dit` command line: one subcommand per module in `video_dit/commands/`.

Each command module exposes `add_arguments(parser)` and `main(args) -> int`; they are imported only
when chosen, so `video-dit --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "sample": ("video_dit.commands.sample", "render a t2v or i2v video to MP4"),
    "make-demo-data": ("video_dit.commands.make_demo_data", "generate the procedural demo dataset"),
    "inspect-data": ("video_dit.commands.inspect_data", "bucket histogram, counts, skips and cache hits of a job's datasets"),
    "train-vae": ("video_dit.commands.train_vae", "train the tiny VAE of the embedded default"),
    "plot": ("video_dit.commands.plot", "draw loss, throughput and memory curves from metrics.jsonl"),
    "check-demo": ("video_dit.commands.check_demo", "check the demo's previews: shape, colour and motion as captioned"),
    "aitk-install": ("video_dit.commands.aitk_install",
                     "register the video_dit arch and its web UI entries in an ai-toolkit checkout"),
    "bench": ("video_dit.commands.bench", "benchmarks side by side with the reference implementation"),
    "plan": ("video_dit.commands.plan", "per-rank memory of a job per bucket, before anything is loaded, and the settings that fit"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="video-dit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name in sys.argv[1:2]:  # only the chosen command's module is imported
            importlib.import_module(module).add_arguments(p)
    return parser


# What a user can cause and fix (a path, a value, a file): one line, exit 2. Anything else is a bug and
# keeps its traceback. VIDEO_DIT_TRACEBACK=1 shows the traceback of these too.
USER_ERRORS = (ValueError, KeyError, OSError)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    sys.argv[1:] = argv
    args = build_parser().parse_args(argv)
    try:
        return int(importlib.import_module(args._module).main(args) or 0)
    except USER_ERRORS as exc:
        if os.environ.get("VIDEO_DIT_TRACEBACK"):
            raise
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"video-dit {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
