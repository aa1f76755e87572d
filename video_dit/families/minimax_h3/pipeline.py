"""Embeds in, PIL frames and a stereo waveform out: MiniMax H3's `t2va` and `fl2va` (a first keyframe, a last
one, or both), one request per prompt, as diffusers' modular pipeline (`MiniMaxH3Blocks`) samples them.

    prompt embeds (Lt, D) + tags (Lt,): `H3TextEncoder.encode`, the fl2va keyframes in the presentation
    keyframes (fl2va) -> onto the canvas (`fit_keyframes`: the first stretched, a follower cover-cropped)
      -> uint8 -> VAE posterior sampled under seed 42, float16-rounded, normalized (`condition_latents`)
    draws from the request's generator, in order: per keyframe its noise (1, C, 1, h, w), mixed as
      0.999 z + 0.001 noise and held there; the video noise (1, C, F', h, w); the audio noise as rows (S T, Z)
    two schedules of the same length (`h3_schedule`: shift 12 video, 3 audio), each step i one DiT call:
      video rows at the video's t_i, text rows too, audio rows at the audio's t_i, keyframe rows at
      min(t_i, 1) on 0..1000 (MiniMax's max(t, 0.999)) -> (v_video, v_audio), noise - x0
      per stream: x0 = x - (1 - t_H3) v (t_H3 = 1 - sigma, float32: MiniMax's time); r = sigma' / sigma;
      x <- r x + (1 - r) x0 (MiniMaxH3Scheduler.step, float32)
    video VAE decode (B, 3, F, H, W) -> PIL frames; audio VAE decode -> wave (2, 800 T') at 32 kHz

The checkpoint is guidance-distilled: no negative prompt, no unconditional pass (a guidance scale other than 1 is
refused). The pipeline never sees text. With the same weights, embeds, seed and settings it samples what diffusers'
`MiniMaxH3Blocks` sample (tests/test_h3_pipeline.py). Where this pipeline differs from diffusers':
  - `steps` counts model evaluations (the house's `SamplingSchedule`); diffusers' `num_inference_steps` counts
    the sigma grid's points, the terminal 0 among them: steps = num_inference_steps - 1;
  - no canvas is derived from a keyframe's aspect ratio or the 16:9 default (height and width are the caller's,
    multiples of 32 released, as diffusers asks);
  - the duration window (5 to 15 s) is not enforced: it is the release's product range, not the model's
    arithmetic (the tiny model samples 22 frames);
  - several prompts are several requests, one after another from the one generator (diffusers takes one).
`ref2va` (the Ref2VA checkpoint's references) is not sampled here.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from PIL import Image
from torch import nn
from tqdm.auto import tqdm

from video_dit.diffusion.flow import NUM_TRAIN_TIMESTEPS, SamplingSchedule, check_schedule, shift_sigmas
from video_dit.diffusion.pipeline_parts import config_of, decode_videos
from video_dit.diffusion.sampler import module_dtype_device
from video_dit.families.minimax_h3.encoders import VIDEO_TAG, H3PromptEmbeds
from video_dit.families.minimax_h3.packing import ANCHORS
from video_dit.families.minimax_h3.presets import AUDIO_SHIFT, KEYFRAME_NOISE, NUM_FRAMES, SAMPLE_STEPS, VIDEO_SHIFT
from video_dit.families.minimax_h3.vae_config import FPS

GRIDS = ("reference",)


# ---------------------------------------------------------------- the schedule


def h3_schedule(steps: int, shift: float = VIDEO_SHIFT, solver: str = "euler", grid: str = "reference"
                ) -> SamplingSchedule:
    """MiniMax H3's sigmas (diffusers `MiniMaxH3Scheduler.set_timesteps(steps + 1)`, float32 torch): linspace(1,
    0, steps + 1) through the shift s' = k s / (1 + (k - 1) s), consecutive duplicates collapsed (so a huge
    shift may give fewer steps); timesteps sigmas[:-1] x 1000. Euler only; one grid (the model's own)."""
    check_schedule(steps, shift, solver, solvers=("euler",))
    if grid not in GRIDS:
        raise ValueError(f"schedule grid {grid!r}: accepted for MiniMax H3: {', '.join(GRIDS)}")
    sigmas = torch.unique_consecutive(shift_sigmas(torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float32), shift))
    return SamplingSchedule(solver, sigmas, sigmas[:-1] * NUM_TRAIN_TIMESTEPS)


# ---------------------------------------------------------------- the keyframes


def fit_keyframes(first: Image.Image | None, last: Image.Image | None, height: int, width: int
                  ) -> tuple[list[Image.Image], tuple[str, ...]]:
    """(keyframes on the height x width canvas, their anchors) in packed order, first then last (diffusers
    `MiniMaxH3ResizeStep`): the leading one stretched (PIL Lanczos to the size), a follower resized with
    Lanczos to cover the canvas (sides rounded) and centre-cropped ((resized - canvas) // 2); one already of
    the canvas size is kept. What the conditioner presents and the VAE encodes alike."""
    frames, anchors = [], []
    for anchor, image in zip(ANCHORS, (first, last)):
        if image is None:
            continue
        if not isinstance(image, Image.Image):
            raise TypeError(f"the {anchor} keyframe must be a PIL image, got {type(image).__name__}")
        image = image.convert("RGB")
        if image.size != (width, height):
            if not frames:
                image = image.resize((width, height), Image.Resampling.LANCZOS)
            else:
                scale = max(width / image.size[0], height / image.size[1])
                size = (max(width, round(image.size[0] * scale)), max(height, round(image.size[1] * scale)))
                left, top = (size[0] - width) // 2, (size[1] - height) // 2
                image = image.resize(size, Image.Resampling.LANCZOS).crop((left, top, left + width, top + height))
        frames.append(image)
        anchors.append(anchor)
    return frames, tuple(anchors)


# ---------------------------------------------------------------- the pipeline


class H3Pipeline:
    """Sample videos with sound from an `H3DiT`, an `H3VideoVAE` and an `H3AudioCodec`.

    dit: the DiT, or any module called as `dit(x, timestep, text, audio=, audio_timestep=, text_tags=, keyframes=,
    keyframe_anchors=, keyframe_timestep=, fps=)` (a DeepSpeed engine: its config read from `.module.config`;
    else pass dit_config). audio_shift: the audio schedule's (3 released)."""

    def __init__(self, dit: nn.Module, vae: nn.Module, audio_codec, *, dit_config=None,
                 audio_shift: float = AUDIO_SHIFT):
        if audio_codec is None:
            raise ValueError("MiniMax H3 generates sound with the picture: its pipeline needs the audio codec (its "
                             "audio VAE: `Family.audio.load_codec`); pass audio_codec=")
        self.dit, self.vae, self.audio_codec, self.audio_shift = dit, vae, audio_codec, audio_shift
        self.dit_config = dit_config if dit_config is not None else config_of(dit, "dit")
        self.vae_config = config_of(vae, "vae")
        cfg, z = self.dit_config, self.vae_config.z_dim
        if cfg.in_channels != z:
            raise ValueError(f"the DiT reads {cfg.in_channels} video latent channels; the VAE has {z}")
        a = audio_codec.vae.config
        if (a.latent_channels, a.channels) != (cfg.audio_in_channels, cfg.audio_channels):
            raise ValueError(f"the DiT reads {cfg.audio_channels} x {cfg.audio_in_channels} audio latent channels; "
                             f"the audio VAE makes {a.channels} x {a.latent_channels}")
        self.spatial = self.vae_config.spatial_compression
        self.divisibility = self.spatial * cfg.patch_size[1]

    def snap(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """`num_frames` up to the next 17 n + 5 with a warning (diffusers' `align_num_frames`); height and width
        must be multiples of the canvas multiple (32 released), as diffusers' layout step asks (not snapped: the
        keyframes the conditioner presented were fitted to this canvas)."""
        d = self.divisibility
        if min(num_frames, height, width) < 1:
            raise ValueError(f"num_frames, height and width must be >= 1, got {num_frames}, {height}, {width}")
        if height % d or width % d:
            raise ValueError(f"height x width {height} x {width}: MiniMax H3 samples sides that are multiples of {d} "
                             f"(its VAE's {self.spatial} x its patch); nearest: {max(d, height // d * d)} x "
                             f"{max(d, width // d * d)}")
        frames = self.vae_config.snap_frames(num_frames, up=True)
        if frames != num_frames:
            warnings.warn(f"num_frames {num_frames} -> {frames}: MiniMax H3 clips have 17 n + 5 frames (rounded up, as "
                          "diffusers' pipeline does)", stacklevel=3)
        return frames, height, width

    @torch.no_grad()
    def generate_latents(self, prompt_embeds, negative_embeds=None, num_frames: int = NUM_FRAMES, height: int = 768,
                         width: int = 1344, steps: int = SAMPLE_STEPS, guidance_scale: float = 1.0,
                         shift: float = VIDEO_SHIFT, generator: torch.Generator | None = None, first_frame=None,
                         last_frame=None, latents: torch.Tensor | None = None,
                         audio_latents: torch.Tensor | None = None, solver: str = "euler", grid: str = "reference",
                         fps: float = FPS, progress: bool = False, image_embeds=None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """(video latents (B, C, F', h, w), audio latents (B, S, Z, T')), normalized, float32; arguments as for
        `generate`."""
        if image_embeds is not None:
            raise ValueError("image_embeds: MiniMax H3 reads no image encoder (its keyframes go through the VAE and "
                             "the conditioner's presentation)")
        if negative_embeds is not None or guidance_scale != 1.0:
            given = f"guidance scale {guidance_scale:g}" + (", negative embeds" if negative_embeds is not None else "")
            raise ValueError(f"{given}: MiniMax H3 is guidance-distilled (one forward per step, no negative prompt); "
                             "use a guidance scale of 1 and no negative")
        if abs(fps - FPS) > 1e-3:
            raise ValueError(f"fps={fps:g}: MiniMax H3 generates at {FPS} fps only")
        prompts = _as_prompts(prompt_embeds)
        B = len(prompts)
        num_frames, height, width = self.snap(num_frames, height, width)
        keyframes, anchors = fit_keyframes(_one(first_frame, "first_frame"), _one(last_frame, "last_frame"), height,
                                           width)
        for i, p in enumerate(prompts):
            blocks = _vision_blocks(p.tags)
            if blocks != len(keyframes):
                raise ValueError(f"prompt_embeds[{i}] presents {blocks} image(s) (vision blocks in its tags) for "
                                 f"{len(keyframes)} keyframe(s): encode each prompt with its keyframes on the canvas "
                                 "(`H3TextEncoder.encode(prompts, images=[fit_keyframes(first, last, height, "
                                 "width)[0]])`), as the reference presents them")
        vcfg = self.vae_config
        shape = (1, vcfg.z_dim, vcfg.latent_frames(num_frames), height // self.spatial, width // self.spatial)
        audio_shape = (1, *self.audio_codec.latent_shape(num_frames, fps))
        for name, given, want in (("latents", latents, shape), ("audio_latents", audio_latents, audio_shape)):
            if given is not None and tuple(given.shape) != (B, *want[1:]):
                raise ValueError(f"{name} have shape {tuple(given.shape)}; expected {(B, *want[1:])}")
        video_schedule = h3_schedule(steps, shift, solver, grid)
        audio_schedule = h3_schedule(steps, self.audio_shift, solver, grid)
        cond = self._condition_latents(keyframes)  # (1, C, K, h, w) clean, normalized; None: t2va
        outs = []
        for b, prompt in enumerate(prompts):
            outs.append(self._request(prompt, cond, anchors, shape, audio_shape, video_schedule, audio_schedule,
                                      generator, None if latents is None else latents[b:b + 1],
                                      None if audio_latents is None else audio_latents[b:b + 1], fps, progress))
        return torch.cat([v for v, _ in outs]), torch.cat([a for _, a in outs])

    def _condition_latents(self, keyframes: list[Image.Image]) -> torch.Tensor | None:
        """The keyframes' clean conditioning latents (1, C, K, h, w) float32 on the CPU (diffusers
        `encode_vae_condition`: uint8 pixels, the posterior sampled under seed 42, float16-rounded, normalized)."""
        if not keyframes:
            return None
        vae_dtype, vae_device = module_dtype_device(self.vae)
        out = []
        for image in keyframes:
            pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1.0
            out.append(self.vae.condition_latents(pixels.to(device=vae_device, dtype=vae_dtype)).float().cpu())
        return torch.cat(out, dim=2)

    def _request(self, prompt: H3PromptEmbeds, cond, anchors, shape, audio_shape, video_schedule, audio_schedule,
                 generator, latents, audio_latents, fps, progress) -> tuple[torch.Tensor, torch.Tensor]:
        """One request (one prompt): its draws, its loop; (video latents (1, C, F', h, w), audio (1, S, Z, T'))."""
        dtype, device = module_dtype_device(self.dit)
        gen_device = generator.device if generator is not None else "cpu"
        # 1. the draws, in the reference's order: each keyframe's noise, the video noise, the audio noise as rows
        keyframes = None
        if cond is not None:
            hold = torch.tensor(KEYFRAME_NOISE, dtype=torch.float32)
            noised = []
            for k in range(cond.shape[2]):
                z = cond[:, :, k:k + 1]
                noise = torch.randn(z.shape, generator=generator, device=gen_device, dtype=torch.float32).cpu()
                noised.append(hold * z + (1.0 - hold) * noise)  # MiniMaxH3Scheduler.scale_noise(z, 0.999, noise)
            keyframes = torch.cat(noised, dim=2).to(device)
        x = latents.to(device, torch.float32) if latents is not None else torch.randn(
            shape, generator=generator, device=gen_device, dtype=torch.float32).to(device)
        S, Z, T = audio_shape[1:]
        if audio_latents is not None:
            ax = audio_latents.to(device, torch.float32)
        else:  # drawn as the DiT's rows, channel-major (S T, Z) -> (1, S, Z, T)
            rows = torch.randn((S * T, Z), generator=generator, device=gen_device, dtype=torch.float32)
            ax = rows.view(S, T, Z).transpose(1, 2)[None].contiguous().to(device)
        text = prompt.embeds[None].to(device=device, dtype=dtype)  # (1, Lt, D)
        tags = prompt.tags.to(device)
        # 2. the loop: one forward per step, both streams stepped on their own sigma grid
        sv, sa = video_schedule.sigmas.to(device), audio_schedule.sigmas.to(device)
        n = min(video_schedule.steps, audio_schedule.steps)  # diffusers zips the two schedules
        steps = tqdm(range(n), desc="sampling", unit="step") if progress else range(n)
        for i in steps:
            t_video, t_audio = 1.0 - sv[i], 1.0 - sa[i]  # MiniMax's time, float32 (the scheduler's timesteps)
            kw = {}
            if keyframes is not None:  # held at max(t, 0.999) in MiniMax's time
                hold_t = max(float(t_video), KEYFRAME_NOISE)
                kw = dict(keyframes=keyframes.to(dtype), keyframe_anchors=anchors,
                          keyframe_timestep=torch.tensor([(1.0 - hold_t) * NUM_TRAIN_TIMESTEPS], device=device))
            v, a = self.dit(x.to(dtype), (sv[i] * NUM_TRAIN_TIMESTEPS).view(1), text, audio=ax.to(dtype),
                            audio_timestep=(sa[i] * NUM_TRAIN_TIMESTEPS).view(1), text_tags=tags, fps=fps, **kw)
            x = _euler(x, v, t_video, sv[i], sv[i + 1])
            ax = _euler(ax, a, t_audio, sa[i], sa[i + 1])
        return x, ax

    def decode(self, latents: torch.Tensor) -> list[list[Image.Image]]:
        """Normalized video latents (B, C, F', h, w) -> B lists of F PIL frames."""
        return decode_videos(self.vae, latents)

    @torch.no_grad()
    def decode_audio(self, audio_latents: torch.Tensor) -> list[torch.Tensor]:
        """Normalized audio latents (B, S, Z, T') -> B waveforms (S, 800 T') float32 at `audio_codec.out_rate`."""
        _, device = module_dtype_device(self.audio_codec)
        return list(self.audio_codec.decode(audio_latents.to(device)).cpu().unbind(0))

    def generate(self, prompt_embeds, negative_embeds=None, num_frames: int = NUM_FRAMES, height: int = 768,
                 width: int = 1344, steps: int = SAMPLE_STEPS, guidance_scale: float = 1.0,
                 shift: float = VIDEO_SHIFT, generator: torch.Generator | None = None, first_frame=None,
                 last_frame=None, latents: torch.Tensor | None = None, audio_latents: torch.Tensor | None = None,
                 solver: str = "euler", grid: str = "reference", fps: float = FPS, progress: bool = False,
                 image_embeds=None):
        """Render videos as PIL frames (the sound is sampled with them and not decoded: `generate_with_audio`).

        prompt_embeds: one `H3PromptEmbeds` (embeds (Lt, D), tags (Lt,)) -> list[PIL.Image] (F frames), or a list of
        B of them -> B such lists, each its own request (its draws follow the previous one's from `generator`).
        For fl2va each prompt is encoded with its keyframes (`fit_keyframes`), as the reference presents them.
        negative_embeds: none (guidance-distilled); guidance_scale: 1 only. num_frames: up to 17 n + 5; height,
        width: multiples of 32 released (the VAE's 16 x the patch's 2). steps, shift: the video's
        schedule (`h3_schedule`; the audio's: `audio_shift`); solver "euler"; grid "reference". fps: 24 only.
        first_frame, last_frame: PIL keyframes (either, or both: fl2va). generator: the request's draws;
        latents (B, C, F', h, w), audio_latents (B, S, Z, T'): initial noise instead. progress: a tqdm bar."""
        video, _ = self.generate_latents(prompt_embeds, negative_embeds, num_frames, height, width, steps,
                                         guidance_scale, shift, generator, first_frame, last_frame, latents,
                                         audio_latents, solver, grid, fps, progress, image_embeds)
        frames = self.decode(video)
        return frames if isinstance(prompt_embeds, list) else frames[0]

    def generate_with_audio(self, prompt_embeds, negative_embeds=None, num_frames: int = NUM_FRAMES, height: int = 768,
                            width: int = 1344, steps: int = SAMPLE_STEPS, guidance_scale: float = 1.0,
                            shift: float = VIDEO_SHIFT, generator: torch.Generator | None = None, first_frame=None,
                            last_frame=None, latents: torch.Tensor | None = None,
                            audio_latents: torch.Tensor | None = None, solver: str = "euler",
                            grid: str = "reference", fps: float = FPS, progress: bool = False, image_embeds=None):
        """As `generate`, with the sound: (frames, wave (S, samples) float32 at `audio_codec.out_rate`), or for a
        list of prompts a list of such pairs."""
        video, audio = self.generate_latents(prompt_embeds, negative_embeds, num_frames, height, width, steps,
                                             guidance_scale, shift, generator, first_frame, last_frame, latents,
                                             audio_latents, solver, grid, fps, progress, image_embeds)
        pairs = list(zip(self.decode(video), self.decode_audio(audio)))
        return pairs if isinstance(prompt_embeds, list) else pairs[0]


# ---------------------------------------------------------------- steps of the loop


def _euler(x: torch.Tensor, v: torch.Tensor, t: torch.Tensor, sigma: torch.Tensor, sigma_next: torch.Tensor
           ) -> torch.Tensor:
    """One `MiniMaxH3Scheduler.step` (eta 0) in float32 on the house velocity v = noise - x0 (MiniMax's is -v):
    x0 = x - (1 - t) v with t MiniMax's time (its sigma recovered from the timestep, as the reference keeps it),
    then x r + x0 (1 - r), r = sigma' / sigma from the grid."""
    x0 = x - (1 - t) * v.float()
    r = sigma_next / sigma
    return r * x + (1.0 - r) * x0


def _vision_blocks(tags: torch.Tensor) -> int:
    """How many runs of vision-block rows (VIDEO_TAG) a prompt's tags hold: the images it presents."""
    vision = (tags == VIDEO_TAG).long()
    return int((vision[1:] > vision[:-1]).sum()) + int(vision[:1].sum()) if vision.numel() else 0


def _one(image, name: str):
    """A keyframe: one PIL image (the same for every prompt of a call) or None."""
    if isinstance(image, (list, tuple)):
        if len(image) != 1:
            raise ValueError(f"{name}: one keyframe for every prompt of a call (got {len(image)}); sample the prompts "
                             "with their own keyframes in separate calls")
        image = image[0]
    return image


def _as_prompts(embeds) -> list[H3PromptEmbeds]:
    """One or a list of `H3PromptEmbeds` (embeds (Lt, D), tags (Lt,)) -> a list of them."""
    items = embeds if isinstance(embeds, list) else [embeds]
    if not items:
        raise ValueError("prompt_embeds is empty")
    out = []
    for i, e in enumerate(items):
        if not (isinstance(e, tuple) and len(e) == 2 and all(isinstance(t, torch.Tensor) for t in e)
                and e[0].ndim == 2 and e[1].shape == e[0].shape[:1]):
            raise ValueError(f"prompt_embeds[{i}] must be an H3PromptEmbeds (embeds (Lt, D), tags (Lt,)), got "
                             f"{type(e).__name__}")
        out.append(H3PromptEmbeds(*e))
    return out
