"""HunyuanVideo 1.5's conditioning encoders, all transformers networks, frozen:

    prompt --chat template (system message + user turn + generation prompt)--> Qwen2.5-VL tokenizer
      (right padding to crop_start + text_len, truncation) --> Qwen2.5-VL language model, the output of
      block L-2 (hidden_states[-3]; the last two blocks and the final norm are dropped, never run)
      --drop the crop_start template tokens--> (B, text_len, 3584) + mask        [HY15TextEncoder]
    prompt --quoted substrings "..." / “...” (deduplicated) -> 'Text "a". Text "b". '--> ByT5 tokenizer
      (pad to 256, EOS) --> T5 encoder (ByT5-small, Glyph-SDXL-v2 weights)
      --> (B, 256, 1472) + mask; zeros and an all-zero mask when the prompt quotes nothing [HY15GlyphEncoder]
    first frame (PIL, or (N, 3, H, W) in [-1, 1]) --SigLIP image processor (bicubic resize to 384 x 384,
      x / 255, (x - 0.5) / 0.5)--> SigLIP vision model, last_hidden_state (after the post-layernorm, no
      pooling head) --> (N, 729, 1152)                                          [HY15ImageEncoder]
    text-to-video: zeros (B, 729, 1152) instead; the DiT reads all-zero image embeds as "no image"
      and masks them out (t2v_image_embeds)

What the DiT reads (diffusers `HunyuanVideo15Transformer3DModel.forward`): `encoder_hidden_states`
(B, Lt, 3584) + `encoder_attention_mask`, `encoder_hidden_states_2` (B, 256, 1472) + mask, and
`image_embeds` (B, 729, 1152). It gathers the valid tokens of each row and zeroes the rest, and its
token refiner pools and attends under the mask, so the values at padded positions never matter:
`encode` returns each prompt at its natural length and `pad_embeds` zero-pads a list back.

References: diffusers `pipelines/hunyuan_video1_5/pipeline_hunyuan_video1_5.py` (`_get_mllm_prompt_embeds`,
`_get_byt5_prompt_embeds`, `extract_glyph_texts`) and `..._image2video.py` (`_get_image_embeds`);
Tencent-Hunyuan/HunyuanVideo-1.5 `hyvideo/models/text_encoders/__init__.py`,
`hyvideo/pipelines/hunyuan_video_pipeline.py`, `hyvideo/models/vision_encoder/__init__.py`, `train.py`.
Where the two differ we follow Tencent, as noted at each place.
The loaders at the end read only through transformers' `from_pretrained` (kept beside their wrappers
rather than in loading.py so the parallel HunyuanVideo 1.5 work does not collide there).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from video_dit.models.common import EncoderWrapper, build_transformers_model, check_quantize, quantize_encoder
from video_dit.models.weights import WeightsError

TEXT_LEN = 1000  # prompt tokens kept after the template crop (Tencent inference / diffusers `tokenizer_max_length`)
GLYPH_LEN = 256  # ByT5 tokens per glyph prompt (`byt5_max_length` / `tokenizer_2_max_length`)
IMAGE_TOKENS = 729  # SigLIP so400m-patch14-384: (384 / 14)^2 patches (`vision_num_semantic_tokens`)
IMAGE_DIM = 1152  # its width (`vision_states_dim`, the DiT's `image_embed_dim`)
HIDDEN_LAYERS_SKIPPED = 2  # the text embeds are hidden_states[-(2 + 1)], with no final norm (apply_final_norm=False)
USER_MARKER = "<|im_start|>user\n"  # the template tokens up to and including this are cropped

# The system messages of Tencent's PROMPT_TEMPLATE_ENCODE_{VIDEO,IMAGE}_JSON, byte for byte: their source
# continues the string over lines with a backslash, so each numbered point follows 9 spaces.
# diffusers has only the video one (its `system_message`, identical).
SYSTEM_MESSAGES = {
    "video": "You are a helpful assistant. Describe the video by detailing the following aspects:         "
             "1. The main content and theme of the video.         "
             "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects.         "
             "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects.         "
             "4. background environment, light, style and atmosphere.         "
             "5. camera angles, movements, and transitions used in the video.",
    "image": "You are a helpful assistant. Describe the image by detailing the following aspects:         "
             "1. The main content and theme of the image.         "
             "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects.         "
             "3. The background environment, light, style and atmosphere.",
}


@dataclass(frozen=True)
class HY15TextEncoderConfig:
    """What a preset's DiT reads from its two text encoders: Qwen2.5-VL states of `text_dim`, ByT5 glyph
    states of `glyph_dim`. `tiny`: the tiny seeded encoders (`tiny_hy15_prompt_encoder`) instead of files."""

    text_dim: int = 3584
    glyph_dim: int = 1472
    text_len: int = TEXT_LEN
    tiny: bool = False


@dataclass(frozen=True)
class HY15ImageEncoderConfig:
    """The SigLIP of an image-to-video preset: `hidden_size` wide (the DiT's `vision_states_dim`), `tokens`
    per image. `tiny`: the tiny seeded SigLIP (`tiny_hy15_image_encoder`) instead of files."""

    hidden_size: int = IMAGE_DIM
    tokens: int = IMAGE_TOKENS
    tiny: bool = False


HY15_TEXT = HY15TextEncoderConfig()
HY15_SIGLIP = HY15ImageEncoderConfig()
TINY_HY15_TEXT = HY15TextEncoderConfig(text_dim=32, glyph_dim=32, tiny=True)  # tiny_qwen_text_model, tiny_t5_encoder
TINY_HY15_SIGLIP = HY15ImageEncoderConfig(hidden_size=32, tokens=16, tiny=True)  # tiny_siglip


def _check_prompts(prompts) -> list[str]:
    if isinstance(prompts, str):
        prompts = [prompts]
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise TypeError(f"prompts[{i}] must be a string, got {type(p).__name__}")
    return list(prompts)


def pad_embeds(embeds: list[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[(L_i, D)] -> zero-padded (B, length, D) and its mask (B, length) int64 (1 = real token), the
    layout the DiT reads; L_i <= length."""
    if not embeds:
        raise ValueError("pad_embeds needs at least one embedding")
    too_long = [i for i, e in enumerate(embeds) if e.shape[0] > length]
    if too_long:
        raise ValueError(f"embeds {too_long} are longer than length={length}: {[embeds[i].shape[0] for i in too_long]}")
    first = embeds[0]
    out = first.new_zeros(len(embeds), length, first.shape[-1])
    mask = torch.zeros(len(embeds), length, dtype=torch.int64, device=first.device)
    for i, e in enumerate(embeds):
        out[i, : e.shape[0]] = e
        mask[i, : e.shape[0]] = 1
    return out, mask


# ---------------------------------------------------------------- Qwen2.5-VL prompt embeds


def chat(prompts: list[str], system_message: str) -> list[list[dict]]:
    """One chat per prompt: the system message, then the prompt as the user turn (an empty prompt
    becomes " ", as both references do)."""
    return [[{"role": "system", "content": system_message}, {"role": "user", "content": p if p else " "}]
            for p in prompts]


def find_crop_start(tokenizer, system_message: str) -> int:
    """Template tokens before the prompt: the end of the first `<|im_start|>user\\n` in the tokenized
    chat. Tencent computes it so (`TextEncoder.calculate_crop_start`, on the prompt "a photo of a cat");
    diffusers hard-codes 108, Qwen2.5-VL's count for the video template. Tencent falls back to 0 (no
    crop) when the marker is missing; we refuse such a tokenizer instead."""
    ids = tokenizer.apply_chat_template(chat(["a photo of a cat"], system_message), add_generation_prompt=True,
                                        tokenize=True, return_dict=True)["input_ids"][0]
    ids = list(ids)
    marker = tokenizer(USER_MARKER, add_special_tokens=False)["input_ids"]
    for i in range(len(ids) - len(marker) + 1):
        if ids[i:i + len(marker)] == marker:
            return i + len(marker)
    raise ValueError(f"the tokenizer's chat template has no {USER_MARKER!r} (tokens {marker}) before the prompt: "
                     "not a Qwen2.5-VL chat tokenizer")


class HY15TextEncoder(EncoderWrapper):
    """Qwen2.5-VL's language model and tokenizer: `encode(prompts) -> [(Lt_i, D)]`, or the padded
    `encode_padded(prompts) -> (B, text_len, D), mask (B, text_len)` as diffusers returns it.

    model: a transformers `Qwen2_5_VLTextModel` (possibly quantized). Its last `skip` blocks and its
    final norm are removed here: the embeds are the output of block L - skip, not normed, which is
    `hidden_states[-(skip + 1)]` of the whole model (Tencent `hidden_state_skip_layer=2`,
    `apply_final_norm=False`; diffusers `num_hidden_layers_to_skip=2`).
    tokenizer: Qwen2.5-VL's, with its chat template; right padding is forced (Tencent loads it with
    `padding_side="right"`; the crop assumes the template sits at the start of every row).
    text_len: prompt tokens at most after the crop (1000; Tencent's train.py tokenizes with its
    `text2tokens` default of 300). The generation prompt `<|im_end|>\\n<|im_start|>assistant\\n` after
    the prompt is kept, as in both references (and cut with the prompt's end when truncated).
    template: "video" (inference and video data) or "image" (Tencent's train.py for image data).
    """

    def __init__(self, model: nn.Module, tokenizer, text_len: int = TEXT_LEN, template: str = "video",
                 skip: int = HIDDEN_LAYERS_SKIPPED, crop_start: int | None = None):
        super().__init__()
        if template not in SYSTEM_MESSAGES:
            raise ValueError(f"template={template!r}; accepted: {', '.join(map(repr, SYSTEM_MESSAGES))}")
        if text_len < 1:
            raise ValueError(f"text_len must be >= 1, got {text_len}")
        if not 0 <= skip < len(model.layers):
            raise ValueError(f"skip={skip} must leave at least one of the model's {len(model.layers)} blocks")
        if skip:
            model.layers = model.layers[: len(model.layers) - skip]  # their output is never used
            model.norm = nn.Identity()  # hidden_states[-(skip + 1)] is taken before the final norm
        self.model = model.eval().requires_grad_(False)
        tokenizer.padding_side = "right"
        self.tokenizer = tokenizer
        self.text_len = text_len
        self.template = template
        self.system_message = SYSTEM_MESSAGES[template]
        self.crop_start = find_crop_start(tokenizer, self.system_message) if crop_start is None else crop_start

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask), each (B, crop_start + text_len) int64 on the model's device."""
        batch = self.tokenizer.apply_chat_template(
            chat(prompts, self.system_message), add_generation_prompt=True, tokenize=True, return_dict=True,
            padding="max_length", max_length=self.text_len + self.crop_start, truncation=True, return_tensors="pt")
        return batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)

    @torch.no_grad()
    def encode_padded(self, prompts: list[str] | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, text_len, D) in the model's dtype and (B, text_len) int64 mask: diffusers'
        `encode_prompt` `prompt_embeds` / `prompt_embeds_mask` (values at padded positions included)."""
        prompts = _check_prompts(prompts)
        if not prompts:
            raise ValueError("encode_padded needs at least one prompt")
        ids, mask = self.tokenize(prompts)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, crop + text_len, D)
        return hidden[:, self.crop_start:], mask[:, self.crop_start:]  # (B, text_len, D), (B, text_len)

    def encode(self, prompts: list[str] | str) -> list[torch.Tensor]:
        """One (Lt_i, D) tensor per prompt (its tokens after the template crop, generation prompt
        included; 1 <= Lt_i <= text_len), the same alone or in any batch (causal attention, right padding)."""
        prompts = _check_prompts(prompts)
        if not prompts:
            return []
        hidden, mask = self.encode_padded(prompts)
        return [h[:n] for h, n in zip(hidden, mask.sum(dim=1).tolist())]


# ---------------------------------------------------------------- ByT5 glyph embeds

_QUOTED = re.compile(r"\"(.*?)\"|“(.*?)”")


def glyph_texts(prompt: str) -> list[str]:
    """The substrings of `prompt` in straight or curly double quotes, in order, deduplicated."""
    return list(dict.fromkeys(a or b for a, b in _QUOTED.findall(prompt)))


def glyph_prompt(prompt: str) -> str | None:
    """ByT5's input for `prompt`: 'Text "a". Text "b". ' for its quoted substrings, or None when it
    quotes nothing. Tencent builds it with `MultilingualPromptFormat.format_prompt` with no colour or
    font (each text becomes 'Text "t". '); diffusers with `". ".join(...) + ". "`: the same string."""
    texts = glyph_texts(prompt)
    return "".join(f'Text "{t}". ' for t in texts) if texts else None


class HY15GlyphEncoder(EncoderWrapper):
    """ByT5's T5 encoder (Glyph-SDXL-v2 weights) and tokenizer: `encode(prompts) -> [(Lg_i, D)]`
    (Lg_i = 0 for a prompt without quoted text), or `encode_padded` as diffusers returns it.

    model: a transformers `T5EncoderModel` (possibly quantized); tokenizer: ByT5's (Glyph-SDXL-v2 adds
    colour and font tokens to it); text_len: tokens per glyph prompt, EOS included (256).
    """

    def __init__(self, model: nn.Module, tokenizer, text_len: int = GLYPH_LEN):
        super().__init__()
        if text_len < 1:
            raise ValueError(f"text_len must be >= 1, got {text_len}")
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.text_len = text_len

    @property
    def dim(self) -> int:
        return int(self.model.config.d_model)

    @torch.no_grad()
    def encode_padded(self, prompts: list[str] | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, text_len, D) in the model's dtype and (B, text_len) int64 mask; a prompt without quoted
        text gets zeros and an all-zero mask (diffusers `_get_byt5_prompt_embeds`, Tencent
        `_process_single_byt5_prompt`, which runs each prompt alone; we run those with glyphs together,
        every row padded to text_len as there)."""
        prompts = _check_prompts(prompts)
        if not prompts:
            raise ValueError("encode_padded needs at least one prompt")
        texts = [glyph_prompt(p) for p in prompts]
        out = torch.zeros(len(prompts), self.text_len, self.dim, dtype=self.dtype, device=self.device)
        mask = torch.zeros(len(prompts), self.text_len, dtype=torch.int64, device=self.device)
        rows = [i for i, t in enumerate(texts) if t is not None]
        if rows:
            tokens = self.tokenizer([texts[i] for i in rows], padding="max_length", max_length=self.text_len,
                                    truncation=True, add_special_tokens=True, return_tensors="pt")
            ids, m = tokens["input_ids"].to(self.device), tokens["attention_mask"].to(self.device)
            out[rows] = self.model(input_ids=ids, attention_mask=m.float())[0].to(out.dtype)  # (b, text_len, D)
            mask[rows] = m
        return out, mask

    def encode(self, prompts: list[str] | str) -> list[torch.Tensor]:
        """One (Lg_i, D) tensor per prompt: its glyph prompt's tokens with EOS (0 <= Lg_i <= text_len)."""
        prompts = _check_prompts(prompts)
        if not prompts:
            return []
        hidden, mask = self.encode_padded(prompts)
        return [h[:n] for h, n in zip(hidden, mask.sum(dim=1).tolist())]


# ---------------------------------------------------------------- both text encoders


class HY15PromptEmbeds(NamedTuple):
    """One prompt's embeds as the DiT reads them: Qwen2.5-VL states (Lt, text_dim) and ByT5 glyph states
    (Lg, glyph_dim), Lg = 0 when the prompt quotes nothing."""

    text: torch.Tensor
    glyph: torch.Tensor


class HY15PromptEncoder(nn.Module):
    """Both text encoders of HunyuanVideo 1.5 behind one `encode(prompts) -> [HY15PromptEmbeds]`, the
    family's text encoder for `video-dit sample` (what a cache would store per caption: two tensors)."""

    def __init__(self, text: HY15TextEncoder, glyph: HY15GlyphEncoder):
        super().__init__()
        self.text, self.glyph = text, glyph

    @property
    def dtype(self) -> torch.dtype:
        """The Qwen2.5-VL text model's activation dtype (what a cache of its states records)."""
        return self.text.dtype

    @property
    def device(self) -> torch.device:
        return self.text.device

    def encode(self, prompts: list[str] | str) -> list[HY15PromptEmbeds]:
        prompts = _check_prompts(prompts)
        return [HY15PromptEmbeds(t, g) for t, g in zip(self.text.encode(prompts), self.glyph.encode(prompts))]


# ---------------------------------------------------------------- SigLIP image embeds


def siglip_processor(image_size: int = 384, **overrides):
    """transformers' PIL-backed SigLIP image processor (bicubic resize to image_size^2, x / 255,
    mean = std = 0.5). The PIL backend, not the torchvision one transformers 5 prefers when torchvision
    is installed: the references ran transformers 4's `SiglipImageProcessor`, which is this one."""
    from transformers import SiglipImageProcessorPil

    return SiglipImageProcessorPil(**{"size": {"height": image_size, "width": image_size}, **overrides})


def to_uint8_images(images: torch.Tensor):
    """(N, 3, H, W) in [-1, 1] -> N (H, W, 3) uint8 arrays as Tencent's train.py `encode_images` makes
    them: (x + 1) / 2 * 255, clipped, truncated (not rounded)."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be (N, 3, H, W) in [-1, 1], got {tuple(images.shape)}")
    arr = (((images.detach().float().cpu() + 1) / 2).permute(0, 2, 3, 1).numpy() * 255).clip(0, 255)
    return list(arr.astype("uint8"))


class HY15ImageEncoder(EncoderWrapper):
    """A frozen SigLIP vision model and its image processor: `encode(images) -> (N, tokens, D)`.

    model: a transformers `SiglipVisionModel` (possibly quantized); processor: its image processor
    (`siglip_processor`, or one read from a `feature_extractor/` folder).
    The image is the conditioning frame as the video has it (the references first resize and
    centre-crop it to the generation size: Tencent with LANCZOS, diffusers' `resize_mode="crop"`);
    the processor then resizes it to the model's input size.
    """

    def __init__(self, model: nn.Module, processor):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.processor = processor

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def tokens(self) -> int:
        return (int(self.model.config.image_size) // int(self.model.config.patch_size)) ** 2

    def preprocess(self, images) -> torch.Tensor:
        """PIL image(s), (H, W, 3) uint8 array(s), or a (N, 3, H, W) tensor in [-1, 1] (converted as
        `to_uint8_images`) -> pixel values (N, 3, S, S) float32."""
        if isinstance(images, torch.Tensor):
            images = to_uint8_images(images)
        elif not isinstance(images, (list, tuple)):
            images = [images]
        return self.processor.preprocess(images=list(images), do_resize=True, do_convert_rgb=True,
                                         return_tensors="pt")["pixel_values"]

    @torch.no_grad()
    def encode(self, images) -> torch.Tensor:
        """-> (N, tokens, dim) in the model's dtype: SigLIP's `last_hidden_state` (post-layernorm, no
        pooling head), diffusers' `_get_image_embeds` / Tencent's `VisionEncoder.encode_images`."""
        pixels = self.preprocess(images).to(device=self.device, dtype=self.dtype)
        return self.model(pixel_values=pixels).last_hidden_state  # (N, tokens, dim)


def t2v_image_embeds(batch: int, tokens: int = IMAGE_TOKENS, dim: int = IMAGE_DIM, dtype=torch.float32,
                     device=None) -> torch.Tensor:
    """The image embeds of text-to-video: zeros (batch, tokens, dim), which the DiT recognises
    (`torch.all(image_embeds == 0)`) and masks out (diffusers t2v `__call__`, Tencent
    `_prepare_vision_states` with no reference image)."""
    return torch.zeros(batch, tokens, dim, dtype=dtype, device=device)


# ---------------------------------------------------------------- tiny seeded encoders (tests, presets)

# Qwen's chat format for string contents, the part of Qwen2.5-VL's template a text prompt uses.
TINY_CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                      "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_qwen_tokenizer():
    """A byte-level BPE tokenizer with no merges (one token per UTF-8 byte, ids 0..255) plus Qwen's
    special tokens <|endoftext|> (pad, 256), <|im_start|> (257), <|im_end|> (258) and its chat format;
    built in code, no files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"],
                                   chat_template=TINY_CHAT_TEMPLATE, padding_side="right")


def tiny_qwen_text_model(seed: int = 0, device=None, vocab_size: int = 259):
    """A 4-block, width-32 `Qwen2_5_VLTextModel` (multimodal RoPE sections [1, 1, 2] of head dim 8),
    seeded on CPU with the global RNG untouched, then moved to `device`."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    config = Qwen2_5_VLTextConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                   "mrope_section": [1, 1, 2]},
                                  bos_token_id=256, eos_token_id=258, pad_token_id=256)
    return build_transformers_model(Qwen2_5_VLTextModel, config, seed, device)


def tiny_hy15_text_encoder(seed: int = 0, device=None, text_len: int = TEXT_LEN, template: str = "video"):
    """`HY15TextEncoder` over `tiny_qwen_text_model(seed)` and `tiny_qwen_tokenizer()`."""
    return HY15TextEncoder(tiny_qwen_text_model(seed, device), tiny_qwen_tokenizer(), text_len, template)


def tiny_t5_encoder(seed: int = 0, device=None, vocab_size: int = 384):
    """A 2-block, width-32 gated-GELU `T5EncoderModel` (ByT5's layout; 384 ids: ByT5's tokenizer),
    seeded on CPU with the global RNG untouched."""
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=vocab_size, d_model=32, d_ff=64, d_kv=8, num_layers=2, num_heads=4,
                      feed_forward_proj="gated-gelu", is_encoder_decoder=False, pad_token_id=0, eos_token_id=1)
    return build_transformers_model(T5EncoderModel, config, seed, device)


def tiny_hy15_glyph_encoder(seed: int = 0, device=None, text_len: int = GLYPH_LEN):
    """`HY15GlyphEncoder` over `tiny_t5_encoder(seed)` and transformers' ByT5 tokenizer (no files)."""
    from transformers import ByT5Tokenizer

    return HY15GlyphEncoder(tiny_t5_encoder(seed, device), ByT5Tokenizer(), text_len)


def tiny_hy15_prompt_encoder(seed: int = 0, device=None, text_len: int = TEXT_LEN):
    """`HY15PromptEncoder` over the tiny text and glyph encoders (`seed` for both)."""
    return HY15PromptEncoder(tiny_hy15_text_encoder(seed, device, text_len), tiny_hy15_glyph_encoder(seed, device))


def tiny_siglip(seed: int = 0, device=None):
    """A 2-block, width-32 `SiglipVisionModel` on 32 x 32 images in 8 x 8 patches (16 tokens),
    seeded on CPU with the global RNG untouched."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    config = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=32, patch_size=8)
    return build_transformers_model(SiglipVisionModel, config, seed, device)


def tiny_hy15_image_encoder(seed: int = 0, device=None):
    """`HY15ImageEncoder` over `tiny_siglip(seed)` and a SigLIP processor for 32 x 32."""
    return HY15ImageEncoder(tiny_siglip(seed, device), siglip_processor(32))


# ---------------------------------------------------------------- sizes without files (the memory plan)

# The released encoders' architectures, from their config.json on the Hub: Qwen/Qwen2.5-VL-7B-Instruct's
# language model (text_config), google/byt5-small's encoder (Glyph-SDXL-v2's ByT5; its few added colour and
# font tokens aside), google/siglip-so400m-patch14-384's vision tower (FLUX.1-Redux's image encoder).
QWEN25_VL_7B_TEXT = dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4)
BYT5_SMALL_ENCODER = dict(vocab_size=384, d_model=1472, d_ff=3584, d_kv=64, num_layers=12, num_heads=6,
                          feed_forward_proj="gated-gelu", is_encoder_decoder=False)
SIGLIP_SO400M = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                     image_size=384, patch_size=14)


def encoder_parameters(text: HY15TextEncoderConfig, image: HY15ImageEncoderConfig | None) -> dict[str, int]:
    """Parameter counts of a preset's encoders, built on the meta device (the tiny ones as built for
    tests): {"text_encoder": Qwen2.5-VL's language model + the ByT5 encoder, "image_encoder": SigLIP or 0}."""
    from transformers import (
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        SiglipVisionConfig,
        SiglipVisionModel,
        T5Config,
        T5EncoderModel,
    )

    def count(model) -> int:
        return sum(p.numel() for p in model.parameters())

    if text.tiny:
        te = count(tiny_qwen_text_model(device="meta")) + count(tiny_t5_encoder(device="meta"))
    else:
        with torch.device("meta"):
            te = (count(Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**QWEN25_VL_7B_TEXT)))
                  + count(T5EncoderModel(T5Config(**BYT5_SMALL_ENCODER))))
    clip = 0
    if image is not None and image.tiny:
        clip = count(tiny_siglip(device="meta"))
    elif image is not None:
        with torch.device("meta"):
            clip = count(SiglipVisionModel(SiglipVisionConfig(**SIGLIP_SO400M)))
    return {"text_encoder": te, "image_encoder": clip}


# ---------------------------------------------------------------- loaders (local diffusers folders only)

REPO_T2V = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v"
REPO_I2V = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v"


def _download(repo: str, parts: tuple[str, ...]) -> str:
    include = " ".join(f"'{p}/*'" for p in parts)
    return (f"download them (no network is used here): huggingface-cli download {repo} --include {include} "
            f"--local-dir MODELS/hunyuanvideo-1.5 and pass MODELS/hunyuanvideo-1.5")


def _parts(source: str | os.PathLike, parts: dict[str, str], repo: str) -> dict[str, Path]:
    """The component folders `parts` ({folder: what it holds}) of the diffusers pipeline folder
    `source`; a `WeightsError` naming the path, the missing folders and the download otherwise."""
    path = Path(source)
    download = _download(repo, tuple(parts))
    if not path.is_dir():
        raise WeightsError(f"{path}: no such folder; expected a HunyuanVideo 1.5 diffusers folder holding "
                           f"{', '.join(f'{k}/ ({v})' for k, v in parts.items())}; {download}")
    missing = [f"{k}/ ({v})" for k, v in parts.items()
               if not (path / k).is_dir() or not any((path / k).iterdir())]
    if missing:
        raise WeightsError(f"{path}: missing {', '.join(missing)}; {download}")
    return {k: path / k for k in parts}


def load_hy15_text_encoder(path: str | os.PathLike, dtype: torch.dtype | None = None, device=None,
                           quantize: str | None = None, text_len: int = TEXT_LEN,
                           template: str = "video") -> HY15TextEncoder:
    """`HY15TextEncoder` from a diffusers HunyuanVideo 1.5 folder: `text_encoder/` (a
    `Qwen2_5_VLTextModel`: config.json + safetensors) and `tokenizer/`. dtype None keeps the stored
    dtype; quantize None, "qfloat8" or "qint8" (optimum-quanto weights, frozen)."""
    from transformers import AutoTokenizer, Qwen2_5_VLTextModel

    check_quantize(quantize)
    parts = _parts(path, {"text_encoder": "Qwen2.5-VL-7B's language model", "tokenizer": "its tokenizer"}, REPO_T2V)
    model = Qwen2_5_VLTextModel.from_pretrained(str(parts["text_encoder"]), local_files_only=True,
                                                dtype=dtype if dtype is not None else "auto")
    tokenizer = AutoTokenizer.from_pretrained(str(parts["tokenizer"]), local_files_only=True, padding_side="right")
    encoder = HY15TextEncoder(model.to(device), tokenizer, text_len, template)
    quantize_encoder(encoder.model, quantize)
    return encoder


def load_hy15_glyph_encoder(path: str | os.PathLike, dtype: torch.dtype | None = None, device=None,
                            quantize: str | None = None) -> HY15GlyphEncoder:
    """`HY15GlyphEncoder` from a diffusers HunyuanVideo 1.5 folder: `text_encoder_2/` (a
    `T5EncoderModel`, ByT5-small with Glyph-SDXL-v2 weights) and `tokenizer_2/` (ByT5's, with the
    colour and font tokens)."""
    from transformers import AutoTokenizer, T5EncoderModel

    check_quantize(quantize)
    parts = _parts(path, {"text_encoder_2": "the Glyph-SDXL-v2 ByT5 encoder", "tokenizer_2": "its ByT5 tokenizer"},
                   REPO_T2V)
    model = T5EncoderModel.from_pretrained(str(parts["text_encoder_2"]), local_files_only=True,
                                           dtype=dtype if dtype is not None else "auto")
    tokenizer = AutoTokenizer.from_pretrained(str(parts["tokenizer_2"]), local_files_only=True)
    encoder = HY15GlyphEncoder(model.to(device), tokenizer)
    quantize_encoder(encoder.model, quantize)
    return encoder


def load_hy15_image_encoder(path: str | os.PathLike, dtype: torch.dtype | None = None, device=None,
                            quantize: str | None = None) -> HY15ImageEncoder:
    """`HY15ImageEncoder` from a diffusers HunyuanVideo 1.5 i2v folder: `image_encoder/` (a
    `SiglipVisionModel`) and, when present, `feature_extractor/` (its preprocessor_config.json gives
    size, resample, mean and std; without it, SigLIP's defaults at the model's image size)."""
    from transformers import SiglipImageProcessorPil, SiglipVisionModel

    check_quantize(quantize)
    parts = _parts(path, {"image_encoder": "the SigLIP vision model of FLUX.1-Redux"}, REPO_I2V)
    model = SiglipVisionModel.from_pretrained(str(parts["image_encoder"]), local_files_only=True,
                                              dtype=dtype if dtype is not None else "auto")
    processor_dir = Path(path) / "feature_extractor"
    if (processor_dir / "preprocessor_config.json").is_file():
        processor = SiglipImageProcessorPil.from_pretrained(str(processor_dir), local_files_only=True)
    else:
        processor = siglip_processor(int(model.config.image_size))
    encoder = HY15ImageEncoder(model.to(device), processor)
    quantize_encoder(encoder.model, quantize)
    return encoder


def load_hy15_prompt_encoder(path: str | os.PathLike, dtype: torch.dtype | None = None, device=None,
                             quantize: str | None = None) -> HY15PromptEncoder:
    """`HY15PromptEncoder` from a diffusers HunyuanVideo 1.5 folder (`load_hy15_text_encoder` and
    `load_hy15_glyph_encoder`: text_encoder/ + tokenizer/, text_encoder_2/ + tokenizer_2/)."""
    return HY15PromptEncoder(load_hy15_text_encoder(path, dtype, device, quantize),
                             load_hy15_glyph_encoder(path, dtype, device, quantize))
