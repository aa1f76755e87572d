"""First-frame (image-to-video) conditioning: one object, used identically in training and sampling.

Two styles (`mode`):

1. "replace" (Wan 2.2 TI2V style; works with any t2v model, in_dim == out_dim):
       model_input = noisy, with latent frame 0 overwritten by the clean normalized first-frame latent
       timestep    = (B, L) per token, 0 on frame-0 tokens and t elsewhere
       loss_mask   = 1 everywhere but latent frame 0 (always: see below)
   Per-token timesteps are right for EVERY model in replace mode, Wan 2.1 t2v included: frame 0 is
   clean, so t = 0 is the truth for its tokens (Wan 2.2 TI2V and diffusers' `expand_timesteps` do
   this), and our DiT accepts (B, L) for any config. There is no scalar-t variant: the trainer, the
   pipeline and the ai-toolkit arch all get their timesteps from `apply`.
   Sampling overwrites frame 0 before every step and `restore` puts it back at the end, so the
   model's frame-0 prediction never reaches the video; its target (noise - x0 for an input that
   holds no noise) is meaningless, and the mask keeps it out of the loss.

2. "concat" (Wan 2.1 / 2.2 I2V, in_dim 36 = 16 + 4 + 16):
       model_input = [noisy 16 | mask 4 | normalized VAE(first frame, zero frames...) 16]  (B, 36, F', h, w)
       timestep    = (B,) = t (frame 0 of `noisy` is noisy here, so per-token t = 0 would be wrong)
       loss_mask   = 1 everywhere by default (`mask_first_frame_loss=False`)
   Nothing replaces latent frame 0 while sampling (Wan's image2video.py loop steps the whole 16-channel
   latent and decodes it), so the model's frame-0 prediction IS the first frame of the output video
   and belongs in the loss, as in Wan's training setups: ai-toolkit's Wan I2V models (no
   `scale_loss` mask), DiffSynth-Studio's FlowMatchSFTLoss (it drops frame 0 only when
   `first_frame_latents` replace it, the TI2V case) and diffusion-pipe's Wan (target over every
   frame). `mask_first_frame_loss=True` masks it anyway (key `model.mask_first_frame_loss`).
   The 4 mask channels are Wan's packing of the per-pixel-frame mask: latent frame 0 stands for pixel
   frame 0 (repeated 4x), latent frame f > 0 for pixel frames 4f-3..4f (one channel each).
   First-last frame (`last_frame=True`, Wan 2.1 FLF2V; concat only): the mask is 1 on the first AND
   the last pixel frame and the VAE sees [first, zeros..., last] (Wan's first_last_frame2video.py).
   The last latent frame also holds 3 generated pixel frames, so it stays in the loss.

The CLIP image branch (Wan 2.1 I2V / FLF2V DiTs): `encode_conditioning(..., image_encoder=)` adds
`clip_features` (B, Li, C), the penultimate CLIP features of the first frame (Li = 257) or of [first |
last] (514), and `dit_kwargs(cond)` hands them to the DiT (`clip_fea=`), unchanged at every step
and in both classifier-free-guidance passes (Wan gives the negative prompt the same image).

`apply(..., active=)` conditions some samples of a batch and leaves the others as plain t2v (replace
mode: a t2v dataset mixed into an i2v job): the one place that per-sample choice is made.
Conditioning tensors come from `encode_conditioning(vae, frames, mode, num_frames, ...)`, called by
the data cache and by the pipeline, so both see exactly the same latents and CLIP features.
"""

from __future__ import annotations

from typing import Literal

import torch

I2VMode = Literal["replace", "concat"]
I2V_MODES: tuple[str, ...] = ("replace", "concat")
MASK_CHANNELS = 4  # Wan packs 4 pixel frames per latent frame into the concat mask


def pack_frame_mask(frame_mask: torch.Tensor, temporal_factor: int = MASK_CHANNELS) -> torch.Tensor:
    """Wan's temporal packing of a per-pixel-frame mask (B, F, h, w) -> (B, 4, F', h, w).

    F = 4k + 1 and F' = k + 1: pixel frame 0 is repeated 4 times to fill latent frame 0, then every 4
    consecutive pixel frames fill the 4 channels of one latent frame.
    """
    B, F, h, w = frame_mask.shape
    if (F - 1) % temporal_factor:
        raise ValueError(f"frame mask has {F} frames; need {temporal_factor}k + 1")
    m = torch.cat([frame_mask[:, :1].repeat_interleave(temporal_factor, dim=1), frame_mask[:, 1:]], dim=1)
    return m.view(B, -1, temporal_factor, h, w).transpose(1, 2)  # (B, 4, F', h, w)


def default_mask_first_frame_loss(mode: I2VMode) -> bool:
    """Whether latent frame 0 stays out of the loss when the job does not say: replace yes, concat no."""
    return mode == "replace"


class FirstFrameConditioning:
    """Apply first-frame conditioning to a noisy latent; see the module docstring for both modes.

    `patch_size` is the DiT's (pt, ph, pw): per-token timesteps follow the DiT's token order
    (frame, y, x) with L = F'/pt * h/ph * w/pw. `mask_first_frame_loss`: None = the mode's default
    (`default_mask_first_frame_loss`); True masks frame 0 out of the loss in either mode; False is
    concat only (in replace mode frame 0's prediction is discarded, so it is refused). `last_frame`:
    the last pixel frame is given too (first-last-frame, concat only).
    """

    def __init__(self, mode: I2VMode, patch_size: tuple[int, int, int] = (1, 2, 2),
                 mask_first_frame_loss: bool | None = None, last_frame: bool = False):
        if mode not in I2V_MODES:
            raise ValueError(f"unknown i2v mode {mode!r}; accepted: {', '.join(I2V_MODES)}")
        if patch_size[0] != 1:
            raise ValueError(f"first-frame conditioning needs a temporal patch of 1, got {patch_size}")
        if mask_first_frame_loss is None:
            mask_first_frame_loss = default_mask_first_frame_loss(mode)
        if mode == "replace" and not mask_first_frame_loss:
            raise ValueError("mask_first_frame_loss=False needs i2v mode 'concat': in replace mode latent frame 0 "
                             "is overwritten by the clean first frame, so its prediction has no target to learn; "
                             "accepted in replace mode: true (or leave it unset)")
        if last_frame and mode != "concat":
            raise ValueError("last_frame=True (first-last-frame conditioning) needs i2v mode 'concat' (a mask "
                             "and VAE latents for the last frame); replace mode gives only the first frame")
        self.mode, self.patch_size = mode, tuple(patch_size)
        self.mask_first_frame_loss = bool(mask_first_frame_loss)
        self.last_frame = bool(last_frame)

    def __repr__(self) -> str:
        return (f"FirstFrameConditioning(mode={self.mode!r}, patch_size={self.patch_size}, "
                f"mask_first_frame_loss={self.mask_first_frame_loss}, last_frame={self.last_frame})")

    def apply(self, noisy: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor],
              active: torch.Tensor | None = None):
        """Conditioned model input, the DiT timestep and the loss mask.

        noisy (B, C, F', h, w): normalized noisy latents x_t; t (B,) on 0..1000;
        cond: {"first_frame_latents": (B, C, 1, h, w)} for replace, {"cond_latents": (B, 16, F', h, w)}
        for concat, as made by `encode_conditioning` (its `clip_features` go to the DiT through
        `dit_kwargs`, not through the input). active: optional (B,) bool, the samples to
        condition (replace mode; the others pass through as t2v: input `noisy`, t on every token, loss
        mask 1); None = all.
        Returns (model_input, timestep (B, L) for replace, (B,) for concat, loss_mask (B, 1, F', h, w)
        float32: 0 on latent frame 0 of the conditioned samples when the loss is masked, else 1).
        """
        B, C, Fl, h, w = noisy.shape
        if t.shape != (B,):
            raise ValueError(f"t must have shape (B,) = ({B},), got {tuple(t.shape)}")
        if active is not None:
            active = active.to(device=noisy.device, dtype=torch.bool).reshape(B)
            if bool(active.all()):
                active = None
            elif self.mode == "concat":
                raise ValueError("i2v mode 'concat' conditions every sample (an in_dim 36 DiT has no t2v input); "
                                 "got a batch with unconditioned samples")
        loss_mask = torch.ones(B, 1, Fl, h, w, device=noisy.device, dtype=torch.float32)
        if self.mask_first_frame_loss:
            loss_mask[:, :, 0] = 0.0 if active is None else (~active).float().view(B, 1, 1, 1)
        if self.mode == "replace":
            first = _get(cond, "first_frame_latents", (B, C, 1, h, w))
            model_input = torch.cat([first.to(noisy.dtype), noisy[:, :, 1:]], dim=2)  # (B, C, F', h, w)
            _, ph, pw = self.patch_size
            per_frame = t.float()[:, None].repeat(1, Fl)  # (B, F')
            per_frame[:, 0] = 0.0
            if active is not None:
                model_input = torch.where(active.view(B, 1, 1, 1, 1), model_input, noisy)
                per_frame[:, 0] = torch.where(active, per_frame[:, 0], t.float())
            timestep = per_frame[:, :, None].expand(B, Fl, (h // ph) * (w // pw)).reshape(B, -1)  # (B, L)
            return model_input, timestep, loss_mask
        cond_latents = _get(cond, "cond_latents", (B, None, Fl, h, w))
        frame_mask = torch.zeros(B, 4 * (Fl - 1) + 1, h, w, device=noisy.device, dtype=noisy.dtype)
        frame_mask[:, 0] = 1.0  # pixel frame 0 is given
        if self.last_frame:
            frame_mask[:, -1] = 1.0  # and the last one (first-last-frame)
        mask = pack_frame_mask(frame_mask)  # (B, 4, F', h, w)
        model_input = torch.cat([noisy, mask, cond_latents.to(noisy.dtype)], dim=1)  # (B, C + 4 + 16, F', h, w)
        return model_input, t, loss_mask

    def dit_kwargs(self, cond: dict[str, torch.Tensor], active: torch.Tensor | None = None, *,
                   t: torch.Tensor | None = None, noise: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """The DiT's keyword inputs from `cond`: {"clip_fea": (B, Li, C)} when it holds CLIP features
        (a DiT with the image branch needs them; one without refuses them), else {}. `active` (the
        interface's, for HunyuanVideo 1.5's image mask): Wan's image branch reads every sample's features.
        `t`, `noise` (the interface's, for MiniMax H3's keyframe rows at the step's t): not read here."""
        return {"clip_fea": cond["clip_features"]} if "clip_features" in cond else {}

    def restore(self, x: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        """The final latent as the decoder should see it: replace mode puts the clean first-frame
        latent back into frame 0 (the solver's last update moved it); concat returns `x` unchanged."""
        if self.mode != "replace":
            return x
        first = _get(cond, "first_frame_latents", (x.shape[0], x.shape[1], 1, *x.shape[3:]))
        return torch.cat([first.to(x.dtype), x[:, :, 1:]], dim=2)


def _get(cond: dict[str, torch.Tensor], key: str, shape: tuple) -> torch.Tensor:
    if key not in cond:
        raise KeyError(f"conditioning needs cond[{key!r}]; got keys {sorted(cond)}")
    value = cond[key]
    if value.ndim != len(shape) or any(s is not None and s != v for s, v in zip(shape, value.shape)):
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
        raise ValueError(f"cond[{key!r}] has shape {tuple(value.shape)}; expected {want}")
    return value


@torch.no_grad()
def clip_features(image_encoder, first: torch.Tensor, last: torch.Tensor | None = None) -> torch.Tensor:
    """The DiT image branch's input: CLIP features of the first frame (B, tokens, C), or of [first |
    last] along the tokens (B, 2 tokens, C), Wan's FLF2V order; first / last (B, 3, H, W) in [-1, 1]."""
    images = [first] + ([last] if last is not None else [])
    return torch.cat([image_encoder.encode(x) for x in images], dim=1).float()  # (B, Li, C)


@torch.no_grad()
def encode_conditioning(vae, frames: torch.Tensor, mode: I2VMode, num_frames: int, *,
                        last_frame: torch.Tensor | None = None, image_encoder=None) -> dict[str, torch.Tensor]:
    """Conditioning tensors from pixels, for `FirstFrameConditioning.apply` / `.dit_kwargs`.

    vae: a `CausalVideoVAE` (encode -> posterior with .mode(); normalize). frames: the first frame
    (B, 3, H, W) or a clip (B, 3, F, H, W) whose frame 0 is used, in [-1, 1]. num_frames: pixel frames
    of the clip to generate (4k + 1; used by concat). last_frame: (B, 3, H, W) in [-1, 1], the last
    frame of a first-last-frame clip (concat only). image_encoder: an `ImageEncoder` (CLIP), for DiTs
    with the image branch. The posterior mode is used (deterministic).
    Returns {"first_frame_latents": (B, C, 1, h, w)} (replace) or {"cond_latents": (B, C, F', h, w)}
    (concat: VAE of [first frame, num_frames - 1 zero frames], or of [first, num_frames - 2 zero
    frames, last]), normalized; with an image encoder also {"clip_features": (B, Li, D_clip)}, the
    first frame's features (Li = tokens) or [first | last] (Li = 2 tokens); all float32.
    """
    if mode not in I2V_MODES:
        raise ValueError(f"unknown i2v mode {mode!r}; accepted: {', '.join(I2V_MODES)}")
    if frames.ndim == 4:
        frames = frames[:, :, None]  # (B, 3, 1, H, W)
    if frames.ndim != 5 or frames.shape[1] != 3:
        raise ValueError(f"frames must be (B, 3, H, W) or (B, 3, F, H, W), got {tuple(frames.shape)}")
    B, _, _, H, W = frames.shape
    if last_frame is not None:
        if mode != "concat":
            raise ValueError("a last frame needs i2v mode 'concat' (first-last-frame); replace mode takes the first only")
        if tuple(last_frame.shape) != (B, 3, H, W):
            raise ValueError(f"last_frame must be (B, 3, H, W) = ({B}, 3, {H}, {W}), got {tuple(last_frame.shape)}")
    for name, x in (("frames", frames), ("last_frame", last_frame)):
        if x is None:
            continue
        lo, hi = float(x.min()), float(x.max())
        if lo < -1.001 or hi > 1.001:
            raise ValueError(f"{name} must lie in [-1, 1] (rescale [0, 1] images with x * 2 - 1); got "
                             f"[{lo:.3g}, {hi:.3g}]")
    first = frames[:, :, :1]  # (B, 3, 1, H, W)
    out = {} if image_encoder is None else {"clip_features": clip_features(image_encoder, first[:, :, 0], last_frame)}
    param = next(vae.parameters(), None)
    if param is not None:
        first = first.to(device=param.device, dtype=param.dtype)
    if mode == "replace":
        z = vae.encode(first).mode()  # (B, C, 1, h, w)
        return {"first_frame_latents": vae.normalize(z).float(), **out}
    if (num_frames - 1) % 4:
        raise ValueError(f"num_frames must be 4k + 1, got {num_frames}")
    if last_frame is None or num_frames == 1:  # (a one-frame clip's last frame is its first)
        clip = torch.cat([first, first.new_zeros(B, 3, num_frames - 1, H, W)], dim=2)  # (B, 3, F, H, W)
    else:
        last = last_frame[:, :, None].to(first)
        clip = torch.cat([first, first.new_zeros(B, 3, num_frames - 2, H, W), last], dim=2)  # (B, 3, F, H, W)
    z = vae.encode(clip).mode()  # (B, C, F', h, w)
    return {"cond_latents": vae.normalize(z).float(), **out}


def masked_mse(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error over the positions where `mask` is 1, computed in float32.

    pred, target: (B, C, F', h, w); mask: (B, 1, F', h, w) (broadcast over channels) or None (plain
    mean). Normalised by the mask's sum x C, so conditioned (masked-out) tokens contribute nothing,
    neither to the numerator nor to the count.
    """
    err = (pred.float() - target.float()) ** 2
    if mask is None:
        return err.mean()
    mask = mask.to(device=err.device, dtype=torch.float32).expand_as(err)
    count = mask.sum()
    if count == 0:
        raise ValueError("loss mask is all zeros: nothing to train on")
    return (err * mask).sum() / count


def stills_skipped(i2v_mode: str | None) -> bool:
    """What a still (a one-frame item: an image) of a `do_i2v` dataset does, for every trainer: True:
    skipped, with one warning per dataset (`skipped_stills`), for a concat model (Wan I2V, in_dim =
    out_dim + 4 + z_dim): it is conditioned on a first frame in every step and has no unconditioned
    input, and a still has no frame after its first to generate. False: trained unconditioned, as
    t2v (replace mode, as ai-toolkit's Wan 2.2 5B does; `DataItem.conditioned` is False for it)."""
    return i2v_mode == "concat"


def skipped_stills(folder, names: list[str], every: bool = False) -> str:
    """The one warning about the stills `names` of the `do_i2v` dataset `folder` a concat model skips
    (`stills_skipped`); `every`: they are all its items (an image dataset, num_frames: 1)."""
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"{folder}: {len(names)} still image(s) of this do_i2v dataset are skipped"
            + (" (every item of it: it trains nothing)" if every else "") + f" ({shown}): an image-to-video "
            "DiT with i2v_mode concat is conditioned on a first frame in every step, and a still has no frame "
            "after its first to generate (Wan's I2V has no unconditioned input); to train them, move them to "
            "a t2v job (or a replace-mode i2v job, which trains stills unconditioned)")
