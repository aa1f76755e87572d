"""Embeds in, PIL frames and a waveform out: LTX-2 text-to-video and image-to-video with its audio stream.

    prompt embeds [(video (Lt, Dv), audio (Lt, Da))] (`LTX2PromptEncoder.encode`); negatives the same
    noise: video (B, 128, F', h, w), then audio (B, 8, T', 16), T' from the clip's seconds (`latent_shape`)
    first frame (i2v) -> re-compressed (H.264 CRF) -> resized to cover, centre-cropped -> VAE -> latent frame 0
    Euler over the schedule (`ltx2_schedule`), each step:
      [frame 0 := the first frame's latent, its tokens at t = 0]   (FirstFrameConditioning "replace")
      passes: conditional, unconditional (negative text), perturbed (STG blocks' self-attention skipped),
              isolated (no audio<->video attention), each -> both velocities -> denoised x0 = x - sigma v
      per stream: x0 = cond + (cfg - 1)(cond - uncond) + stg (cond - ptb) + (mod - 1)(cond - iso), rescaled
      v = (x - x0) / sigma;  x += (sigma' - sigma) v
    VAE decode (B, 3, F, H, W) -> PIL frames;  audio VAE + vocoder -> wave (B, 2, S) at the vocoder's rate

The pipeline never sees text. With the same weights, embeds, noise and settings it samples what diffusers'
`LTX2Pipeline` / `LTX2ImageToVideoPipeline` sample (tests/test_ltx2_pipeline.py), where they follow
Lightricks. Lightricks' own code (ltx-pipelines `TI2VidOneStagePipeline`, ltx-core's guiders, X0 model and
Euler step, mirror commit 400fd31) is followed where the two differ:
  - the schedule (grid "reference"): ltx-core `LTX2Scheduler` at its default 4096 tokens whatever the size;
    diffusers shifts by the video token count (grid "diffusers-dynamic", what a diffusers folder's
    dynamic-shifting scheduler config asks for: `sampling_settings`); the two agree at 4096 tokens;
  - image-to-video: the denoised latent of a conditioning token is the clean latent (ltx-core `X0Model`: x -
    sigma v with the token's own sigma, 0), so the guidance rescale's statistics see it; diffusers converts
    every token with the step's sigma. They agree with rescale 0 (frame 0 is replaced after every step in both);
  - the audio->video attention's scale / shift of conditioning tokens from their own timestep 0 (the DiT's, see
    dit.py); diffusers' pipelines (use_cross_timestep) take the audio's sigma;
  - the first frame is resized to cover and centre-cropped (ltx-pipelines `resize_and_center_crop`, bilinear);
    diffusers resizes to the size without cropping: for an image of the video's size both leave it as it is;
  - the keyframe embedding (LTX-2.5) marks the first latent frame's tokens (ltx-core `VideoLatentTools`);
    diffusers' pipelines mark none;
  - STG perturbs a stream's self-attention only when that stream's STG scale is non-zero (ltx-pipelines'
    `_guided_denoise`); diffusers perturbs both streams in a perturbable model (all LTX-2.3 / 2.5 conversions);
  - the guidance rescale's statistics per sample (diffusers'); ltx-core's over the whole batch: the same at
    batch 1, its pipelines' only batch.
"""

from __future__ import annotations

import io
import math

import numpy as np
import torch
import torch.nn.functional as F_
from PIL import Image
from torch import nn
from tqdm.auto import tqdm

from video_dit.data.frames import snap_size
from video_dit.diffusion.conditioning import FirstFrameConditioning
from video_dit.diffusion.flow import DYNAMIC_GRID, NUM_TRAIN_TIMESTEPS, SamplingSchedule, check_schedule
from video_dit.diffusion.pipeline_parts import config_of, decode_videos
from video_dit.diffusion.sampler import module_dtype_device
from video_dit.families.ltx2.codec import LTX2AudioCodec
from video_dit.families.ltx2.presets import (BASE_SHIFT, BASE_TOKENS, LTX2_SHIFT, MAX_TOKENS, TERMINAL, LTX2Guidance,
                                             guidance_for)
from video_dit.families.ltx2.text_encoder import LTX2PromptEmbeds

GRIDS = ("reference", DYNAMIC_GRID)


# ---------------------------------------------------------------- the schedule


def ltx2_schedule(steps: int, shift: float = LTX2_SHIFT, solver: str = "euler", grid: str = "reference",
                  tokens: int | None = None) -> SamplingSchedule:
    """LTX-2's sigmas: linspace(1, 0, steps + 1), its non-zero ones shifted as SD3's shift(s) = e^mu s /
    (e^mu s + 1 - s), then stretched so the last non-zero one is `TERMINAL` (0.1): s' = 1 - (1 - s) (1 - 0.1)
    / (1 - s_last); timesteps = sigmas[:-1] x 1000. `shift` = e^mu at 4096 tokens (e^2.05 released).
      grid "reference": ltx-core `LTX2Scheduler.execute(steps)` (float32 torch), mu = ln(shift) whatever the
          size (its default 4096 tokens, as every ltx-pipelines call makes it);
      grid "diffusers-dynamic" (`flow.DYNAMIC_GRID`): diffusers' `FlowMatchEulerDiscreteScheduler(
          use_dynamic_shifting, shift_terminal=0.1)`
          as `LTX2Pipeline` sets it (numpy float32 over linspace(1, 1/steps, steps)), mu on the line through
          (1024 tokens, 0.95) and (4096, ln(shift)) at `tokens`, the video tokens (required).
    Euler only (ltx-core's `EulerDiffusionStep`, the scheduler diffusers' folders name)."""
    check_schedule(steps, shift, solver, solvers=("euler",))
    if grid not in GRIDS:
        raise ValueError(f"schedule grid {grid!r}: accepted for LTX-2: {', '.join(GRIDS)}")
    if grid == "reference":
        s = torch.linspace(1.0, 0.0, steps + 1)  # float32, as ltx-core
        e = math.exp(math.log(shift))
        s = torch.where(s != 0, e / (e + (1 / s - 1)), 0.0)
        one_minus = 1.0 - s[:-1]
        s[:-1] = 1.0 - one_minus / (one_minus[-1] / (1.0 - TERMINAL))
        return SamplingSchedule(solver, s, s[:-1] * NUM_TRAIN_TIMESTEPS)
    if tokens is None or tokens < 1:
        raise ValueError(f"grid {DYNAMIC_GRID!r} shifts by the video token count; got tokens={tokens}")
    slope = (math.log(shift) - BASE_SHIFT) / (MAX_TOKENS - BASE_TOKENS)  # diffusers `calculate_shift`
    mu = tokens * slope + (BASE_SHIFT - slope * BASE_TOKENS)
    s = np.linspace(1.0, 1.0 / steps, steps).astype(np.float32)
    s = math.exp(mu) / (math.exp(mu) + (1 / s - 1))  # numpy float32 (the Python floats are weak scalars)
    one_minus = 1 - s
    s = 1 - one_minus / (one_minus[-1] / (1 - TERMINAL))
    sigmas = torch.from_numpy(np.asarray(s, dtype=np.float32))
    return SamplingSchedule(solver, torch.cat([sigmas, sigmas.new_zeros(1)]), sigmas * NUM_TRAIN_TIMESTEPS)


# ---------------------------------------------------------------- the conditioning image


def recompress(image: Image.Image, crf: int) -> Image.Image:
    """The image through one H.264 frame at `crf` (libx264 "veryfast", yuv420p, sides cut to even), decoded
    back: ltx-pipelines `preprocess` / `encode_single_frame` (the compression the model was trained on; 0:
    unchanged, as a side under 2 pixels)."""
    import av

    rgb = np.asarray(image.convert("RGB"))
    if crf == 0 or min(rgb.shape[:2]) < 2:
        return image.convert("RGB")
    h, w = rgb.shape[0] // 2 * 2, rgb.shape[1] // 2 * 2
    buffer = io.BytesIO()
    container = av.open(buffer, "w", format="mp4")
    try:
        stream = container.add_stream("libx264", rate=1, options={"crf": str(crf), "preset": "veryfast"})
        stream.height, stream.width = h, w
        frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(rgb[:h, :w]), format="rgb24").reformat(format="yuv420p")
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    finally:
        container.close()
    container = av.open(io.BytesIO(buffer.getvalue()))
    try:
        decoded = next(container.decode(video=0)).to_ndarray(format="rgb24")
    finally:
        container.close()
    return Image.fromarray(decoded)


def fit_first_frame(image, height: int, width: int, crf: int) -> torch.Tensor:
    """A PIL image (re-compressed at `crf`) or a (3, H0, W0) tensor in [-1, 1] (as given) -> (3, height,
    width) float32 in [-1, 1]: resized with bilinear interpolation to cover height x width (sides rounded up),
    then centre-cropped (ltx-pipelines `resize_and_center_crop`, `normalize_images`)."""
    if isinstance(image, Image.Image):
        x = torch.from_numpy(np.array(recompress(image, crf))).permute(2, 0, 1).float()  # (3, H0, W0) 0..255
        x = x / 127.5 - 1.0
    elif isinstance(image, torch.Tensor) and image.ndim == 3 and image.shape[0] == 3:
        x = image.float()
    else:
        raise ValueError(f"first_frame must be a PIL image or a (3, H, W) tensor in [-1, 1], got "
                         f"{tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__}")
    h0, w0 = x.shape[1:]
    scale = max(height / h0, width / w0)
    h1, w1 = math.ceil(h0 * scale), math.ceil(w0 * scale)
    if (h1, w1) != (h0, w0):
        x = F_.interpolate(x[None], size=(h1, w1), mode="bilinear", align_corners=False)[0]
    top, left = (h1 - height) // 2, (w1 - width) // 2
    return x[:, top:top + height, left:left + width]


# ---------------------------------------------------------------- the pipeline


class LTX2Pipeline:
    """Sample videos with sound from an `LTX2DiT`, an `LTX2VideoVAE` and an `LTX2AudioCodec`.

    dit: the DiT, or any module called as `dit(x, t, video_context, audio=, audio_timestep=, audio_context=,
    video_context_mask=, audio_context_mask=, fps=, keyframes_mask=, video_stg_blocks=, audio_stg_blocks=,
    isolate_modalities=)` (a DeepSpeed engine: its config read from `.module.config`; else pass dit_config).
    guidance: the reference's guidance beyond the video's CFG scale (`presets.LTX2Guidance`); None: the
    variant's (`presets.guidance_for`)."""

    def __init__(self, dit: nn.Module, vae: nn.Module, audio_codec: LTX2AudioCodec, *,
                 guidance: LTX2Guidance | None = None, dit_config=None):
        if audio_codec is None:
            raise ValueError("LTX-2 generates sound with the picture: its pipeline needs the audio codec (audio VAE + "
                             "vocoder: `Family.audio.load_codec`); pass audio_codec=")
        self.dit, self.vae, self.audio_codec = dit, vae, audio_codec
        self.dit_config = dit_config if dit_config is not None else config_of(dit, "dit")
        self.vae_config = config_of(vae, "vae")
        cfg, z = self.dit_config, self.vae_config.z_dim
        if cfg.in_channels != z or cfg.out_channels != z:
            raise ValueError(f"the DiT reads {cfg.in_channels} and writes {cfg.out_channels} latent channels; the VAE "
                             f"has {z}")
        a = audio_codec.vae.config
        if a.token_dim != cfg.audio_in_channels:
            raise ValueError(f"the DiT reads audio tokens of {cfg.audio_in_channels}; the audio VAE makes "
                             f"{a.z_channels} x {a.latent_mel_bins} = {a.token_dim}")
        self.guidance = guidance if guidance is not None else guidance_for(cfg)
        self.temporal, self.spatial = self.vae_config.temporal_compression, self.vae_config.spatial_compression
        self.divisibility = self.spatial * cfg.patch_size[1]
        self.conditioning = FirstFrameConditioning("replace", patch_size=cfg.patch_size)

    def snap(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """`num_frames` down to 8k + 1, height / width down to multiples of 32 (x the DiT's patch), with a
        warning when anything changed."""
        return snap_size(num_frames, height, width, self.temporal, self.divisibility, stacklevel=2)

    @torch.no_grad()
    def generate_latents(self, prompt_embeds, negative_embeds=None, num_frames: int = 121, height: int = 512,
                         width: int = 768, steps: int = 30, guidance_scale: float = 3.0, shift: float = LTX2_SHIFT,
                         generator: torch.Generator | None = None, first_frame=None,
                         latents: torch.Tensor | None = None, audio_latents: torch.Tensor | None = None,
                         solver: str = "euler", grid: str = "reference", fps: float = 24.0, progress: bool = False,
                         image_embeds=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(video latents (B, C, F', h, w), audio latents (B, z, T', M')), normalized, float32; arguments as
        for `generate`."""
        if image_embeds is not None:
            raise ValueError("image_embeds: LTX-2 reads no image encoder (the first frame goes through the VAE)")
        prompts = _as_prompts(prompt_embeds, "prompt_embeds")
        B, g = len(prompts), self.guidance
        negatives = None
        if negative_embeds is not None:
            negatives = _as_prompts(negative_embeds, "negative_embeds")
            negatives = negatives * B if len(negatives) == 1 and B > 1 else negatives
            if len(negatives) != B:
                raise ValueError(f"{len(negatives)} negative embeds for {B} prompts (give 1 or {B})")
        elif guidance_scale != 1.0:
            raise ValueError(f"guidance scale {guidance_scale} needs negative embeds (encode '' or a negative prompt); "
                             "use a guidance scale of 1 for none (the audio's CFG is then off too: no negative pass)")
        cfg_scales = (guidance_scale, g.audio_cfg) if negatives is not None else (1.0, 1.0)
        if fps <= 0:
            raise ValueError(f"fps must be > 0, got {fps}")
        num_frames, height, width = self.snap(num_frames, height, width)
        dtype, device = module_dtype_device(self.dit)
        cfg = self.dit_config
        pt, ph, pw = cfg.patch_size
        shape = (B, self.vae_config.z_dim, (num_frames - 1) // self.temporal + 1, height // self.spatial,
                 width // self.spatial)
        L = shape[2] // pt * (shape[3] // ph) * (shape[4] // pw)
        schedule = ltx2_schedule(steps, shift, solver, grid, tokens=L)
        audio_shape = (B, *self.audio_codec.latent_shape(num_frames, fps))

        # 1. initial noise, video then audio from one generator (diffusers' order), float32; or as given
        x = _initial(latents, shape, generator, device, "latents")
        ax = _initial(audio_latents, audio_shape, generator, device, "audio_latents")
        # 2. the first frame's latent (i2v), computed once; frame 0 is put back before every step
        cond = None
        if first_frame is not None:
            pixels = torch.stack([fit_first_frame(im, height, width, g.image_crf)
                                  for im in _first_frames(first_frame, B)])  # (B, 3, H, W)
            vae_dtype, vae_device = module_dtype_device(self.vae)
            z0 = self.vae.encode(pixels[:, :, None].to(device=vae_device, dtype=vae_dtype)).mode()  # (B, C, 1, h, w)
            cond = {"first_frame_latents": self.vae.normalize(z0).float().to(device)}
        # 3. the text, [negatives | prompts] when guided (diffusers' order), and what every pass shares
        contexts = _contexts(prompts, device, dtype)
        both_contexts = _contexts(negatives + prompts, device, dtype) if cfg_scales != (1.0, 1.0) else None
        keyframes = None
        if cfg.use_keyframes_abs_pos_embedding:  # ltx-core marks the first latent frame's tokens
            keyframes = (torch.arange(L, device=device) < L // (shape[2] // pt)).float().expand(B, L)
        stg = tuple(b for b in g.stg_blocks if b < cfg.num_layers) if g.stg else ()
        audio_stg = tuple(b for b in g.audio_stg_blocks if b < cfg.num_layers) if g.audio_stg else ()
        isolate = g.modality != 1.0 or g.audio_modality != 1.0
        sigmas = schedule.sigmas.to(device)
        steps_ = tqdm(range(schedule.steps), desc="sampling", unit="step") if progress else range(schedule.steps)
        for i in steps_:
            # 4. this step's input: frame 0 replaced and its tokens at t = 0 (i2v), the audio at t
            t = schedule.timesteps[i].to(device=device, dtype=torch.float32).expand(B)  # (B,)
            x_in, t_video = self.conditioning.apply(x, t, cond)[:2] if cond is not None else (x, t)
            s, s_next = sigmas[i], sigmas[i + 1]
            s_video = torch.where(t_video > 0, s, 0.0) if t_video.dim() == 2 else s.expand(B)  # (B, L) or (B,)
            common = dict(fps=fps, keyframes_mask=keyframes)

            def run(ctx, n=1, **kw):
                """Both streams' denoised x0 (float32) of one pass over n copies of the batch."""
                v, a = self.dit(torch.cat([x_in] * n).to(dtype), torch.cat([t_video] * n), ctx[0],
                                audio=torch.cat([ax] * n).to(dtype), audio_timestep=torch.cat([t] * n),
                                audio_context=ctx[1], video_context_mask=ctx[2], audio_context_mask=ctx[3],
                                **common, **kw)
                return (_denoised(torch.cat([x_in] * n), v, torch.cat([s_video] * n), cfg.patch_size),
                        _denoised(torch.cat([ax] * n), a, s.expand(n * B), ()))

            # 5. the passes (ltx-pipelines `_guided_denoise`): conditional and unconditional in one batch
            if both_contexts is not None:
                both = run(both_contexts, n=2)
                (v_unc, v_cond), (a_unc, a_cond) = both[0].chunk(2), both[1].chunk(2)
            else:
                (v_cond, a_cond), v_unc, a_unc = run(contexts), None, None
            ptb = run(contexts, video_stg_blocks=stg, audio_stg_blocks=audio_stg) if stg or audio_stg else (None, None)
            iso = run(contexts, isolate_modalities=True) if isolate else (None, None)
            # 6. guidance on the denoised latents, per stream, then the Euler step in float32
            x0 = _guide(v_cond, v_unc, ptb[0], iso[0], cfg_scales[0], g.stg if stg else 0.0, g.modality, g.rescale)
            a0 = _guide(a_cond, a_unc, ptb[1], iso[1], cfg_scales[1], g.audio_stg if audio_stg else 0.0,
                        g.audio_modality, g.audio_rescale)
            x = x_in + (s_next - s) * (x_in - x0) / s
            ax = ax + (s_next - s) * (ax - a0) / s
        if cond is not None:
            x = self.conditioning.restore(x, cond)
        return x, ax

    def decode(self, latents: torch.Tensor) -> list[list[Image.Image]]:
        """Normalized video latents (B, C, F', h, w) -> B lists of F PIL frames."""
        return decode_videos(self.vae, latents)

    @torch.no_grad()
    def decode_audio(self, audio_latents: torch.Tensor) -> list[torch.Tensor]:
        """Normalized audio latents (B, z, T', M') -> B waveforms (C, S) float32 at `audio_codec.out_rate`."""
        codec = self.audio_codec
        _, device = module_dtype_device(codec)
        return list(codec.decode(audio_latents.to(device)).cpu().unbind(0))

    def generate(self, prompt_embeds, negative_embeds=None, num_frames: int = 121, height: int = 512, width: int = 768,
                 steps: int = 30, guidance_scale: float = 3.0, shift: float = LTX2_SHIFT,
                 generator: torch.Generator | None = None, first_frame=None, latents: torch.Tensor | None = None,
                 audio_latents: torch.Tensor | None = None, solver: str = "euler", grid: str = "reference",
                 fps: float = 24.0, progress: bool = False, image_embeds=None):
        """Render videos as PIL frames (the sound is sampled with them and not decoded: `generate_with_audio`).

        prompt_embeds: one `LTX2PromptEmbeds` (video (Lt, Dv), audio (Lt, Da)) -> list[PIL.Image] (F frames);
        or a list of B of them -> B such lists. negative_embeds: one for all prompts or B; required unless
        guidance_scale is 1 (then no unconditional pass runs, for either stream).
        num_frames (snapped to 8k + 1), height, width (snapped to multiples of 32). steps, shift, grid: the
        Euler schedule (`ltx2_schedule`; solver accepts "euler" only). guidance_scale: the video's CFG scale;
        the audio's and the STG / modality / rescale terms are `self.guidance`'s. fps: the frame rate the
        positions and the sound's length use. generator: seeds the noise (video, then audio); latents,
        audio_latents: initial noise instead. first_frame: a PIL image (or a list of B), or a (3, H, W) /
        (B, 3, H, W) tensor in [-1, 1] (not re-compressed): image-to-video. progress: a tqdm bar.
        """
        video, _ = self.generate_latents(prompt_embeds, negative_embeds, num_frames, height, width, steps,
                                         guidance_scale, shift, generator, first_frame, latents, audio_latents, solver,
                                         grid, fps, progress, image_embeds)
        frames = self.decode(video)
        return frames if isinstance(prompt_embeds, list) else frames[0]

    def generate_with_audio(self, prompt_embeds, negative_embeds=None, num_frames: int = 121, height: int = 512,
                            width: int = 768, steps: int = 30, guidance_scale: float = 3.0, shift: float = LTX2_SHIFT,
                            generator: torch.Generator | None = None, first_frame=None,
                            latents: torch.Tensor | None = None, audio_latents: torch.Tensor | None = None,
                            solver: str = "euler", grid: str = "reference", fps: float = 24.0, progress: bool = False,
                            image_embeds=None):
        """As `generate`, with the sound: (frames, wave (C, S) float32 at `audio_codec.out_rate`), or for a list
        of prompts a list of such pairs."""
        video, audio = self.generate_latents(prompt_embeds, negative_embeds, num_frames, height, width, steps,
                                             guidance_scale, shift, generator, first_frame, latents, audio_latents,
                                             solver, grid, fps, progress, image_embeds)
        pairs = list(zip(self.decode(video), self.decode_audio(audio)))
        return pairs if isinstance(prompt_embeds, list) else pairs[0]


# ---------------------------------------------------------------- steps of the loop


def _sigma(sigma: torch.Tensor, like: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """Noise levels (B,) or per video token (B, L) -> broadcastable over `like` (B, C, ...): (B, 1, ..., 1), or
    (B, 1, F', h, w) with each token's value over its patch's cells (the DiT's token order)."""
    if sigma.dim() == 1:
        return sigma.view(-1, *([1] * (like.dim() - 1)))
    B, _, Fl, h, w = like.shape
    pt, ph, pw = patch
    grid = sigma.view(B, 1, Fl // pt, h // ph, w // pw)
    return grid.repeat_interleave(pt, 2).repeat_interleave(ph, 3).repeat_interleave(pw, 4)  # (B, 1, F', h, w)


def _denoised(x: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor, patch) -> torch.Tensor:
    """x0 = x - sigma v in float32, sigma (B,) or per token (B, L) (ltx-core `to_denoised` with the per-token
    timesteps: a conditioning token's x0 is its clean latent)."""
    return x.float() - _sigma(sigma, x, patch) * v.float()


def _guide(cond, uncond, perturbed, isolated, cfg: float, stg: float, modality: float, rescale: float) -> torch.Tensor:
    """ltx-core `MultiModalGuider.calculate` on one stream's denoised latents (float32), the rescale's std per
    sample: x0 = cond + (cfg - 1)(cond - uncond) + stg (cond - perturbed) + (modality - 1)(cond - isolated),
    then x0 * (rescale std(cond) / std(x0) + 1 - rescale)."""
    pred = cond
    if uncond is not None and cfg != 1.0:
        pred = pred + (cfg - 1.0) * (cond - uncond)
    if perturbed is not None and stg != 0.0:
        pred = pred + stg * (cond - perturbed)
    if isolated is not None and modality != 1.0:
        pred = pred + (modality - 1.0) * (cond - isolated)
    if rescale != 0.0 and pred is not cond:
        dims = list(range(1, pred.dim()))
        factor = cond.std(dim=dims, keepdim=True) / pred.std(dim=dims, keepdim=True)
        pred = pred * (rescale * factor + (1.0 - rescale))
    return pred


def _initial(given: torch.Tensor | None, shape, generator, device, name: str) -> torch.Tensor:
    if given is not None:
        if tuple(given.shape) != tuple(shape):
            raise ValueError(f"{name} have shape {tuple(given.shape)}; expected {tuple(shape)}")
        return given.to(device=device, dtype=torch.float32)
    return torch.randn(shape, generator=generator, device=generator.device if generator is not None else "cpu",
                       dtype=torch.float32).to(device)


def _as_prompts(embeds, name: str) -> list[LTX2PromptEmbeds]:
    """One or a list of `LTX2PromptEmbeds` (video (Lt, Dv), audio (Lt, Da)) -> a list of them."""
    items = embeds if isinstance(embeds, list) else [embeds]
    if not items:
        raise ValueError(f"{name} is empty")
    out = []
    for i, e in enumerate(items):
        if not isinstance(e, tuple) or len(e) != 2 or any(not isinstance(t, torch.Tensor) or t.ndim != 2 for t in e):
            raise ValueError(f"{name}[{i}] must be an LTX2PromptEmbeds (video (Lt, Dv), audio (Lt, Da)), got "
                             f"{type(e).__name__}")
        out.append(LTX2PromptEmbeds(*e))
    return out


def _contexts(prompts: list[LTX2PromptEmbeds], device, dtype):
    """(video (B, Lt, Dv), audio (B, Lt, Da), video mask, audio mask): prompts of different lengths right-padded
    with zeros and masked (None when all are as long: every row of a connector's output is context)."""
    out = []
    for part in ("video", "audio"):
        rows = [getattr(p, part) for p in prompts]
        n = max(r.shape[0] for r in rows)
        ctx = torch.stack([F_.pad(r, (0, 0, 0, n - r.shape[0])) for r in rows]).to(device=device, dtype=dtype)
        mask = None
        if any(r.shape[0] != n for r in rows):
            mask = torch.stack([torch.arange(n) < r.shape[0] for r in rows]).to(device)
        out.append((ctx, mask))
    (video, video_mask), (audio, audio_mask) = out
    return video, audio, video_mask, audio_mask


def _first_frames(images, batch: int) -> list:
    """The first frame(s), one per sample."""
    if isinstance(images, torch.Tensor):
        items = list(images[None] if images.ndim == 3 else images)
    elif isinstance(images, Image.Image):
        items = [images]
    elif isinstance(images, (list, tuple)):
        items = list(images)
    else:
        raise TypeError(f"first_frame must be a PIL image, a list of them or a tensor, got {type(images).__name__}")
    if len(items) == 1 and batch > 1:
        items = items * batch
    if len(items) != batch:
        raise ValueError(f"{len(items)} first_frame images for {batch} prompts (give 1 or {batch})")
    return items
