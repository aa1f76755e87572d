"""The umT5 text encoder wrapper. Body: see issue 4 (being written)."""

from __future__ import annotations

from dataclasses import dataclass


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
