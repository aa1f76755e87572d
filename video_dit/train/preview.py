"""Preview renders during training: each `sample.samples[i]` as t2v, or i2v from its `ctrl_img`, to
`<out>/samples/<step as 9 digits>_<i>.mp4` plus a contact-sheet PNG beside it.

Prompts are encoded once at start-up (`encode_prompts`), so the text encoder can be freed; each
preview's sampling settings are resolved then too (job keys, else the model folder's scheduler config,
else the preset's defaults) and the trainer logs them (`describe`). So are the control images' CLIP
features for a Wan 2.1 I2V / FLF2V model (`encode_preview_images`: ctrl_img, and ctrl_img_2 as the
last frame): CLIP runs once per preview image and the image encoder is freed too.
A two-expert model (`TwoExperts`) samples with both experts, each on its own steps at its own scale.
Under ZeRO-3 the DiT's parameters are partitioned: every rank runs the same sampling loop and
DeepSpeed's module hooks gather each block's parameters just before it runs and release them
after (one block at a time), so all ranks take part and only rank 0 writes files (so under
sequence parallelism). Under ZeRO 0-2 every rank holds the full weights: the previews are shared
out among the ranks, gathered to rank 0, which writes them (`render`). A preview that fails (bad
control image, ...) is logged and training continues.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from video_dit.diffusion.experts import TwoExperts
from video_dit.diffusion.sampling_settings import SamplingSettings, read_scheduler_config, resolve_sampling
from video_dit.families import family_of, scheduler_classes
from video_dit.media import MediaError, contact_sheet, load_image, write_video


@dataclass
class PreviewJob:
    index: int
    prompt: str
    embeds: torch.Tensor            # (Lt, D), or the family's tuple of them (HunyuanVideo 1.5: text, glyph)
    negative: torch.Tensor | None   # the same for the negative prompt, when the guidance scale != 1
    ctrl_img: str | None
    seed: int
    settings: SamplingSettings      # solver, steps, shift, guidance, negative prompt, grid (+ their sources)
    num_frames: int
    width: int
    height: int
    fps: int
    ctrl_img_2: str | None = None        # the last frame (first-last-frame models)
    clip_features: torch.Tensor | None = None  # (1, Li, C) image embeds of ctrl_img [| ctrl_img_2], CPU


# `sample.sampler` names that pick a solver; any other (ai-toolkit's "ddpm", "lms", ...) leaves the default
SOLVER_OF_SAMPLER = {"unipc": "unipc", "euler": "euler", "flowmatch": "euler"}


def sample_settings(sample_cfg, index: int, preset, scheduler=None) -> SamplingSettings:
    """The settings of one preview: `samples[i]`'s keys, else the `sample` block's, else the model
    folder's scheduler config (solver, shift), else the preset's (see diffusion/sampling_settings.py)."""
    item, given = sample_cfg.samples[index], {}
    solver = SOLVER_OF_SAMPLER.get(sample_cfg.sampler)
    if solver is not None:
        given["solver"] = (solver, f"sample.sampler ({sample_cfg.sampler})")
    if sample_cfg.shift is not None:
        given["shift"] = (sample_cfg.shift, "sample.shift")
    for name, key in (("steps", "sample_steps"), ("guidance", "guidance_scale"), ("guidance_2", "guidance_scale_2"),
                      ("negative", "neg")):
        for where, cfg in ((f"sample.samples[{index}].{key}", item), (f"sample.{key}", sample_cfg)):
            value = getattr(cfg, key)
            if value is not None:
                given[name] = (value, where)
                break
    return resolve_sampling(preset, scheduler, given, family=family_of(preset))


def job_scheduler(process):
    """The job's model folder's `read_scheduler_config`, when its previews may take the solver or shift
    from it (None when the job sets both, or has no such folder); ValueError for one we cannot sample."""
    s = process.sample
    if s is None or (s.sampler in SOLVER_OF_SAMPLER and s.shift is not None):
        return None
    return read_scheduler_config(process.model.name_or_path, scheduler_classes())


def encode_prompts(sample_cfg, text_encoder, preset=None, scheduler=None, prompt_images=None) -> list[PreviewJob]:
    """One `PreviewJob` per configured sample, with its embeds on CPU. preset, scheduler: the job's
    `Preset` and its model folder's `read_scheduler_config`, for the settings the job leaves out.
    prompt_images: the family's `Family.prompt_images` (a conditioner that presents the keyframes with the prompt,
    MiniMax H3): a sample's ctrl_img (and ctrl_img_2) encoded with its prompt, as `video-dit sample` does."""
    jobs = []
    if sample_cfg is None:
        return jobs
    for i, s in enumerate(sample_cfg.samples):
        settings = sample_settings(sample_cfg, i, preset, scheduler)
        guided = settings.guided
        prompts = [s.prompt] + ([settings.negative] if guided else [])
        shown = None
        if prompt_images is not None and s.ctrl_img:
            try:
                shown = prompt_images(load_image(s.ctrl_img), load_image(s.ctrl_img_2) if s.ctrl_img_2 else None,
                                      s.height or sample_cfg.height, s.width or sample_cfg.width)
            except MediaError:  # the preview fails at render time with the file named; training goes on
                shown = None
        with torch.no_grad():
            embeds = text_encoder.encode(prompts) if shown is None else text_encoder.encode(
                prompts, images=[shown] * len(prompts))
        seed = s.seed if s.seed is not None else sample_cfg.seed + (i if sample_cfg.walk_seed else 0)
        jobs.append(PreviewJob(
            index=i, prompt=s.prompt, embeds=_cpu_float(embeds[0]),
            negative=_cpu_float(embeds[1]) if guided else None, ctrl_img=s.ctrl_img, seed=seed,
            settings=settings, num_frames=s.num_frames or sample_cfg.num_frames, width=s.width or sample_cfg.width,
            height=s.height or sample_cfg.height, fps=s.fps or sample_cfg.fps, ctrl_img_2=s.ctrl_img_2))
    return jobs


def _cpu_float(embeds):
    """A prompt's embeds (a tensor, or a tuple of them) in float32 on the CPU."""
    if isinstance(embeds, torch.Tensor):
        return embeds.float().cpu()
    return type(embeds)(*(t.float().cpu() for t in embeds))


def _to(embeds, device):
    return embeds.to(device) if isinstance(embeds, torch.Tensor) else type(embeds)(*(t.to(device) for t in embeds))


def describe(jobs: list[PreviewJob]) -> list[str]:
    """The settings lines to log: one per distinct setting, naming the previews that use it."""
    lines: dict[str, list[int]] = {}
    for job in jobs:
        lines.setdefault(job.settings.describe(), []).append(job.index)
    if len(lines) == 1:
        return [f"previews {next(iter(lines))}"]
    return [f"previews {', '.join(map(str, idx))}: {line}" for line, idx in lines.items()]


def encode_preview_images(jobs: list[PreviewJob], image_encoder, embeds_fn, log) -> None:
    """Each job's image embeds (`clip_features`, on CPU) from its control images, when the model has
    an image branch (`image_encoder` not None): `embeds_fn(encoder, first, last, height, width)`, the
    family's (`Family.image_embeds`: Wan's CLIP of the image as given, HunyuanVideo 1.5's SigLIP of it
    fitted to the video). An image that cannot be read leaves them None: that preview then fails at
    render time with the file named, and training goes on."""
    if image_encoder is None:
        return
    for job in jobs:
        if job.ctrl_img is None:
            continue
        try:
            first = load_image(job.ctrl_img)
            last = load_image(job.ctrl_img_2) if job.ctrl_img_2 else None
        except MediaError as exc:
            log(f"preview {job.index}: {exc}; its CLIP features are not computed")
            continue
        job.clip_features = embeds_fn(image_encoder, first, last, job.height, job.width).cpu()


def renderer_of(k: int, world: int, every_rank: bool, share: bool) -> int | None:
    """The rank that renders preview k: None = every rank together (a collective forward); else
    the previews shared out round-robin (k % world) when `share`, or rank 0 alone."""
    if every_rank:
        return None
    return k % world if share else 0


def render(dit, vae, jobs: list[PreviewJob], out_dir: Path, step: int, *, every_rank: bool, i2v_mode: str,
           log, pipeline, share: bool = True, audio_codec=None) -> list[Path]:
    """Render every preview of `step`; returns the MP4 paths written (rank 0).

    `every_rank`: a forward is a collective (ZeRO-3's gathers, sequence-parallel attention), so every
    rank runs each preview together. Otherwise each rank holds the whole model and the previews are
    shared out (`renderer_of`: preview k on rank k % world), so no rank waits for another's renders
    beyond its own share (a rank idle at a barrier for the whole preview would hit the collective
    timeout with a big model and many prompts); the frames are gathered to rank 0, which writes every
    file and logs which rank rendered what. `share` False: rank 0 renders alone (a model only rank 0
    holds). A preview that fails is logged with its rank and training continues. `pipeline(dit, vae,
    i2v_mode=)`: the family's (`Family.pipeline`). `audio_codec`: a model with sound (`Family.audio`): its
    pipeline samples both streams at the preview's frame rate and each MP4 carries its AAC track."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = [j for k, j in enumerate(jobs) if renderer_of(k, world, every_rank, share) in (None, rank)]
    results = _render_jobs(dit, vae, mine, i2v_mode, pipeline, audio_codec) if mine else {}
    if every_rank or world == 1:
        gathered = [results]
    else:  # a collective: every rank sends its share (rank 0 also its own)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object({"rank": rank, "results": results}, gathered, dst=0)
        gathered = gathered if rank == 0 else []
    written = []
    if rank == 0:
        by_rank: dict[int, list[int]] = {}
        for part in gathered:
            who, got = (part["rank"], part["results"]) if "rank" in part else (0, part)
            for index, (frames, error, wave) in sorted(got.items()):
                by_rank.setdefault(who, []).append(index)
                if error is not None:
                    log(f"preview {index} at step {step} failed: {error}(rendered on rank {who})")
                    continue
                job = next(j for j in jobs if j.index == index)
                path = Path(out_dir) / "samples" / f"{step:09d}_{index}.mp4"
                written.append(save_preview(frames, path, job.fps, audio=wave,
                                            audio_rate=audio_codec.out_rate if wave is not None else None))
        if not every_rank and world > 1:
            log(f"step {step}: previews " + "; ".join(f"{', '.join(map(str, idx))} on rank {r}"
                                                     for r, idx in sorted(by_rank.items())))
    dist.barrier()
    return sorted(written)


def save_preview(frames, path: Path, fps: float, audio=None, audio_rate: int | None = None) -> Path:
    """One preview's files: the MP4 at `path` (with an AAC track when `audio`, `(C, S)` in [-1, 1] at
    `audio_rate`, is given: a model with sound) and its contact-sheet PNG beside it (with sound, the
    waveform and spectrogram strip under the frames: `media.contact_sheet`)."""
    write_video(frames, path, fps=fps, audio=audio, audio_rate=audio_rate)
    contact_sheet(frames, audio=audio, audio_rate=audio_rate).save(path.with_suffix(".png"))
    return path


def _render_jobs(dit, vae, jobs: list[PreviewJob], i2v_mode: str, pipeline, audio_codec=None) -> dict:
    """{preview index: (frames, None, wave or None) or (None, the error, None)} of `jobs` rendered on this rank."""
    models = [dit.high, dit.low] if isinstance(dit, TwoExperts) else [dit]  # a two-expert model: both experts
    was_training = [m.training for m in models]
    for m in models:
        m.eval()
    param = next(p for p in dit.parameters())
    pipe = pipeline(dit, vae, i2v_mode=i2v_mode, **({"audio_codec": audio_codec} if audio_codec is not None else {}))
    out = {}
    try:
        for job in jobs:
            try:
                first = load_image(job.ctrl_img) if job.ctrl_img else None
                last = load_image(job.ctrl_img_2) if job.ctrl_img_2 else None
                if first is None and getattr(pipe, "i2v_mode", i2v_mode) == "concat":
                    raise ValueError(f"sample {job.index} has no ctrl_img, but this model is image-to-video")
                gen = torch.Generator("cpu").manual_seed(job.seed)
                st = job.settings
                # a last frame, the low-noise expert's scale: given only when set (pipelines without them take neither)
                optional = {"last_frame": last,
                            "guidance_scale_2": st.guidance_2 if isinstance(dit, TwoExperts) else None,
                            "fps": job.fps if audio_codec is not None else None}  # (sound's positions are seconds)
                run = pipe.generate_with_audio if audio_codec is not None else pipe.generate
                frames = run(_to(job.embeds, param.device), _to(job.negative, param.device)
                                       if job.negative is not None else None,
                                       num_frames=job.num_frames, height=job.height, width=job.width,
                                       steps=st.steps, guidance_scale=st.guidance, shift=st.shift, solver=st.solver,
                                       grid=st.grid, generator=gen, first_frame=first,
                                       image_embeds=None if job.clip_features is None
                                       else job.clip_features.to(param.device),
                                       **{k: v for k, v in optional.items() if v is not None})
                frames, wave = frames if audio_codec is not None else (frames, None)
                out[job.index] = (frames, None, None if wave is None else wave.float().cpu())
            except Exception as exc:  # a preview must never stop a training run: it is reported, training goes on
                out[job.index] = (None, f"{type(exc).__name__}: {exc}\n" + "".join(traceback.format_exception(exc)[-3:]),
                                  None)
    finally:
        for m, mode in zip(models, was_training):
            m.train(mode)
    return out
