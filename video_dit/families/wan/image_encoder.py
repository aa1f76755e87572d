"""The CLIP image encoder of Wan 2.1 I2V / FLF2V: frames -> the features the DiT's image branch reads.

    images (N, 3, H, W) in [-1, 1]
      --bicubic resize to image_size x image_size (224; whole frame, no crop)--> x * 0.5 + 0.5 in [0, 1]
      --CLIP normalisation (mean / std)--> transformers `CLIPVisionModel` (ViT-H/14: 32 blocks, width 1280)
      --output of the penultimate block (the last block is dropped, never run)--> (N, 257, 1280) float32

This is Wan's `CLIPModel.visual` (wan/modules/clip.py: `use_31_block=True`, i.e. `hidden_states[-2]`
of the transformers model). Wan and diffusers differ in the resize: diffusers' `CLIPImageProcessor`
scales the short side to 224 and centre-crops, Wan resizes the whole frame to 224 x 224 (aspect not
kept); we follow Wan. The network is transformers' own (not a hand-written ViT); file loading and key
conversion live in `loading.load_image_encoder` / `convert.py`; this file holds only the wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from video_dit.models.common import EncoderWrapper, build_transformers_model

# OpenAI CLIP's normalisation, which Wan uses for ViT-H/14 (wan/modules/clip.py `_clip`).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class ImageEncoderConfig:
    """A transformers `CLIPVisionConfig` subset. Defaults: Wan's ViT-H/14 (open-clip xlm-roberta-large
    vit-huge-14, exact GELU, LayerNorm eps 1e-5)."""

    hidden_size: int = 1280
    intermediate_size: int = 5120
    num_layers: int = 32
    num_heads: int = 16
    image_size: int = 224
    patch_size: int = 14
    layer_norm_eps: float = 1e-5
    hidden_act: str = "gelu"

    def __post_init__(self):
        if min(self.hidden_size, self.intermediate_size, self.num_heads, self.image_size, self.patch_size) < 1 \
                or self.num_layers < 2:
            raise ValueError(f"ImageEncoderConfig needs positive sizes and num_layers >= 2 (the penultimate "
                             f"block's output is used), got {self}")
        if self.hidden_size % self.num_heads or self.image_size % self.patch_size:
            raise ValueError(f"ImageEncoderConfig: hidden_size {self.hidden_size} must divide by num_heads "
                             f"{self.num_heads} and image_size {self.image_size} by patch_size {self.patch_size}")

    @property
    def tokens(self) -> int:
        """Features per image: one per patch plus the class token (ViT-H/14 at 224: 257)."""
        return (self.image_size // self.patch_size) ** 2 + 1


def clip_vision_config(config: ImageEncoderConfig):
    """The transformers `CLIPVisionConfig` described by `config`."""
    from transformers import CLIPVisionConfig

    return CLIPVisionConfig(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                            num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
                            image_size=config.image_size, patch_size=config.patch_size,
                            layer_norm_eps=config.layer_norm_eps, hidden_act=config.hidden_act)


def build_clip_vision(config: ImageEncoderConfig, seed: int | None = 0, device=None):
    """A transformers `CLIPVisionModel`: randomly initialised from `seed` (global RNG untouched), or
    on the meta device when `device="meta"` (for `load_state_dict(..., assign=True)`)."""
    from transformers import CLIPVisionModel

    return build_transformers_model(CLIPVisionModel, clip_vision_config(config), seed, device)


def _vision(model: nn.Module) -> nn.Module:
    """The vision transformer inside `model` (transformers >= 5 builds it flat; older versions and
    `CLIPVisionModelWithProjection` nest it as `.vision_model`)."""
    return getattr(model, "vision_model", model)


class ImageEncoder(EncoderWrapper):
    """A frozen CLIP vision model: `encode(images) -> (N, tokens, hidden_size)` float32.

    model: a transformers `CLIPVisionModel` (possibly quantized); its last encoder block is removed
    here, so the model's last hidden state is the penultimate block's output Wan uses.
    mean / std: the normalisation (CLIP's unless an image_processor config says otherwise).
    """

    def __init__(self, model: nn.Module, mean=CLIP_MEAN, std=CLIP_STD):
        super().__init__()
        vision = _vision(model)
        vision.encoder.layers = vision.encoder.layers[:-1]  # the last block's output is never used
        self.model = model.eval().requires_grad_(False)
        self.image_size = int(model.config.image_size)
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def tokens(self) -> int:
        return (self.image_size // int(self.model.config.patch_size)) ** 2 + 1

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) in [-1, 1] -> CLIP pixel values (N, 3, S, S) float32, S = image_size (Wan's
        resize: bicubic, align_corners False, no antialias, the whole frame)."""
        if images.ndim != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be (N, 3, H, W) in [-1, 1], got {tuple(images.shape)}")
        s = self.image_size
        x = F.interpolate(images.float(), size=(s, s), mode="bicubic", align_corners=False)
        return (x * 0.5 + 0.5 - self.mean.to(x.device)) / self.std.to(x.device)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) in [-1, 1] -> (N, tokens, dim) float32 on the model's device: the output of
        the penultimate block (transformers' `hidden_states[-2]` of the full model)."""
        pixels = self.preprocess(images.to(self.device)).to(self.dtype)
        return self.model(pixel_values=pixels).last_hidden_state.float()  # (N, tokens, dim)
