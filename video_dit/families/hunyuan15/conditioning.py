"""HunyuanVideo 1.5's first-frame conditioning: one object for sampling and training (`conditioning.py`
is Wan's; the two share the interface: `apply`, `dit_kwargs`, `restore`).

    noisy (B, C, F', h, w) --apply--> model input [noisy | cond | mask]        (B, 2C + 1, F', h, w)
      cond: the first frame's normalized VAE latent in latent frame 0, zeros after     (B, C, F', h, w)
      mask: 1 on latent frame 0, 0 after                                                (B, 1, F', h, w)
      text-to-video (no cond, or a sample `active` leaves out): zeros and mask 0
    timestep (B,): t for every token (frame 0 of `noisy` is noisy; nothing replaces it)
    image embeds (B, Li, D) SigLIP --dit_kwargs--> the DiT's `image_embeds` (+ `image_mask`: False rows
      for the samples left out, which the DiT reads as t2v); t2v: none
    loss mask: 1 everywhere (Tencent's train.py computes a plain MSE over every frame)

The DiT always reads the 2C + 1 channels: t2v and i2v are one model trained on both (Tencent's train.py
`i2v_prob`, `get_condition` lines 641-652, builds exactly this cond); the released checkpoints are each
tuned for one task, which the front ends enforce (spec.py), not this object. The reference pipelines
build it the same way (Tencent `_prepare_cond_latents`, diffusers `prepare_cond_latents_and_mask`), and
step the whole latent: the model's frame-0 prediction is the video's first frame (Wan I2V's "concat"
semantics, hence i2v mode "concat").
"""

from __future__ import annotations

import torch

from video_dit.families.hunyuan15.encoders import pad_embeds


class HY15Conditioning:
    """Apply HunyuanVideo 1.5's first-frame conditioning (module docstring)."""

    def apply(self, noisy: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor] | None = None,
              active: torch.Tensor | None = None):
        """noisy (B, C, F', h, w); t (B,) on 0..1000; cond: {"first_frame_latents": (B, C, 1, h, w)} (i2v)
        or None (t2v); active: optional (B,) bool, the samples to condition (None: all).
        Returns (model_input (B, 2C + 1, F', h, w), t (B,), loss_mask (B, 1, F', h, w) float32, all 1)."""
        B, C, Fl, h, w = noisy.shape
        if t.shape != (B,):
            raise ValueError(f"t must have shape (B,) = ({B},), got {tuple(t.shape)}")
        latents = noisy.new_zeros(B, C, Fl, h, w)
        mask = noisy.new_zeros(B, 1, Fl, h, w)
        if cond:  # None or {}: text-to-video
            first = cond.get("first_frame_latents")
            if first is None or tuple(first.shape) != (B, C, 1, h, w):
                got = None if first is None else tuple(first.shape)
                raise ValueError(f"cond['first_frame_latents'] must be ({B}, {C}, 1, {h}, {w}), got {got}")
            on = torch.ones(B, device=noisy.device, dtype=noisy.dtype) if active is None else \
                active.to(device=noisy.device).reshape(B).to(noisy.dtype)
            latents[:, :, :1] = first.to(noisy) * on.view(B, 1, 1, 1, 1)
            mask[:, :, 0] = on.view(B, 1, 1, 1)
        loss_mask = torch.ones(B, 1, Fl, h, w, device=noisy.device, dtype=torch.float32)
        return torch.cat([noisy, latents, mask], dim=1), t, loss_mask  # (B, 2C + 1, F', h, w)

    def dit_kwargs(self, cond: dict[str, torch.Tensor] | None, active: torch.Tensor | None = None, *,
                   t: torch.Tensor | None = None, noise: torch.Tensor | None = None) -> dict:
        """{"image_embeds": (B, Li, D)[, "image_mask": (B, Li)]} when `cond` holds SigLIP embeds, else {}. `t`, `noise`
        (the interface's, for MiniMax H3's keyframe rows): not read here."""
        if cond is None or "image_embeds" not in cond:
            return {}
        embeds = cond["image_embeds"]
        if active is None:
            return {"image_embeds": embeds}
        mask = active.to(device=embeds.device, dtype=torch.bool).reshape(-1, 1).expand(embeds.shape[:2])
        return {"image_embeds": embeds, "image_mask": mask}

    def restore(self, x: torch.Tensor, cond: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """The final latent as the decoder sees it: unchanged (frame 0 is generated, not replaced)."""
        return x


@torch.no_grad()
def encode_hy15_conditioning(vae, first_frame: torch.Tensor, image_encoder=None, images=None) -> dict:
    """Conditioning tensors of a first frame, for `HY15Conditioning`.

    vae: a `HunyuanVideo15VAE`. first_frame: (B, 3, H, W) in [-1, 1], the frame at the video's size.
    image_encoder: an `HY15ImageEncoder` (SigLIP) or None; images: what it reads (PIL images, or None:
    `first_frame` itself, converted to uint8 as Tencent's train.py does).
    Returns {"first_frame_latents": (B, C, 1, h, w) normalized posterior mode, float32 (Tencent's and
    diffusers' pipelines: `vae.encode(image).mode() * scaling_factor`)[, "image_embeds": (B, Li, D)]}.
    """
    if first_frame.ndim != 4 or first_frame.shape[1] != 3:
        raise ValueError(f"first_frame must be (B, 3, H, W) in [-1, 1], got {tuple(first_frame.shape)}")
    lo, hi = float(first_frame.min()), float(first_frame.max())
    if lo < -1.001 or hi > 1.001:
        raise ValueError(f"first_frame must lie in [-1, 1] (rescale [0, 1] images with x * 2 - 1); got "
                         f"[{lo:.3g}, {hi:.3g}]")
    param = next(vae.parameters())
    z = vae.encode(first_frame[:, :, None].to(device=param.device, dtype=param.dtype)).mode()  # (B, C, 1, h, w)
    out = {"first_frame_latents": vae.normalize(z).float()}
    if image_encoder is not None:
        out["image_embeds"] = image_encoder.encode(first_frame if images is None else images).float()  # (B, Li, D)
    return out


def padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """[(L_i, D)] -> (N, max L_i, D) zero-padded and its (N, max L_i) mask (the DiT masks the padding);
    an empty row (a prompt without glyphs: (0, D) or (0, 0)) is all padding."""
    width = max(r.shape[1] for r in rows)
    rows = [r if r.shape[0] else r.new_zeros(0, width) for r in rows]  # an empty glyph row has no width
    return pad_embeds(rows, max(1, max(r.shape[0] for r in rows)))


def text_inputs(texts: list[torch.Tensor], glyphs: list[torch.Tensor] | None = None, device=None,
                dtype=None, always_glyph: bool = False) -> dict[str, torch.Tensor | None]:
    """The DiT's text arguments of B prompts, as both the trainer and the pipeline give them: texts
    [(Lt_i, D)] Qwen2.5-VL states, glyphs [(Lg_i, Dg)] ByT5 states (Lg_i = 0 without quoted text) ->
    {"context": (B, Lt, D), "context_mask": (B, Lt), "glyph": (B, Lg, Dg) or None (no prompt quotes
    text), "glyph_mask": (B, Lg) or None}, the tensors on `device` and the embeds in `dtype`.
    `always_glyph`: glyph rows even when no prompt quotes text (one masked-out row each: the same output
    as None), so the DiT's ByT5 branch runs in every forward; ZeRO-3 gathers a module's parameters on
    every rank together, and a rank whose batch quotes nothing would otherwise skip the gather."""
    to = dict(device=device, dtype=dtype)
    text, text_mask = padded(texts)
    out = {"context": text.to(**to), "context_mask": text_mask.to(device), "glyph": None, "glyph_mask": None}
    if glyphs is not None and (always_glyph or any(g.shape[0] for g in glyphs)):
        glyph, glyph_mask = padded(glyphs)
        out.update(glyph=glyph.to(**to), glyph_mask=glyph_mask.to(device))
    return out
