"""Preview renders during training: each `sample.samples[i]` as t2v, or i2v from its `ctrl_img`, to
`<out>/samples/<step as 9 digits>_<i>.mp4` plus a contact-sheet PNG beside it.

Prompts are encoded once at start-up (`encode_prompts`), so the text encoder can be freed.
Under ZeRO-3 the DiT's parameters are partitioned: every rank runs the same sampling loop and
DeepSpeed's module hooks gather each block's parameters just before it runs and release them
after (one block at a time), so all ranks take part and only rank 0 writes files. Under ZeRO 0-2
every rank holds the full weights and rank 0 renders alone. A preview that fails (bad control
image, ...) is logged and training continues.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist


@dataclass
class PreviewJob:
    index: int
    prompt: str
    embeds: torch.Tensor            # (Lt, D)
    negative: torch.Tensor | None   # (Lt, D) when guidance_scale != 1
    ctrl_img: str | None
    seed: int
    guidance_scale: float
    steps: int
    num_frames: int
    width: int
    height: int
    fps: int


def encode_prompts(sample_cfg, text_encoder) -> list[PreviewJob]:
    """One `PreviewJob` per configured sample, with its embeds on CPU."""
    jobs = []
    if sample_cfg is None:
        return jobs
    for i, s in enumerate(sample_cfg.samples):
        guidance = s.guidance_scale if s.guidance_scale is not None else sample_cfg.guidance_scale
        neg = s.neg if s.neg is not None else sample_cfg.neg
        with torch.no_grad():
            embeds = text_encoder.encode([s.prompt] + ([neg] if guidance != 1.0 else []))
        seed = s.seed if s.seed is not None else sample_cfg.seed + (i if sample_cfg.walk_seed else 0)
        jobs.append(PreviewJob(
            index=i, prompt=s.prompt, embeds=embeds[0].float().cpu(),
            negative=embeds[1].float().cpu() if guidance != 1.0 else None, ctrl_img=s.ctrl_img, seed=seed,
            guidance_scale=guidance, steps=s.sample_steps or sample_cfg.sample_steps,
            num_frames=s.num_frames or sample_cfg.num_frames, width=s.width or sample_cfg.width,
            height=s.height or sample_cfg.height, fps=s.fps or sample_cfg.fps))
    return jobs


def render(dit, vae, jobs: list[PreviewJob], out_dir: Path, step: int, *, zero_stage: int, shift: float,
           i2v_mode: str, log) -> list[Path]:
    """Render every preview of `step`; returns the MP4 paths written (rank 0)."""
    from video_dit.media import contact_sheet, load_image, write_video
    from video_dit.pipeline import VideoPipeline

    rank = dist.get_rank()
    # ZeRO-3 (partitioned weights) and sequence parallelism (attention is a collective) need every rank
    every_rank = zero_stage == 3 or getattr(dit, "seq_parallel", None) is not None
    written = []
    if rank == 0 or every_rank:
        was_training = dit.training
        dit.eval()
        param = next(p for p in dit.parameters())
        pipe = VideoPipeline(dit, vae, i2v_mode=i2v_mode)
        for job in jobs:
            path = Path(out_dir) / "samples" / f"{step:09d}_{job.index}.mp4"
            try:
                first = load_image(job.ctrl_img) if job.ctrl_img else None
                if first is None and pipe.i2v_mode == "concat":
                    raise ValueError(f"sample {job.index} has no ctrl_img, but this model is image-to-video")
                gen = torch.Generator("cpu").manual_seed(job.seed)
                frames = pipe.generate(job.embeds.to(param.device), job.negative.to(param.device)
                                       if job.negative is not None else None,
                                       num_frames=job.num_frames, height=job.height, width=job.width,
                                       steps=job.steps, guidance_scale=job.guidance_scale, shift=shift,
                                       generator=gen, first_frame=first, solver="euler")
                if rank == 0:
                    write_video(frames, path, fps=job.fps)
                    contact_sheet(frames).save(path.with_suffix(".png"))
                    written.append(path)
            except Exception as exc:  # a preview must never stop a training run: log it and go on
                log(f"preview {job.index} at step {step} failed: {type(exc).__name__}: {exc}\n"
                    + "".join(traceback.format_exception(exc)[-3:]))
        dit.train(was_training)
    dist.barrier()
    return written
