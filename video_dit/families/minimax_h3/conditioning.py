"""MiniMax H3's first-frame conditioning in training (fl2va with the first keyframe), as ai-toolkit's H3 trainer
builds a training sample, and the same rows the pipeline (`pipeline.py`, diffusers' fl2va) samples with.

    a clip (1, 3, F, H, W) in [-1, 1]
      -> its latents (the target: every latent frame noised, every one in the loss)
      -> its first pixel frame, encoded alone as a keyframe (`H3VideoVAE.condition_latents`: the posterior sampled
         under seed 42, float16-rounded, normalized)                          -> first_frame_latents (1, C, 1, h, w)
      -> its first pixel frame as a uint8 picture, presented to the conditioner before the caption ("<Picture 1>: "
         + its vision block, then the caption; `encoders.H3TextEncoder.presentation`)  -> the text cache entry
    per step, at the video's t (0..1000) and a keyframe noise n (1, C, 1, h, w):
      keyframe rows = 0.999 z + 0.001 n, at timestep min(t, 1) (MiniMax's time max(1 - t / 1000, 0.999))
      DiT(x_t, t, text, keyframes=, keyframe_anchors=("first",), keyframe_timestep=) -> the target rows' velocity

Sources ("[A]" ai-toolkit at 27a03a91, extensions_built_in/diffusion_models/minimax_h3/minimax_h3.py; "[T]"
toolkit/dataloader_mixins.py there; MiniMax publishes no trainer, its repository holds the weights, configs and
request scripts):
  - [A] `_build_condition`: do_i2v and a clip of more than one frame: the first frame's latents
    (`encode_keyframe_latents`: seed 42, float16-rounded, what diffusers' pipeline encodes a keyframe with), mixed
    `KEYFRAME_NOISE_AUG_T * z + (1 - KEYFRAME_NOISE_AUG_T) * randn_like(z)` (0.999) with fresh noise per step,
    packed as one keyframe anchored "first". ([A]'s latent cache path encodes the first frame with `encode_images`,
    an unseeded posterior sample; its uncached path, followed here, is the sampler's recipe.)
  - [A] `get_noise_prediction`: the condition rows' timestep `max(t_v, KEYFRAME_NOISE_AUG_T)` in MiniMax's time;
    the prediction of the condition rows dropped (`video_pred[:, num_cond:]`); the target `noise - latents` over
    the whole clip (`get_loss_target`): no frame is masked out of the loss and the first latent frame is noised
    like the others.
  - [T] `encode_first_frame_in_text_embeddings` (commit 3f8afcac): a do_i2v video item's caption is encoded with
    its first frame as the control image ((x + 1) / 2 clamped, x 255 rounded to uint8), "matching sampling", and
    the text cache keyed on it (`first_frame_in_te`). [A]'s model does not set that flag at 27a03a91 (its do_i2v
    captions are then cached alone); diffusers' and MiniMax's fl2va always present the keyframe with the prompt,
    and our sampler refuses a keyframe without its vision block, so the presentation with the keyframe is
    followed here. The dropped caption ("") of a conditioned clip is presented with its keyframe too ([T] encodes
    dropout captions as plain text): the DiT takes one row of modality tags per batch, so a batch's
    presentations share their vision block's place; an empty fl2va request presents it alike.
"""

from __future__ import annotations

import torch

from video_dit.families.minimax_h3.encoders import TEXT_TAG, H3PromptEmbeds
from video_dit.families.minimax_h3.presets import KEYFRAME_NOISE

ANCHORS = ("first",)  # [A] trains the first keyframe only (its ref2va model adds references; no last frame)


class H3KeyframeConditioning:
    """The first keyframe as MiniMax H3's packed conditioning rows, in the house's conditioning interface
    (`apply`, `dit_kwargs`; `diffusion/objective.py`). The target latents pass through unchanged (the keyframe is
    rows of its own); `mask_first_frame_loss` True masks latent frame 0 of the conditioned samples out of the loss
    (not the reference's: it trains every frame; None / False: as it does)."""

    def __init__(self, mask_first_frame_loss: bool | None = None):
        self.mask_first_frame_loss = bool(mask_first_frame_loss)

    def __repr__(self) -> str:
        return f"H3KeyframeConditioning(anchors={ANCHORS}, mask_first_frame_loss={self.mask_first_frame_loss})"

    def apply(self, noisy: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor],
              active: torch.Tensor | None = None):
        """(model input: `noisy` (B, C, F', h, w) itself, timestep: t (B,) itself, loss mask (B, 1, F', h, w)
        float32 or None). `active` (B,) bool: the samples conditioned (None: all); a batch is all or none (one
        packed layout per batch)."""
        B, _, Fl, h, w = noisy.shape
        if t.shape != (B,):
            raise ValueError(f"t must have shape (B,) = ({B},), got {tuple(t.shape)}")
        if not self.mask_first_frame_loss or not _conditioned(active, B):
            return noisy, t, None
        mask = torch.ones(B, 1, Fl, h, w, device=noisy.device, dtype=torch.float32)
        mask[:, :, 0] = 0.0
        return noisy, t, mask

    def dit_kwargs(self, cond: dict[str, torch.Tensor], active: torch.Tensor | None = None, *,
                   t: torch.Tensor | None = None, noise: torch.Tensor | None = None) -> dict:
        """The DiT's keyframe inputs at the video's timesteps t (B,) on 0..1000 with the keyframe noise `noise`
        (B, C, 1, h, w) (the caller's draw, fresh per step as [A]'s): {"keyframes": 0.999 z + 0.001 noise
        (B, C, 1, h, w), "keyframe_anchors": ("first",), "keyframe_timestep": (B,) min(t, 1)}; {} for a batch of
        unconditioned samples (`active` all False: stills, trained as t2v)."""
        first = cond.get("first_frame_latents")
        if first is None:
            raise KeyError(f"MiniMax H3's keyframe conditioning needs cond['first_frame_latents']; got keys "
                           f"{sorted(cond)}")
        if not _conditioned(active, first.shape[0]):
            return {}
        if t is None or noise is None:
            raise ValueError("MiniMax H3's keyframe rows need the step's timesteps t= (B,) and keyframe noise= "
                             f"{tuple(first.shape)} (the trainer's draw)")
        if tuple(noise.shape) != tuple(first.shape):
            raise ValueError(f"keyframe noise has shape {tuple(noise.shape)}; expected {tuple(first.shape)}")
        return {"keyframes": hold_keyframe(first.float(), noise.float()), "keyframe_anchors": ANCHORS,
                "keyframe_timestep": keyframe_timestep(t)}


def _conditioned(active: torch.Tensor | None, batch: int) -> bool:
    """Whether the batch is conditioned: `active` None or all True; all False: not; a mix is refused."""
    if active is None:
        return True
    active = active.reshape(batch).bool()
    if bool(active.all()):
        return True
    if not bool(active.any()):
        return False
    raise ValueError("a MiniMax H3 batch mixes keyframe-conditioned clips with unconditioned samples: the DiT packs "
                     "one layout per batch; put the do_i2v and the text-to-video data in buckets of their own (one "
                     "dataset configuration per batch) or use batch_size 1")


def hold_keyframe(z: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """A keyframe's rows at their conditioning noise: 0.999 z + 0.001 noise, float32 (MiniMaxH3Scheduler
    `scale_noise(z, 0.999, noise)`, as `H3Pipeline._request` mixes them)."""
    hold = torch.tensor(KEYFRAME_NOISE, dtype=torch.float32, device=z.device)
    return hold * z + (1.0 - hold) * noise


def keyframe_timestep(t: torch.Tensor) -> torch.Tensor:
    """(B,) float32 on 0..1000 of the keyframe rows at the video's t (B,): (1 - max(1 - t / 1000, 0.999)) x 1000
    ([A]: `max(t_v, KEYFRAME_NOISE_AUG_T)` in MiniMax's time; the pipeline's rule), in float64 as the pipeline's
    Python floats compute it (float32 would give 0.99998713 for its 1)."""
    hold_t = torch.clamp(1.0 - t.double() / 1000.0, min=KEYFRAME_NOISE)
    return ((1.0 - hold_t) * 1000.0).float()


def keyframe_latents(vae, video: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a clip caches beside its latents: {"first_frame_latents": (B, C, 1, h, w) float32}, its first pixel
    frame of video (B, 3, F, H, W) in [-1, 1] encoded alone as the pipeline encodes a keyframe."""
    return {"first_frame_latents": vae.condition_latents(video[:, :, :1]).float()}


def text_entry(e: H3PromptEmbeds) -> dict[str, torch.Tensor]:
    """What a caption caches: its rows {"text_embeds": (Lt, D) float32}, and for a caption presented with a keyframe
    its rows' modality tags {"text_tags": (Lt, 1) int64} (0 on the vision block's rows)."""
    entry = {"text_embeds": e.embeds.float()}
    if bool((e.tags != TEXT_TAG).any()):
        entry["text_tags"] = e.tags.long().reshape(-1, 1)
    return entry


def prompt(entry: dict[str, torch.Tensor]) -> H3PromptEmbeds:
    """A cached caption as the pipeline takes it."""
    embeds = entry["text_embeds"]
    tags = entry["text_tags"].reshape(-1) if "text_tags" in entry else torch.full((embeds.shape[0],), TEXT_TAG)
    return H3PromptEmbeds(embeds, tags.long())


def batch_tags(tags: list[torch.Tensor] | None, lengths: list[int]) -> torch.Tensor | None:
    """The (Lt,) modality tags a batch's captions share (the DiT takes one row): None for captions alone; for
    captions presented with a keyframe (each (Lt_i, 1)) the longest's, each caption's tags a prefix of it (its vision
    block in the same place: one canvas per bucket); the padded rows (masked as keys) keep the longest's."""
    if tags is None:
        return None
    rows = [t.reshape(-1).long().cpu() for t in tags]
    longest = rows[max(range(len(rows)), key=lambda i: lengths[i])]
    for i, r in enumerate(rows):
        if r.shape[0] != lengths[i] or not torch.equal(r, longest[:r.shape[0]]):
            raise ValueError(f"caption {i} of the batch presents its keyframe otherwise than the longest (its tags "
                             "differ): a MiniMax H3 batch shares one row of modality tags; its keyframes must have "
                             "the same canvas (one bucket)")
    return longest
