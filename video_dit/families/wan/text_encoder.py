"""The umT5 text encoder wrapper: prompts -> one (Lt_i, D) embedding per prompt.

    prompts [str] --clean (html unescape, collapse whitespace)--> tokenizer (pad to text_len, truncate)
      --> UMT5EncoderModel (B, text_len) -> (B, text_len, D) --cut each row at its token count--> [(Lt_i, D)]

Wan pads every prompt to `text_len` (512) with an attention mask and keeps only the real tokens; we
do the same, so a prompt's embedding has its natural length (no padding stored) and, because every
row is computed at the same padded shape, is the same alone or in any batch. The DiT zero-pads the
list back to `text_len`, exactly as the pretrained models saw it.
File loading lives in `loading.load_text_encoder`; this file holds only the network wrapper.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass

import torch
from torch import nn

from video_dit.models.common import EncoderWrapper, build_transformers_model
from video_dit.typed_config import ConfigError


@dataclass
class TextEncoderConfig:
    """A transformers `UMT5Config` subset plus the tokenizer choice.

    `tokenizer = "byt5"` builds transformers' byte-level ByT5 tokenizer, which needs no vocabulary
    file (the `tiny` preset); `"umt5"` expects the umT5 tokenizer files next to the weights.
    """

    vocab_size: int = 256384
    d_model: int = 4096
    d_ff: int = 10240
    num_layers: int = 24
    num_heads: int = 64
    d_kv: int = 64
    relative_attention_num_buckets: int = 32
    feed_forward_proj: str = "gated-gelu"
    text_len: int = 512
    tokenizer: str = "umt5"

    def validate(self, path: str = "text_encoder") -> None:
        """Raise `ConfigError` naming the first bad field (called by `typed_config.parse`)."""
        for name in ("vocab_size", "d_model", "d_ff", "num_layers", "num_heads", "d_kv",
                     "relative_attention_num_buckets", "text_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{path}.{name}", f"must be a positive integer, got {getattr(self, name)}")
        if self.tokenizer not in ("umt5", "byt5"):
            raise ConfigError(f"{path}.tokenizer", f"{self.tokenizer!r} is not accepted; accepted: 'umt5', 'byt5'")
        if self.feed_forward_proj not in ("gated-gelu", "relu", "gated-relu", "gelu"):
            raise ConfigError(f"{path}.feed_forward_proj", f"{self.feed_forward_proj!r} is not accepted; "
                                                           "accepted: 'gated-gelu', 'gelu', 'gated-relu', 'relu'")


def umt5_config(config: TextEncoderConfig):
    """The transformers `UMT5Config` of an encoder-only umT5 described by `config`."""
    from transformers import UMT5Config

    return UMT5Config(vocab_size=config.vocab_size, d_model=config.d_model, d_ff=config.d_ff,
                      num_layers=config.num_layers, num_heads=config.num_heads, d_kv=config.d_kv,
                      relative_attention_num_buckets=config.relative_attention_num_buckets,
                      feed_forward_proj=config.feed_forward_proj, is_encoder_decoder=False,
                      pad_token_id=0, eos_token_id=1)


def build_umt5(config: TextEncoderConfig, seed: int | None = 0, device: str | torch.device | None = None):
    """A `UMT5EncoderModel` in eval mode: randomly initialised from `seed` (transformers' T5 init,
    same weights for the same seed, global RNG untouched), or on the meta device when `device="meta"`
    (for loading a state dict with `assign=True`)."""
    from transformers import UMT5EncoderModel

    config.validate()
    return build_transformers_model(UMT5EncoderModel, umt5_config(config), seed, device)


def byte_tokenizer():
    """transformers' byte-level ByT5 tokenizer: needs no vocabulary file (ids 0 pad, 1 eos, 2 unk,
    3..258 bytes, 384 ids in all with its extra ids), for the tiny preset."""
    from transformers import ByT5Tokenizer

    return ByT5Tokenizer()


def clean_prompt(text: str) -> str:
    """Wan's prompt cleaning without ftfy: HTML entities unescaped, whitespace collapsed and stripped."""
    return re.sub(r"\s+", " ", html.unescape(html.unescape(text))).strip()


class TextEncoder(EncoderWrapper):
    """A umT5 encoder and its tokenizer: `encode(prompts) -> [(Lt_i, D)]`.

    model: a transformers `UMT5EncoderModel` (possibly quantized); tokenizer: a transformers
    tokenizer (umT5's, or ByT5's for the tiny preset); text_len: tokens per prompt at most (Wan: 512;
    longer prompts are truncated, as in Wan).
    """

    def __init__(self, model: nn.Module, tokenizer, text_len: int = 512):
        super().__init__()
        if text_len < 1:
            raise ValueError(f"text_len must be >= 1, got {text_len}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.text_len = text_len

    @property
    def dim(self) -> int:
        return self.model.config.d_model

    @torch.no_grad()
    def encode(self, prompts: list[str] | str) -> list[torch.Tensor]:
        """One (Lt_i, D) tensor per prompt, Lt_i = its token count with EOS (1 <= Lt_i <= text_len),
        in the model's dtype and on its device. A bare string is treated as a list of one."""
        if isinstance(prompts, str):
            prompts = [prompts]
        for i, p in enumerate(prompts):
            if not isinstance(p, str):
                raise TypeError(f"prompts[{i}] must be a string, got {type(p).__name__}")
        if not prompts:
            return []
        batch = self.tokenizer([clean_prompt(p) for p in prompts], padding="max_length", truncation=True,
                               max_length=self.text_len, add_special_tokens=True,
                               return_attention_mask=True, return_tensors="pt")
        ids, mask = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, text_len, D)
        return [h[:n] for h, n in zip(hidden, mask.sum(dim=1).tolist())]
