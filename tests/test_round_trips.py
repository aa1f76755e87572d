"""Every file either trainer writes opens everywhere (issue 48): the round-trip matrix, for each family's
tiny presets (Wan t2v, i2v replace, i2v concat + CLIP, A14B two experts; HunyuanVideo 1.5 t2v and i2v;
LTX-2 t2v; MiniMax H3 t2v and first-frame i2v). A cell is in each trainer that trains its job (`Cell.trainers`:
the family's `Family.trains`, less the arch for a first frame its family's conditioner presents with the caption,
`Family.prompt_images`: H3's i2v trains in our trainer alone, the arch refusing it naming ours,
tests/test_aitk_h3.py). A cell's clips follow from its preset: the shortest of at least 9 frames its VAE encodes
(`snap_frames`: Wan's and HunyuanVideo's 4k + 1 and LTX-2's 8k + 1 give 9, H3's 17n + 5 gives 22), at its
`fps` (H3's DiT takes 24 alone), 32 px sides (a multiple of its `divisibility`), with sound for a family whose
DiT generates it (`Family.audio`: consecutive frames, `shrink_video_to_frames: false`).

    writers                                       readers (each cell: the loaded weights equal the saved ones)
    ours    full fine-tune from preset:NAME  ->   video-dit sample --model (another cwd, no model flags)
            LoRA on that export               ->   video-dit sample --lora (its DiT predicts otherwise than the base)
    arch    full fine-tune from preset:NAME  ->   resume in the same trainer (ours: DeepSpeed's checkpoint,
            LoRA on that save, each target         dumped as resumed; the arch: name_or_path / load_weights)
            set ai-toolkit's network offers:  ->   the other trainer (ours: the build the trainer runs,
            default (the blocks' Linears),         `build_dit` + `make_trainable` with name_or_path /
            transformer_only: false (every         network.pretrained_lora_path; the arch: name_or_path,
            Linear), only_if_contains (a           or the LoRA as its network's starting weights)
            subset)                           ->   ComfyUI: every file key names a Linear of the model in
                                                   ComfyUI's layout, and reads back onto the same modules

Our trainer's cells run in ONE 2-rank launch (every preset's full fine-tune, its resume, the LoRA on its
export and that LoRA's resume: four jobs per preset, in order); the arch's in this process, through the
stand-in (tests/aitk_standin: its `LoRASpecialNetwork` picks modules as ai-toolkit 27a03a91 does; a family with
sound gets each clip's track as ai-toolkit's `do_audio` batch). Renders are 1 frame (H3: its shortest, 22) of two
latent cells a side in 2 steps, an i2v cell's with its `--image` (which H3's pipeline presents with the prompt); a
LoRA's render is told from its base's by the DiT's first prediction in it (float32: a tiny H3 2 steps from its
zero-initialised AdaLN gates and heads changes no 8-bit pixel). The cells the CI suite runs are `CI_CELLS`; the
rest are `slow` (measured durations in docs/tests.md)."""

from __future__ import annotations

import argparse
import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path

import aitk_standin
import helpers
import pytest
import ranks
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file

from video_dit.cli import main as cli_main
from video_dit.commands import sample as sample_cmd
from video_dit.data.audio import clip_audio
from video_dit.data.demo import holdout_dir, make_demo_data
from video_dit.data.demo_av import make_demo_av_data
from video_dit.diffusion.experts import EXPERTS, TwoExperts
from video_dit.families import family_of, get_preset
from video_dit.families.contract import Family
from video_dit.lora import check_targets, lora_state_dict, read_lora
from video_dit.models.weights import open_weights
from video_dit.spec import JOB_KEYS, Request, resolve

FRAMES, SIZE = 9, 32  # a cell's clips: the shortest of at least FRAMES frames its VAE encodes, SIZE px sides
TRAINER = {"ours": "video_dit", "arch": "ai-toolkit"}  # the matrix's kinds as `Family.trains` names them


@dataclass(frozen=True)
class Cell:
    """One row of the matrix: a tiny preset trained text-to-video or on the first frame (`do_i2v`); its
    clips, and the trainers that take its job, follow from the preset and its family."""

    preset: str
    do_i2v: bool

    @property
    def family(self) -> Family:
        return family_of(get_preset(self.preset))

    @property
    def trainers(self) -> tuple[str, ...]:
        """The family's trainers (`Family.trains`), less the arch for first-frame training where the family's
        conditioner presents the frame with the caption (`Family.prompt_images`): ai-toolkit encodes and caches
        each caption alone, so the arch refuses that dataset naming our trainer (`refuse_first_frame`)."""
        family = self.family
        if self.do_i2v and family.prompt_images is not None:
            return tuple(t for t in family.trains if t != TRAINER["arch"])
        return family.trains

    @property
    def frames(self) -> int:
        """The shortest clip of at least FRAMES frames the preset's VAE encodes (its frame rule, `snap_frames`)."""
        vae = get_preset(self.preset).vae
        for n in range(FRAMES, 10 * FRAMES):
            try:
                if vae.snap_frames(n) == n:
                    return n
            except ValueError:  # shorter than the VAE's shortest clip (MiniMax H3's 17 n + 5: 22)
                continue
        raise AssertionError(f"{self.preset}: no clip of {FRAMES}-{10 * FRAMES - 1} frames its VAE encodes")

    @property
    def fps(self) -> int:
        return get_preset(self.preset).fps  # (MiniMax H3's DiT takes 24 fps alone)

    @property
    def size(self) -> int:
        """SIZE, or the preset's `divisibility` where that is coarser (every side a multiple of it)."""
        d = get_preset(self.preset).divisibility
        return -(-SIZE // d) * d

    @property
    def sound(self) -> bool:
        return self.family.audio is not None

    def data(self, root: Path) -> Path:
        """The demo clips (two, one held out beside them) of this cell's frames, size, fps and sound under `root`
        (written on first use: cells of the same clips share them)."""
        folder = root / f"data_{self.frames}f_{self.size}px_{self.fps}fps{'_av' if self.sound else ''}"
        if not folder.is_dir():
            make = make_demo_av_data if self.sound else make_demo_data
            make(folder, count=2, frames=self.frames, size=self.size, seed=0, holdout=1, fps=self.fps)
        return folder


CELLS = {"wan-t2v": Cell("tiny", False), "wan-replace": Cell("tiny", True),
         "wan-concat-clip": Cell("tiny-clip-i2v", True), "wan-a14b": Cell("tiny-a14b", False),
         "hy15-t2v": Cell("tiny-hy15-t2v", False), "hy15-i2v": Cell("tiny-hy15-i2v", True),
         "ltx2-t2v": Cell("tiny-ltx2-t2v", False), "h3-t2v": Cell("tiny-h3", False), "h3-i2v": Cell("tiny-h3", True)}
# What the CI suite runs (measured on the shared 2-core machine: our 2-rank launch 8-18 s a job, 4 jobs a cell,
# 74 s for the two-expert cell alone; the arch's cells in-process, ~45 s for the two below): the arch's cells of
# issue 48's dead ends (its two-expert full fine-tune through `video-dit sample`, its HunyuanVideo LoRA with
# modulation adapters, both through the spec and saved layout our trainer's exports use too); every other cell,
# our trainer's included, is `slow` (./launch/test.sh -m slow tests/test_round_trips.py)
CI_CELLS = {"ours": (), "arch": ("wan-a14b", "hy15-i2v")}
# ai-toolkit's network options (NetworkConfig.transformer_only, network_kwargs.only_if_contains) per target set;
# the subset's words pick each family's MLP Linears (whole modules: HunyuanVideo's fused q / k / v need all three)
TARGET_SETS = {"default": {}, "all": {"transformer_only": False},
               "subset": {"only_if_contains": ["ffn", "mlp", ".ff."]}}
RENDER = ["--prompt", "a red square moving right", "--frames", "1", "--steps", "2", "--cfg", "1", "--seed", "3"]


def _render(cell: str, root: Path, out: Path) -> list[str]:
    """The render flags of a cell (sizes only: no flag names a model file): 1 frame of two latent cells a
    side (32 px; LTX-2's 32x VAE: 64), 2 steps; an i2v cell's first frame (a held-out one of its data)."""
    c = CELLS[cell]
    side = str(2 * get_preset(c.preset).divisibility)
    image = ["--image", str(holdout_dir(c.data(root)) / "000.png")] if c.do_i2v else []
    return [*RENDER, "--height", side, "--width", side, *image, "--out", str(out)]


def _cells(kind: str):
    """pytest params of the matrix: the cells whose job the trainer of `kind` ("ours", "arch") takes
    (`Cell.trainers`), its CI cells plain, the others `slow`."""
    why = ("the round-trip matrix's other cells (our 2-rank launch costs 8-18 s a job, 4 jobs a cell, on the CI "
           "machine): the CI suite runs CI_CELLS, issue 48's dead ends through the arch")
    return [pytest.param(c, id=c, marks=() if c in CI_CELLS[kind] else pytest.mark.slow(reason=why))
            for c, cell in CELLS.items() if TRAINER[kind] in cell.trainers]


def _family(cell: str) -> Family:
    return CELLS[cell].family


def _aitk_cell(cell: str) -> bool:
    return TRAINER["arch"] in CELLS[cell].trainers


# ---------------------------------------------------------------- the world: data, our trainer's launch

def _dataset(root: Path, cell: str) -> dict:
    c = CELLS[cell]
    d = {"folder_path": str(c.data(root)), "num_frames": c.frames, "fps": c.fps, "resolution": [c.size],
         "do_i2v": c.do_i2v, "caption_ext": "txt"}
    if c.sound:  # a model with sound: consecutive frames (ltx-trainer's cut)
        d["shrink_video_to_frames"] = False
    return d


def _our_job(root: Path, cell: str, *, lora: bool, steps: int, base: str | None = None) -> Path:
    preset = CELLS[cell].preset
    name = f"{'lora' if lora else 'ft'}_{cell}"
    process = helpers.train_process(root, lora=lora, steps=steps, save_every=2, keep=4, lr=1e-2,
                                    frames=CELLS[cell].frames, size=CELLS[cell].size,
                                    model={"name_or_path": base or f"preset:{preset}", "preset": preset},
                                    datasets=[_dataset(root, cell)], train={"warmup_steps": 0})
    if not lora:
        process.pop("network", None)
    path = root / f"{name}_{steps}.yaml"  # a resume: the same job name, its own file
    path.write_text(yaml.safe_dump({"job": "extension", "config": {"name": name, "process": [process]}}))
    return path


def _export(root: Path, name: str) -> Path:
    return root / "out" / name / name


def _step_export(root: Path, name: str, step: int) -> Path:
    return root / "out" / name / f"{name}_{step:09d}"


def _selected(request, fixture: str) -> list[str]:
    """The cells of this module's selected tests that use `fixture` (a launch runs only what is asked)."""
    return sorted({it.callspec.params["cell"] for it in request.session.items
                   if it.module is request.module and fixture in it.fixturenames and hasattr(it, "callspec")})


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Where every job of this file writes; each cell's data under it (`Cell.data`, written on first use)."""
    return tmp_path_factory.mktemp("round_trips")


@pytest.fixture(scope="module")
def world(root, request):
    """Our trainer's jobs of the cells this run selects, in one 2-rank launch: per cell a full fine-tune
    (2 steps), its resume to step 3 (the state as resumed dumped), a LoRA on its step-2 export (2 steps),
    that LoRA's resume to step 3 (dumped)."""
    cells = _selected(request, "world")
    jobs = []
    for cell in cells:
        jobs += [{"config": str(_our_job(root, cell, lora=False, steps=2)), "resume": "none"}]
        jobs += [{"config": str(_our_job(root, cell, lora=False, steps=3)), "resume": "auto", "dump": "params"}]
        base = str(_step_export(root, f"ft_{cell}", 2))
        jobs += [{"config": str(_our_job(root, cell, lora=True, steps=2, base=base)), "resume": "none"}]
        jobs += [{"config": str(_our_job(root, cell, lora=True, steps=3, base=base)), "resume": "auto", "dump": "params"}]
    _, _, seconds = ranks.run_jobs(root, jobs, timeout=1200)
    print(f"round trips: our trainer's launch {seconds:.1f} s, {len(jobs)} jobs ({', '.join(cells)})")
    return root


# ---------------------------------------------------------------- the ai-toolkit arch through the stand-in

@pytest.fixture(scope="module")
def aitk():
    yield aitk_standin.activate()
    aitk_standin.deactivate()


def _arch(aitk, name_or_path: str, preset: str):
    from toolkit.config_modules import ModelConfig

    cfg = ModelConfig(name_or_path=name_or_path, arch="video_dit", dtype="fp32", model_kwargs={"preset": preset})
    model = aitk.VideoDiTModel(device="cpu", model_config=cfg, dtype="fp32",
                               noise_scheduler=aitk.VideoDiTModel.get_train_scheduler())
    model.load_model()
    return model


def _batch(root: Path, cell: str, seed: int):
    """ai-toolkit's batch of one demo clip of the cell: (1, T, 3, H, W) pixels in [-1, 1] (its loader's layout);
    a family with sound: the clip's track as a `do_audio` dataset's `audio_data` (its frames' span, the clip's own
    rate: the arch resamples it to its codec's)."""
    from toolkit.data_transfer_object.data_loader import DataLoaderBatchDTO

    from video_dit.media import read_video

    c = CELLS[cell]
    clip = sorted(c.data(root).glob("*.mp4"))[seed % 2]
    frames = read_video(clip)[:c.frames]  # (T, 3, H, W) in [-1, 1]
    tensor = F.interpolate(frames.float(), size=(c.size, c.size), mode="bilinear").clamp(-1, 1)[None]
    audio = None
    if c.sound:
        wave, rate = clip_audio(clip)  # (C, S) float32 over the clip's frames
        audio = [{"waveform": torch.from_numpy(wave).float(), "sample_rate": rate}]
    return DataLoaderBatchDTO(tensor=tensor, num_frames=c.frames, fps=c.fps, do_i2v=c.do_i2v, do_audio=c.sound,
                              audio_data=audio)


def _arch_steps(sd, params, root: Path, cell: str, steps: int = 2, lr: float = 1e-2) -> None:
    """`steps` of SDTrainer's step on `params` (Adam): latents, embeds, ai-toolkit's noise, predict_noise with
    the batch, the flow target, scale_loss, backward. Two experts: t alternates between their sides."""
    opt = torch.optim.Adam(params, lr=lr)
    g = torch.Generator().manual_seed(0)
    for s in range(steps):
        batch = _batch(root, cell, s)
        batch.latents = sd.encode_images(batch.tensor)
        embeds = sd.get_prompt_embeds(["a red square moving right"])
        t = torch.tensor([950.0 if s % 2 == 0 else 300.0])
        noise = torch.randn(batch.latents.shape, generator=g)
        noisy = sd.add_noise(batch.latents, noise, t)
        pred = sd.predict_noise(noisy, text_embeddings=embeds, timestep=t, batch=batch)
        target = sd.get_loss_target(noise=noise, batch=batch, timesteps=t)
        loss = sd.scale_loss(F.mse_loss(pred.float(), target.float(), reduction="none")).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def _network(sd, **options):
    from toolkit.lora_special import LoRASpecialNetwork

    net = LoRASpecialNetwork(sd.get_model_to_train(), lora_dim=4, alpha=4, base_model=sd,
                             target_lin_modules=sd.target_lora_modules, is_transformer=sd.is_transformer, **options)
    sd.network = net  # BaseSDTrainProcess: before apply_to (the arch's checks run here)
    net.apply_to()
    return net


@pytest.fixture(scope="module")
def arch(aitk, root, request):
    """{cell: {"ft": saved folder, "ft_state": {expert or None: state}, <target set>: LoRA file}} for every
    arch cell: a full fine-tune from preset:NAME (2 steps) saved as ai-toolkit saves it, and on that save a
    LoRA of each target set (2 steps)."""
    out = {}
    for cell in _selected(request, "arch"):
        preset = CELLS[cell].preset
        sd = _arch(aitk, f"preset:{preset}", preset)
        model = sd.get_model_to_train()
        model.requires_grad_(True)
        _arch_steps(sd, [p for p in model.parameters()], root, cell)
        folder = root / "arch" / cell / f"ft_{cell}_000000002.safetensors"  # ai-toolkit's name for the folder
        sd.save_model(str(folder), {"name": f"ft_{cell}", "training_info": json.dumps({"step": 2})}, torch.float32)
        dits = {e: sd.model.expert(e) for e in EXPERTS} if isinstance(sd.model, TwoExperts) else {None: sd.model}
        out[cell] = {"ft": folder, "ft_state": {e: copy.deepcopy(d.state_dict()) for e, d in dits.items()}}
        for name, options in TARGET_SETS.items():
            lsd = _arch(aitk, str(folder), preset)
            net = _network(lsd, **options)
            _arch_steps(lsd, net.prepare_optimizer_params(), root, cell)
            path = root / "arch" / cell / f"lora_{cell}_{name}.safetensors"
            net.save_weights(str(path), metadata={"name": path.stem})
            out[cell][name] = path
            out[cell][f"{name}_network"] = {k: v.clone() for k, v in net.state_dict().items() if ".lora_" in k}
    return out


# ---------------------------------------------------------------- what a reader loaded

def _saved_dits(folder: Path) -> dict:
    """{expert or None: {native name: tensor}} of a saved model folder, read from its files."""
    subs = {e: folder / s for e, s in (("high_noise", "high_noise_model"), ("low_noise", "low_noise_model"))}
    if all(p.is_dir() for p in subs.values()):
        return {e: open_weights(p).read_all() for e, p in subs.items()}
    return {None: open_weights(folder).read_all()}


def _sampled(args: list[str], cwd: Path, monkeypatch) -> tuple:
    """What `video-dit sample ARGS` loads (its own `spec_of_args` + `load_models`, in `cwd`): the DiTs
    ({expert or None: module}), and the first prediction (float32) of the DiT the command itself renders
    with (exit code 0 and its file asserted): a LoRA's change is compared there, not in the file's 8-bit
    frames, which a tiny MiniMax H3 2 steps from its preset (zero-initialised AdaLN gates and heads) leaves
    unchanged."""
    monkeypatch.chdir(cwd)
    parser = argparse.ArgumentParser()
    sample_cmd.add_arguments(parser)
    ns = parser.parse_args(args)
    spec = sample_cmd.spec_of_args(ns)
    dit = sample_cmd.load_models(spec, ns, torch.float32, torch.device("cpu"))
    dits = {e: dit.expert(e) for e in EXPERTS} if isinstance(dit, TwoExperts) else {None: dit}
    predictions, load = [], sample_cmd.load_models

    def record(module, inputs, output):
        video = output[0] if isinstance(output, tuple) else output  # (B, C, F', h, w) (a model with sound: + audio)
        predictions.append(video.detach().float().clone())

    def load_recording(*a, **kw):
        model = load(*a, **kw)
        for m in ([model.expert(e) for e in EXPERTS] if isinstance(model, TwoExperts) else [model]):
            m.register_forward_hook(record)
        return model

    monkeypatch.setattr(sample_cmd, "load_models", load_recording)
    assert cli_main(["sample", *args]) == 0
    assert predictions and Path(ns.out).stat().st_size > 0
    return dits, predictions[0]


def _assert_same(loaded: dict, saved: dict, what: str) -> None:
    """Every tensor of `saved` in `loaded` (the base weights of `loaded`: adapters left out), bit-equal."""
    plain = {k: v for k, v in loaded.items() if ".lora_" not in k}
    plain = {k.replace(".base_layer.", "."): v for k, v in plain.items()}
    assert set(plain) == set(saved), f"{what}: {sorted(set(plain) ^ set(saved))[:6]}"
    bad = [k for k in saved if not torch.equal(plain[k].float(), saved[k].float())]
    assert not bad, f"{what}: differ at {bad[:6]}"


def _adapters(model) -> dict:
    """{module: (A, B scaled by alpha / rank)} of a model with peft adapters: the update it applies."""
    out, scale = {}, model._lora_alpha / model._lora_rank
    for key, value in lora_state_dict(model).items():
        module, kind = key.rsplit(".", 2)[0], key.rsplit(".", 2)[1]
        out.setdefault(module, {})[kind] = value.float() * (scale if kind == "lora_B" else 1.0)
    return {m: (v["lora_A"], v["lora_B"]) for m, v in out.items()}


def _file_update(path: Path, family: Family) -> dict:
    """{module: (A, B alpha / rank)} of a LoRA file, read with the family's key map."""
    native, alpha, rank, _ = read_lora(path, family.lora_from_file)
    out = {}
    for key, value in native.items():
        module, kind = key.rsplit(".", 2)[0], key.rsplit(".", 2)[1]
        out.setdefault(module, {})[kind] = value.float() * (alpha / rank if kind == "lora_B" else 1.0)
    return {m: (v["lora_A"], v["lora_B"]) for m, v in out.items()}


def _assert_update(loaded: dict, saved: dict, what: str) -> None:
    assert set(loaded) == set(saved), f"{what}: modules {sorted(set(loaded) ^ set(saved))[:6]}"
    for m, (a, b) in saved.items():
        assert torch.equal(loaded[m][0], a), f"{what}: {m} lora_A"
        torch.testing.assert_close(loaded[m][1], b, rtol=1e-6, atol=0, msg=f"{what}: {m} lora_B")


def _comfy_complete(path: Path, model, family: Family) -> None:
    """Every key of the LoRA file names a Linear of the model in ComfyUI's layout (our native names, with
    HunyuanVideo 1.5's double-block q / k / v as ComfyUI's fused `<stream>_attn_qkv`: comfy/lora.py's
    "diffusion-pipe lora format"), and the file reads back onto the same modules (`check_targets`)."""
    linears = {n.removesuffix(".base_layer") for n, m in model.named_modules()  # (peft wraps an adapted Linear)
               if isinstance(m, torch.nn.Linear) and ".lora_" not in n}
    comfy = {re.sub(r"(double_blocks\.\d+\.(img|txt))_attn_[qkv]$", r"\1_attn_qkv", n) for n in linears}
    keys = load_file(str(path))
    modules = {re.sub(r"\.(lora_A\.weight|lora_B\.weight|alpha)$", "", k) for k in keys}
    assert all(k.startswith("diffusion_model.") for k in keys), sorted(keys)[:3]
    missing = sorted(m for m in modules if m[len("diffusion_model."):] not in comfy)
    assert not missing, f"{path.name}: keys ComfyUI's model lacks: {missing[:6]}"
    native, _, _, _ = read_lora(path, family.lora_from_file)
    check_targets({k.rsplit(".", 2)[0] for k in native}, family.lora_to_comfy, family.lora_from_file, path.name)


def _lora_args(path: Path) -> list[str]:
    """--lora (and --lora-2 for a two-expert pair's low-noise file)."""
    if path.name.endswith("_high_noise.safetensors"):
        return ["--lora", str(path), "--lora-2", str(path).replace("_high_noise.", "_low_noise.")]
    return ["--lora", str(path)]


def _pair(path: Path, two: bool) -> Path:
    """A LoRA as a reader is given it: a two-expert model's high-noise file of the pair (both trainers split)."""
    return path.with_name(path.name.replace(".safetensors", "_high_noise.safetensors")) if two else path


# ---------------------------------------------------------------- the matrix

@pytest.mark.multirank
@pytest.mark.parametrize("cell", _cells("ours"))
def test_our_full_fine_tune_round_trips(cell, world, aitk, tmp_path, monkeypatch):
    """Our trainer's full fine-tune: `video-dit sample --model <training_folder>/<name>/<name>` from another
    directory loads exactly the export's weights (two experts: both); our resume restores them; the arch
    (`name_or_path` the export) loads them."""
    preset = CELLS[cell].preset
    name = f"ft_{cell}"
    saved = _saved_dits(_step_export(world, name, 2))
    # resume in our trainer: the parameters as restored from the step-2 checkpoint are the step-2 export's
    state = load_file(str(world / "out" / name / "state_start_2.safetensors"))
    for expert, weights in saved.items():
        pre = f"{expert}/param/" if expert else "param/"
        _assert_same({k[len(pre):]: v for k, v in state.items() if k.startswith(pre)}, weights, f"{cell} resume")
    # video-dit sample from another directory, no flag naming a model file
    dits, _ = _sampled(["--model", str(_export(world, name)), *_render(cell, world, tmp_path / "ft.mp4")], tmp_path,
                       monkeypatch)
    final = _saved_dits(_export(world, name).resolve())
    for expert, weights in final.items():
        _assert_same(dits[expert].state_dict(), weights, f"{cell} sample --model")
        assert dits[expert].config == get_preset(preset).dit, f"{cell}: config.json read back as another DiT"
    # the other trainer: the arch with name_or_path the export
    if _aitk_cell(cell):
        sd = _arch(aitk, str(_export(world, name)), preset)
        loaded = {e: sd.model.expert(e) for e in EXPERTS} if isinstance(sd.model, TwoExperts) else {None: sd.model}
        for expert, weights in final.items():
            _assert_same(loaded[expert].state_dict(), weights, f"{cell} arch name_or_path")


@pytest.mark.multirank
@pytest.mark.parametrize("cell", _cells("ours"))
def test_our_lora_round_trips(cell, world, aitk, tmp_path, monkeypatch):
    """Our trainer's LoRA on its export: `video-dit sample --lora` loads exactly the file's update and its render's
    DiT predicts otherwise than the base's; our resume restores it; the arch loads it as its network's starting
    weights (the same update); its ComfyUI keys are complete."""
    preset = CELLS[cell].preset
    family, two = _family(cell), get_preset(preset).two_experts
    name = f"lora_{cell}"
    step2 = world / "out" / name / f"{name}_{2:09d}.safetensors"
    files = {e: step2.with_name(step2.name.replace(".safetensors", f"_{e}.safetensors")) for e in EXPERTS} \
        if two else {None: step2}
    state = load_file(str(world / "out" / name / "state_start_2.safetensors"))
    for expert, path in files.items():  # resume: the adapters as restored are the step-2 file's
        pre = f"{expert}/param/" if expert else "param/"
        restored = {k[len(pre):].replace(".default.weight", ".weight"): v for k, v in state.items()
                    if k.startswith(pre) and ".lora_" in k}
        native, alpha, rank, _ = read_lora(path, family.lora_from_file)
        assert set(restored) == set(native) and all(torch.equal(restored[k], native[k]) for k in native), cell
    base = _step_export(world, f"ft_{cell}", 2)
    latest = world / "out" / name / f"{name}.safetensors"
    lora = _pair(latest, two)
    dits, with_lora = _sampled(["--model", str(base), *_lora_args(lora), *_render(cell, world, tmp_path / "l.mp4")],
                               tmp_path, monkeypatch)
    _, without = _sampled(["--model", str(base), *_render(cell, world, tmp_path / "b.mp4")], tmp_path, monkeypatch)
    for expert, dit in dits.items():
        path = _pair(latest, False) if expert is None else latest.with_name(f"{name}_{expert}.safetensors")
        _assert_update(_adapters(dit), _file_update(path, family), f"{cell} sample --lora")
        _comfy_complete(path, dit, family)
    assert (with_lora[0] - without[0]).abs().max() > 0, f"{cell}: the LoRA changed nothing"
    if _aitk_cell(cell):  # the arch: our file as its network's starting weights (ai-toolkit's load_weights)
        sd = _arch(aitk, str(base), preset)
        net = _network(sd)
        assert net.load_weights(str(lora)) is None  # nothing set aside
        got = {k: v for k, v in net.state_dict().items() if ".lora_" in k}
        for expert, path in files.items():
            upd = _file_update(latest if expert is None else latest.with_name(f"{name}_{expert}.safetensors"), family)
            pre = "transformer$$" + ("" if expert is None else ("high" if expert == "high_noise" else "low") + "$$")
            for m, (a, b) in upd.items():
                key = pre + m.replace(".", "$$")
                assert torch.equal(got[f"{key}.lora_down.weight"], a), (cell, m)
                torch.testing.assert_close(got[f"{key}.lora_up.weight"], b, rtol=1e-6, atol=0)


@pytest.mark.parametrize("cell", _cells("arch"))
def test_arch_full_fine_tune_round_trips(cell, arch, aitk, root, tmp_path, monkeypatch):
    """The arch's full fine-tune (`<name>_<step>.safetensors/`, two experts in high_noise_model/ +
    low_noise_model/): `video-dit sample --model` from another directory loads exactly its weights (the
    paths it recorded are absolute); the arch resumes from it; our trainer's build loads it."""
    from video_dit.train.build import build_dit

    preset = CELLS[cell].preset
    folder, state = arch[cell]["ft"], arch[cell]["ft_state"]
    recorded = json.loads((folder / "video_dit_sources.json").read_text())
    assert all(Path(v).is_absolute() for k, v in recorded.items() if k in ("vae", "text_encoder", "image_encoder")
               and not str(v).startswith("preset:"))
    dits, _ = _sampled(["--model", str(folder), *_render(cell, root, tmp_path / "a.mp4")], tmp_path, monkeypatch)
    for expert, weights in state.items():
        _assert_same(dits[expert].state_dict(), weights, f"{cell} sample --model (arch)")
        assert dits[expert].config == get_preset(preset).dit, f"{cell}: config.json read back as another DiT"
    again = _arch(aitk, str(folder), preset)  # ai-toolkit's resume: name_or_path = the latest save
    loaded = {e: again.model.expert(e) for e in EXPERTS} if isinstance(again.model, TwoExperts) else {None: again.model}
    for expert, weights in state.items():
        _assert_same(loaded[expert].state_dict(), weights, f"{cell} arch resume")
    spec = resolve(Request(str(folder), preset=preset), JOB_KEYS)  # our trainer: the spec and build it runs
    for expert, weights in state.items():
        source = spec.dit if expert is None else spec.experts.sources[expert][0]
        dit = build_dit(source, spec.preset, dtype=torch.float32, device="cpu")
        _assert_same(dit.state_dict(), weights, f"{cell} our trainer name_or_path")


@pytest.mark.parametrize("target_set", list(TARGET_SETS))
@pytest.mark.parametrize("cell", _cells("arch"))
def test_arch_lora_round_trips(cell, target_set, arch, aitk, root, tmp_path, monkeypatch):
    """The arch's LoRA of each target set ai-toolkit's network offers: `video-dit sample --lora` loads exactly
    its update (adapters on the modules it holds) and its render's DiT predicts otherwise than the base's; the
    arch resumes it (load_weights: the network's weights as saved); our trainer starts from it
    (`network.pretrained_lora_path`: the file's modules beside the family's, the same update); its ComfyUI
    keys are complete."""
    from video_dit.train.build import build_dit, make_trainable
    from video_dit.train.config import parse_job

    preset = CELLS[cell].preset
    family, two = _family(cell), get_preset(preset).two_experts
    folder, path = arch[cell]["ft"], arch[cell][target_set]
    lora = _pair(path, two)
    files = {e: path.with_name(path.name.replace(".safetensors", f"_{e}.safetensors")) for e in EXPERTS} \
        if two else {None: path}
    dits, with_lora = _sampled(["--model", str(folder), *_lora_args(lora), *_render(cell, root, tmp_path / "l.mp4")],
                               tmp_path, monkeypatch)
    _, without = _sampled(["--model", str(folder), *_render(cell, root, tmp_path / "b.mp4")], tmp_path, monkeypatch)
    for expert, dit in dits.items():
        _assert_update(_adapters(dit), _file_update(files[expert], family), f"{cell}/{target_set} sample --lora")
        _comfy_complete(files[expert], dit, family)
    assert (with_lora[0] - without[0]).abs().max() > 0, f"{cell}: the LoRA changed nothing"
    # the arch resumes it: ai-toolkit's load_weights of the latest save into a new network of the same options
    sd = _arch(aitk, str(folder), preset)
    net = _network(sd, **TARGET_SETS[target_set])
    assert net.load_weights(str(lora)) is None
    saved = arch[cell][f"{target_set}_network"]
    got = {k: v for k, v in net.state_dict().items() if ".lora_" in k}
    assert set(got) == set(saved) and all(torch.allclose(got[k], saved[k], rtol=1e-6, atol=0) for k in saved)
    # our trainer starts from it (network.pretrained_lora_path): the build the trainer runs per DiT
    spec = resolve(Request(str(folder), preset=preset), JOB_KEYS)
    for expert, file in files.items():
        job = helpers.train_process(root, model={"name_or_path": str(folder), "preset": preset},
                                    datasets=[_dataset(root, cell)],
                                    network={"type": "lora", "linear": 4, "linear_alpha": 8,
                                             "pretrained_lora_path": str(lora)})
        p = parse_job({"job": "extension", "config": {"name": "start", "process": [job]}}).process
        source = spec.dit if expert is None else spec.experts.sources[expert][0]
        dit = make_trainable(build_dit(source, spec.preset, dtype=torch.float32, device="cpu"), p, torch.float32,
                             family=family, expert=expert)
        ours = _adapters(dit)
        want = _file_update(file, family)
        _assert_update({m: ours[m] for m in want}, want, f"{cell}/{target_set} pretrained_lora_path")
        default = {n for n, m in dit.named_modules() if isinstance(m, torch.nn.Linear)
                   and re.fullmatch(family.lora_targets(False), n)}
        assert default <= set(ours), "the family's own targets are trained too"
