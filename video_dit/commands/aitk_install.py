"""`video-dit aitk-install AITK_DIR`: register the `video_dit` arch and its UI entries in an ai-toolkit checkout.

    video-dit aitk-install AITK_DIR              the Python extension, the smoke-test bases, the UI entries
    video-dit aitk-install --no-ui AITK_DIR      the Python extension and the bases only
    video-dit aitk-install --uninstall AITK_DIR  removes all of it (ai-toolkit's own files as they were)

What it writes (ai-toolkit read at commit 27a03a91):
  extensions/video_dit/__init__.py    a two-line shim importing our `AI_TOOLKIT_MODELS`: ai-toolkit imports every
                                      package under `extensions/` and collects that list (`toolkit/util/get_model.py`);
                                      video_dit must be importable by ai-toolkit's Python (`pip install --no-deps -e`)
  extensions/video_dit/bases/<preset>/  a trainable base per smoke-test preset (`aitk_ui.smoke_test`): the preset's
                                      seeded init with its zero-initialised parameters drawn small, since a LoRA on the
                                      init itself trains nothing (`spec.check_lora`); its UI entry points at it
  ui/src/app/jobs/new/video_dit.tsx   the UI entries, generated from the family registry (`integrations/aitk_ui.py`)
  ui/src/app/jobs/new/options.tsx     two lines, each ending `// video-dit aitk-install`: the import and
                                      `...videoDitModelArchs,` in `modelArchs` (the UI has no plug-in point)
  ui/src/app/jobs/new/SimpleJob.tsx   one line, so tagged: its LoKr target is not offered for a video_dit model (our
                                      LoRA files, shared with our DeepSpeed trainer and ComfyUI, hold plain LoRA;
                                      the arch refuses LoKr, and HunyuanVideo 1.5's fused q / k / v would have no
                                      LoKr file form)
The UI serves what it was built from: the command prints the rebuild command when the UI files changed.

Running it again changes nothing that is current (each file reports installed / updated / unchanged); a
folder or file of ours that this command did not write is never overwritten, nor removed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

EXTENSION_NAME = "video_dit"
MARKER = "# Written by `video-dit aitk-install`: registers the video_dit arch with ai-toolkit."
SHIM = MARKER + "\nfrom video_dit.integrations.ai_toolkit import AI_TOOLKIT_MODELS  # noqa: F401\n"
UI_FOLDER = Path("ui/src/app/jobs/new")
UI_FILE = "video_dit.tsx"
LINE_TAG = "// video-dit aitk-install"
IMPORT_LINE = f"import {{ videoDitModelArchs }} from './video_dit'; {LINE_TAG}"
SPREAD_LINE = f"  ...videoDitModelArchs, {LINE_TAG}"
MODEL_LIST = "export const modelArchs: ModelArch[] = ["  # options.tsx (27a03a91 line 81)
LOKR_OPTION = "{ value: 'lokr', label: 'LoKr' },"  # SimpleJob.tsx's Target Type options (27a03a91 line 563)
LOKR_HIDDEN = ("...(jobConfig.config.process[0].model.arch?.startsWith('video_dit:') ? [] : "
               f"[{LOKR_OPTION[:-1]}]), {LINE_TAG}")
BASES = "bases"
BASE_STAMP = "video_dit_base.json"
BASE_STD = 0.05  # the zero-initialised parameters' draw (N(0, 0.05), as the tests' trained bases)
BASE_VERSION = 1  # bump when what a base holds changes: installed bases are rewritten
REBUILD = "cd {ui} && npm run build_and_start"  # ai-toolkit's README: builds the UI and starts it


class InstallError(RuntimeError):
    """AITK_DIR is not an ai-toolkit checkout, or a file or folder to write belongs to someone else."""


def checkout(aitk_dir: str | Path) -> Path:
    """The root of an ai-toolkit checkout (holds run.py and toolkit/); `InstallError` otherwise."""
    root = Path(aitk_dir).expanduser().resolve()
    if not root.is_dir():
        raise InstallError(f"{root}: no such directory (expected an ai-toolkit checkout)")
    missing = [name for name in ("run.py", "toolkit") if not (root / name).exists()]
    if missing:
        raise InstallError(f"{root}: does not look like an ai-toolkit checkout "
                           f"(missing {', '.join(missing)}; expected run.py, toolkit/ and extensions/)")
    return root


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)  # atomic: ai-toolkit and the UI build never read a half-written file


def _ours(folder: Path) -> bool:
    """`extensions/video_dit` holds our shim (refusing a foreign folder, naming it)."""
    shim = folder / "__init__.py"
    if not folder.exists():
        return False
    if not folder.is_dir():
        raise InstallError(f"{folder}: exists and is not a folder; refusing to overwrite it")
    if not shim.is_file():
        raise InstallError(f"{folder}: exists without an __init__.py written by video-dit "
                           "aitk-install; refusing to overwrite a foreign folder (move it away first)")
    if not shim.read_text(encoding="utf-8", errors="replace").startswith(MARKER):
        raise InstallError(f"{folder}: holds an ai-toolkit extension that video-dit aitk-install "
                           "did not write; refusing to overwrite a foreign folder (move it away first)")
    return True


def install(aitk_dir: str | Path) -> tuple[Path, str]:
    """Write `AITK_DIR/extensions/video_dit/__init__.py`; returns (path, "installed" | "updated" |
    "unchanged"). Raises `InstallError` naming the folder when it is not ours to write."""
    folder = checkout(aitk_dir) / "extensions" / EXTENSION_NAME
    shim = folder / "__init__.py"
    if _ours(folder):
        if shim.read_text(encoding="utf-8", errors="replace") == SHIM:
            return shim, "unchanged"
        status = "updated"
    else:
        status = "installed"
    folder.mkdir(parents=True, exist_ok=True)
    _write(shim, SHIM)
    return shim, status


# ---------------------------------------------------------------- trainable bases of the smoke-test presets


def _base_stamp(name: str) -> dict:
    from video_dit.families import get_preset

    preset = get_preset(name)
    config = hashlib.sha256(repr((preset.dit, preset.boundary_ratio)).encode()).hexdigest()[:16]
    return {"preset": name, "dit_config": config, "std": BASE_STD, "version": BASE_VERSION}


def write_base(name: str, folder: Path) -> None:
    """The trainable base of smoke-test preset `name` in `folder` (replaced whole): the preset's seeded init
    (`load_dit("preset:NAME")`; a two-expert preset's experts at their seeds, `expert_seed`), every parameter
    entry its init leaves at exactly zero (output layer, gates, modulation; a LoRA on the blocks gets no
    gradient through them) drawn N(0, BASE_STD) from a generator of its own; saved as an export is
    (`model.safetensors` + `config.json`, a two-expert model's in `high_noise_model/` and `low_noise_model/`)
    with `video_dit_sources.json` naming the preset's random VAE and encoders, so the folder loads alone."""
    import torch
    from safetensors.torch import save_file

    from video_dit.diffusion.experts import EXPERTS
    from video_dit.families import family_of, get_preset
    from video_dit.models.layouts import EXPERT_FOLDERS, expert_seed, write_sources
    from video_dit.spec import Request, resolve

    preset = get_preset(name)
    family = family_of(preset)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for i, expert in enumerate(EXPERTS if preset.two_experts else (None,)):
        dit = family.load_dit(f"preset:{name}", seed=expert_seed(0, expert) if expert else 0)
        generator = torch.Generator().manual_seed(1 + i)
        with torch.no_grad():
            for _, p in sorted(dit.named_parameters()):
                zero = p == 0
                if zero.any():
                    p.copy_(torch.where(zero, (torch.randn(p.shape, generator=generator) * BASE_STD).to(p.dtype), p))
        part = tmp / EXPERT_FOLDERS["original"][expert] if expert else tmp
        part.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in dit.state_dict().items()}, str(part / "model.safetensors"),
                  metadata={"format": "pt"})
        (part / "config.json").write_text(json.dumps(asdict(dit.config), indent=2), encoding="utf-8")
    write_sources(tmp, resolve(Request(f"preset:{name}")).sources())  # a preset base: every source a preset name, recorded as it is
    (tmp / BASE_STAMP).write_text(json.dumps(_base_stamp(name), indent=2) + "\n", encoding="utf-8")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def install_bases(aitk_dir: str | Path) -> dict[str, tuple[Path, str]]:
    """{smoke-test preset: (its base's folder, "installed" | "updated" | "unchanged")} under
    `extensions/video_dit/bases/` (after `install`, whose folder holds them)."""
    from video_dit.integrations.aitk_ui import entry_presets, smoke_test

    root = checkout(aitk_dir) / "extensions" / EXTENSION_NAME
    if not _ours(root):
        raise InstallError(f"{root}: not installed; run `video-dit aitk-install` (install) first")
    out = {}
    for preset in entry_presets():
        if not smoke_test(preset):
            continue
        folder = root / BASES / preset.name
        stamp = folder / BASE_STAMP
        current = json.loads(stamp.read_text(encoding="utf-8")) if stamp.is_file() else None
        if current == _base_stamp(preset.name):
            out[preset.name] = (folder, "unchanged")
            continue
        write_base(preset.name, folder)
        out[preset.name] = (folder, "installed" if current is None else "updated")
    return out


# ---------------------------------------------------------------- the UI entries


def patched_options(text: str, path: Path) -> str:
    """options.tsx with our two lines (the import before its first import, the spread first in
    `modelArchs`); `InstallError` naming the file when the model list is not where 27a03a91 has it."""
    lines = [line for line in text.splitlines() if not line.endswith(LINE_TAG)]
    try:
        first_import = next(i for i, line in enumerate(lines) if line.startswith("import "))
        model_list = next(i for i, line in enumerate(lines) if line.rstrip() == MODEL_LIST)
    except StopIteration:
        raise InstallError(f"{path}: no `import` line or no `{MODEL_LIST}` line (ai-toolkit's UI changed since "
                           f"27a03a91): add `{IMPORT_LINE}` and `{SPREAD_LINE.strip()}` to its model list by "
                           "hand") from None
    lines.insert(model_list + 1, SPREAD_LINE)
    lines.insert(first_import, IMPORT_LINE)
    return "\n".join(lines) + "\n"


def unpatched_options(text: str) -> str:
    """options.tsx without our lines."""
    return "".join(line for line in text.splitlines(keepends=True) if not line.rstrip("\r\n").endswith(LINE_TAG))


def ui_folder(aitk_dir: str | Path) -> Path:
    """The UI's model-list folder of a checkout; `InstallError` when its options.tsx is missing."""
    folder = checkout(aitk_dir) / UI_FOLDER
    for name in ("options.tsx", "SimpleJob.tsx"):
        if not (folder / name).is_file():
            raise InstallError(f"{folder / name}: missing (an ai-toolkit checkout without its web UI?); pass "
                               "--no-ui to install the Python extension alone")
    return folder


def patched_simple_job(text: str, path: Path) -> str:
    """SimpleJob.tsx with its LoKr option shown for every model but a video_dit one; `InstallError` naming the
    file when the option is not the one line 27a03a91 has."""
    lines = text.splitlines(keepends=True)
    found = [i for i, line in enumerate(lines) if line.strip() in (LOKR_OPTION, LOKR_HIDDEN)]
    if len(found) != 1:
        raise InstallError(f"{path}: {len(found)} lines `{LOKR_OPTION}` (ai-toolkit's UI changed since 27a03a91); "
                           "expected one: LoKr stays offered for video_dit models, which refuse it at load")
    line = lines[found[0]]
    indent = line[:len(line) - len(line.lstrip())]
    lines[found[0]] = indent + LOKR_HIDDEN + line[len(line.rstrip("\r\n")):]
    return "".join(lines)


def unpatched_simple_job(text: str) -> str:
    """SimpleJob.tsx with its LoKr option as ai-toolkit has it."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.strip() == LOKR_HIDDEN:
            lines[i] = line[:len(line) - len(line.lstrip())] + LOKR_OPTION + line[len(line.rstrip("\r\n")):]
    return "".join(lines)


def _patch(path: Path, patch) -> tuple[Path, str]:
    current = path.read_text(encoding="utf-8")
    patched = patch(current, path)
    status = "unchanged" if patched == current else "updated" if LINE_TAG in current else "installed"
    if status != "unchanged":
        _write(path, patched)
    return path, status


def install_ui(aitk_dir: str | Path, bases: dict[str, Path]) -> list[tuple[Path, str]]:
    """Write `video_dit.tsx` (the generated entries; `bases`: each smoke-test preset's base folder) and patch
    `options.tsx` and `SimpleJob.tsx`; [(path, status)]. `InstallError` when the UI folder is missing, a file
    is not ours or ai-toolkit's lines are not where 27a03a91 has them."""
    from video_dit.integrations.aitk_ui import MARKER as TSX_MARKER
    from video_dit.integrations.aitk_ui import entries, render_tsx

    folder = ui_folder(aitk_dir)
    options = folder / "options.tsx"
    out = []
    tsx = folder / UI_FILE
    current = tsx.read_text(encoding="utf-8", errors="replace") if tsx.exists() else None
    if current is not None and not current.startswith(TSX_MARKER):
        raise InstallError(f"{tsx}: exists and was not written by video-dit aitk-install; refusing to "
                           "overwrite it (move it away first)")
    text = render_tsx(entries({name: str(path) for name, path in bases.items()}))
    status = "installed" if current is None else "unchanged" if current == text else "updated"
    if status != "unchanged":
        _write(tsx, text)
    out.append((tsx, status))
    out.append(_patch(options, patched_options))
    out.append(_patch(folder / "SimpleJob.tsx", patched_simple_job))
    return out


def uninstall(aitk_dir: str | Path) -> list[tuple[Path, str]]:
    """Remove what `install`, `install_bases` and `install_ui` wrote (only what is ours); [(path, status)]."""
    from video_dit.integrations.aitk_ui import MARKER as TSX_MARKER

    root = checkout(aitk_dir)
    out = []
    folder = root / "extensions" / EXTENSION_NAME
    if _ours(folder):
        shutil.rmtree(folder)
        out.append((folder, "removed"))
    tsx = root / UI_FOLDER / UI_FILE
    if tsx.exists():
        if not tsx.read_text(encoding="utf-8", errors="replace").startswith(TSX_MARKER):
            raise InstallError(f"{tsx}: was not written by video-dit aitk-install; left in place")
        tsx.unlink()
        out.append((tsx, "removed"))
    for name, unpatch in (("options.tsx", unpatched_options), ("SimpleJob.tsx", unpatched_simple_job)):
        path = root / UI_FOLDER / name
        current = path.read_text(encoding="utf-8") if path.is_file() else ""
        if LINE_TAG in current:
            _write(path, unpatch(current))
            out.append((path, "restored"))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("aitk_dir", metavar="AITK_DIR", help="root of an ai-toolkit checkout (holds run.py)")
    parser.add_argument("--no-ui", action="store_true", help="install the Python extension and the smoke-test bases "
                                                             "only, not the web UI's entries")
    parser.add_argument("--uninstall", action="store_true", help="remove everything this command wrote")


def main(args: argparse.Namespace) -> int:
    try:
        if args.uninstall:
            done = uninstall(args.aitk_dir)
        else:
            if not args.no_ui:
                ui_folder(args.aitk_dir)  # before writing anything
            done = [install(args.aitk_dir)]
            bases = install_bases(args.aitk_dir)
            done += [(folder, status) for folder, status in bases.values()]
            if not args.no_ui:
                done += install_ui(args.aitk_dir, {name: folder for name, (folder, _) in bases.items()})
    except InstallError as exc:
        print(f"video-dit aitk-install: error: {exc}", file=sys.stderr)
        return 1
    for path, status in done:
        print(f"{status}: {path}")
    if not done:
        print("nothing of video-dit aitk-install's was there")
    ui = checkout(args.aitk_dir) / "ui"
    if any(status != "unchanged" and UI_FOLDER.as_posix() in path.as_posix() for path, status in done):
        print(f"The web UI serves what it was built from: rebuild and restart it: {REBUILD.format(ui=ui)}")
    if not args.uninstall:
        print("Jobs: pick a `video_dit ...` model in the UI's video group, or in a job file set `model.arch: "
              "video_dit` and `model.model_kwargs.preset: NAME` with a weights folder as `model.name_or_path`. "
              "ai-toolkit's Python must be able to import video_dit.")
    return 0
