"""The stand-in family's text encoder: the prompt's UTF-8 bytes, embedded (no tokenizer, no transformer).

    prompt -> bytes[:max_len - 1] + [END] (ids 0..256)      (Lt,)   Lt = min(len(bytes) + 1, max_len)
           -> byte_embed(ids) + position_embed(0..Lt-1)      (Lt, dim) float32
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from video_dit.models.common import initialize_by_name

END = 256  # the id closing every prompt (the empty prompt is END alone)


@dataclass(frozen=True)
class ByteTextConfig:
    dim: int = 16
    max_len: int = 16


@torch.no_grad()
def _init(cfg, name: str, t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return t.copy_(torch.randn(t.shape, generator=generator) * 0.5)  # N(0, 0.25): embeddings of unit-ish scale


class ByteTextEncoder(nn.Module):
    def __init__(self, config: ByteTextConfig, init_seed: int | None = None):
        super().__init__()
        self.config = config
        self.byte_embed = nn.Embedding(END + 1, config.dim)
        self.position_embed = nn.Embedding(config.max_len, config.dim)
        initialize_by_name(self, _init, config, init_seed)

    @property
    def dtype(self) -> torch.dtype:
        return self.byte_embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.byte_embed.weight.device

    def ids(self, prompt: str) -> torch.Tensor:
        if not isinstance(prompt, str):
            raise TypeError(f"a prompt must be a string, got {type(prompt).__name__}")
        data = list(prompt.encode("utf-8"))[: self.config.max_len - 1] + [END]
        return torch.tensor(data, dtype=torch.long, device=self.device)

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> list[torch.Tensor]:
        """One (Lt_i, dim) embedding per prompt, in the encoder's dtype."""
        out = []
        for prompt in prompts:
            ids = self.ids(prompt)
            out.append(self.byte_embed(ids) + self.position_embed(torch.arange(len(ids), device=self.device)))
        return out
