"""`video-dit check-demo CONFIG`: do the embedded demo's previews show what their captions say?

For each preview prompt of the job (`sample.samples`, demo captions such as "a red square moving
right on a black background") and each step asked (default: 0 and the last step rendered), reads
`<out>/samples/<step>_<i>.mp4` and checks the shape, its colour and its motion with
`video_dit.data.demo.check_clip` (the foreground's centroid track, fill and mean colour in the decoded
MP4). Prints one line per preview and a count per step; the embedded default's trainer prints the
same report at the end of its run. Exit 0 when every preview of the last step passes, 1 otherwise,
2 when the config or the previews cannot be read.

Previews with sound (the audio-video demo's) are heard too (`demo_av.sound_report`: each preview's track
audible and its dominant pitch within a semitone of its caption colour's note, from the MP4's audio track;
`video_dit.data.demo_av.check_sound`), and the exit status asks both halves to pass.

`--seeds N` also renders every preview prompt at N further seeds (`sample.seed` + 1000 + k, one per
round) from the job's latest full fine-tune export, with the settings its previews used (`video-dit
sample --model <out>/<name>`, which reads them from the export), into `<out>/samples/seeds/`, and
checks each: how often a preview passes, not only at the previews' own seeds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
from pathlib import Path

from video_dit.commands import sample as sample_command
from video_dit.data.demo import check_clip, preview_steps, report
from video_dit.data.demo_av import previews_have_sound, sound_report
from video_dit.media import MediaError, read_video_frames
from video_dit.train.config import load_job
from video_dit.typed_config import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="the job YAML whose previews to check")
    parser.add_argument("--steps", default=None,
                        help="comma-separated steps (default: 0 and the last step with previews)")
    parser.add_argument("--seeds", type=int, default=0, metavar="N",
                        help="also render every preview prompt at N more seeds from the latest export and check them")


SEED_OFFSET = 1000  # --seeds k renders at sample.seed + SEED_OFFSET + k: clear of the previews' walked seeds


def check_seeds(export: Path, samples: list, base_seed: int, rounds: int, out: Path) -> tuple[str, list[list[dict]]]:
    """Render each of `samples` (the job's `sample.samples`: prompt + ctrl_img) at seeds base_seed + k,
    k < rounds, from the full fine-tune export folder `export` (`video-dit sample`, the previews'
    settings), into `out/<k>_<i>.mp4`, and `check_clip` each. (printable report, [round][preview])."""
    if not export.is_dir():
        raise ValueError(f"--seeds renders from the job's latest full fine-tune export, {export}: not found "
                         "(a LoRA job, or no export yet)")
    parser = argparse.ArgumentParser()
    sample_command.add_arguments(parser)
    results = []
    for k in range(rounds):
        row = []
        for i, s in enumerate(samples):
            path = out / f"{k:03d}_{i}.mp4"
            argv = ["--model", str(export), "--prompt", s.prompt, "--seed", str(base_seed + k), "--out", str(path)]
            if s.ctrl_img:
                argv += ["--image", str(s.ctrl_img)]
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                sample_command.main(parser.parse_args(argv))
            row.append(check_clip(read_video_frames(path), s.prompt))
        results.append(row)
    lines = [f"{rounds} more seed(s) ({base_seed}..{base_seed + rounds - 1}) from {export}, rendered to {out}:"]
    for i, s in enumerate(samples):
        mine = [row[i] for row in results]
        share = sum(r["shape_share"] for r in mine) / len(mine)
        failed = sorted({f for r in mine for f in r["failed"]})
        lines.append(f"  {sum(r['ok'] for r in mine)}/{rounds} pass  {s.prompt} (seen as its shape in {share:.0%} of "
                     f"the frames on average{'; failed: ' + ', '.join(failed) if failed else ''})")
    lines.append(f"in all: {sum(r['ok'] for row in results for r in row)}/{rounds * len(samples)} pass")
    return "\n".join(lines), results


def main(args: argparse.Namespace) -> int:
    if args.seeds < 0:
        print(f"video-dit check-demo: --seeds {args.seeds}: expected a count >= 0")
        return 2
    try:
        job = load_job(args.config)
    except ConfigError as exc:
        print(f"video-dit check-demo: {exc}")
        return 2
    p = job.process
    prompts = [s.prompt for s in p.sample.samples] if p.sample is not None else []
    samples = job.out_dir / "samples"
    found = preview_steps(samples)
    if not prompts or not found:
        print(f"video-dit check-demo: no previews to check in {samples}")
        return 2
    try:
        steps = [int(s) for s in args.steps.split(",")] if args.steps else sorted({0, found[-1]} & set(found))
    except ValueError:
        print(f"video-dit check-demo: --steps {args.steps!r}: expected comma-separated integers")
        return 2
    try:
        text, results = report(samples, prompts, steps)
    except ValueError as exc:  # a prompt that is not a demo caption
        print(f"video-dit check-demo: {exc}")
        return 2
    print(text)
    sound = None
    if previews_have_sound(samples, steps):
        sound_text, sound = sound_report(samples, prompts, steps)
        print(sound_text)
    if args.seeds:
        try:
            seeds_text, _ = check_seeds(job.out_dir / job.name, p.sample.samples, p.sample.seed + SEED_OFFSET,
                                        args.seeds, samples / "seeds")
        except (ValueError, MediaError, FileNotFoundError) as exc:  # a WeightsError is a ValueError
            print(f"video-dit check-demo: {exc}")
            return 2
        print(seeds_text)
    heard = sound is None or all(r["ok"] for r in sound[steps[-1]])
    return 0 if heard and all(r["ok"] for r in results[steps[-1]]) else 1
