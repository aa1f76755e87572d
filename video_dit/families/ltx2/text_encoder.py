"""LTX-2's prompt encoder: Gemma 3 (transformers, frozen) and the text connectors, prompt -> the video and
audio context its DiT reads.

    prompt --strip; Gemma tokenizer, <bos> first, truncated to 1024 tokens; left padded to 1024 with <pad>-->
      ids, mask (B, 1024)
      --Gemma 3's language model (12B: 48 blocks, width 3840), every hidden state: the scaled embeddings and
        each block's output (the last after the final norm)--> stacked (B, 1024, 3840, 49)      [LTX2TextEncoder]
      --connectors (`connectors.py`: normalise, project, registers, 2 blocks per stream)-->
      video (B, 1024, 3840), audio (B, 1024, 3840); every row is context               [LTX2PromptEncoder]

References: diffusers `LTX2Pipeline._get_gemma_prompt_embeds` / `encode_prompt` and the connectors call in
`__call__` (pipelines/ltx2/pipeline_ltx2.py); ltx-core `LTXGemmaTokenizer.tokenize_with_weights`,
`LTXGemmaTextEncoder.encode` (`max_length` 1024, `PaddingSide.LEFT`), `EmbeddingsProcessor`. The two agree
for Gemma 3: diffusers pads through the tokenizer, ltx-core tokenizes unpadded, prepends <bos> if the
tokenizer did not, then left-pads; we do the latter (the same ids, and a tokenizer without a <bos>
post-processor, Gemma 4's, still gets one). ltx-core runs the multimodal model's inner `model` with text
only; we keep only its language model (`Gemma3TextModel`): the same hidden states (tested), without the
vision tower and the LM head. Loaders read only through transformers' `from_pretrained`, never the network.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from video_dit.families.ltx2.connectors import TINY_CONNECTORS, ConnectorConfig, LTX2TextConnectors
from video_dit.models.common import EncoderWrapper, build_transformers_model, check_quantize, quantize_encoder
from video_dit.models.weights import WeightsError

MAX_LENGTH = 1024  # prompt tokens (ltx-core gemma_assets.TOKENIZER_MAX_LENGTH, diffusers max_sequence_length)


@dataclass(frozen=True)
class LTX2TextEncoderConfig:
    """The Gemma a preset's connectors read: `hidden_size` x (`num_layers` + 1) states of `max_length`
    tokens. `tiny`: the tiny seeded Gemma (`tiny_gemma3_text_model`) instead of files."""

    hidden_size: int = 3840
    num_layers: int = 48
    max_length: int = MAX_LENGTH
    tiny: bool = False


LTX2_GEMMA = LTX2TextEncoderConfig()  # google/gemma-3-12b-it(-qat-q4_0-unquantized)'s text config
TINY_GEMMA = LTX2TextEncoderConfig(hidden_size=16, num_layers=2, max_length=32, tiny=True)

# Gemma 3 12B's language model (transformers `Gemma3TextConfig` keys) as google/gemma-3-12b-it's config.json
# "text_config" has it; quoted from ai-toolkit's extensions_built_in/diffusion_models/ltx2/ltx2.py (mirror
# commit of /work/.mirror/ostris+ai-toolkit), which builds it for ComfyUI's single Gemma file. What the memory
# plan counts when the Gemma's files are not on the machine (`gemma3_12b_parameters`).
GEMMA3_12B_TEXT = dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=256, vocab_size=262208, query_pre_attn_scalar=256,
                       sliding_window=1024, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh")


def gemma3_12b_parameters() -> int:
    """The parameters of Gemma 3 12B's language model (`GEMMA3_12B_TEXT`), built on the meta device."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    with torch.device("meta"):
        model = Gemma3TextModel(Gemma3TextConfig(**GEMMA3_12B_TEXT))
    return sum(p.numel() for p in model.parameters())


def _check_prompts(prompts) -> list[str]:
    if isinstance(prompts, str):
        prompts = [prompts]
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise TypeError(f"prompts[{i}] must be a string, got {type(p).__name__}")
    return list(prompts)


class LTX2TextEncoder(EncoderWrapper):
    """Gemma 3's language model and tokenizer -> the stacked hidden states LTX-2's connectors read.

    model: a transformers `Gemma3TextModel` (possibly quantized, frozen here); tokenizer: Gemma's (its
    <bos>, <eos>, <pad>; <eos> pads when it has no pad token, as both references set); max_length: tokens
    per prompt after truncation, <bos> included (1024)."""

    def __init__(self, model: nn.Module, tokenizer, max_length: int = MAX_LENGTH):
        super().__init__()
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2 (<bos> and a token), got {max_length}")
        if tokenizer.bos_token_id is None:
            raise ValueError("the tokenizer has no <bos> token; LTX-2 encodes every prompt after a leading <bos>")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_length = max_length

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def num_states(self) -> int:
        """Hidden states stacked: the embeddings and every block's output."""
        return int(self.model.config.num_hidden_layers) + 1

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask), each (B, max_length) int64 on the model's device, left padded."""
        bos, pad, n = self.tokenizer.bos_token_id, self.tokenizer.pad_token_id, self.max_length
        rows = self.tokenizer([p.strip() for p in prompts], padding=False, truncation=True, max_length=n)["input_ids"]
        rows = [(r if r and r[0] == bos else [bos, *r])[:n] for r in rows]
        ids = torch.tensor([[pad] * (n - len(r)) + r for r in rows], dtype=torch.int64)
        mask = torch.tensor([[0] * (n - len(r)) + [1] * len(r) for r in rows], dtype=torch.int64)
        return ids.to(self.device), mask.to(self.device)

    @torch.no_grad()
    def hidden_states(self, prompts: list[str] | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, max_length, D, num_states) in the model's dtype and the (B, max_length) int64 mask."""
        prompts = _check_prompts(prompts)
        if not prompts:
            raise ValueError("hidden_states needs at least one prompt")
        ids, mask = self.tokenize(prompts)
        out = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        return torch.stack(out.hidden_states, dim=-1), mask                            # (B, Lt, D, N + 1)

    def encode_padded(self, prompts: list[str] | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, max_length, D * num_states), (B, max_length): diffusers' `encode_prompt` `prompt_embeds`
        (each channel's states side by side) and `prompt_attention_mask`."""
        states, mask = self.hidden_states(prompts)
        return states.flatten(2), mask


class LTX2PromptEmbeds(NamedTuple):
    """One prompt's DiT context: video (Lt, Dv), audio (Lt, Da)."""

    video: torch.Tensor
    audio: torch.Tensor


class LTX2PromptEncoder(nn.Module):
    """Gemma 3 + the connectors: `encode(prompts) -> [LTX2PromptEmbeds]`, what a trainer caches per caption
    (each (max_length, D): the prompt's tokens, then registers; all rows context), or `encode_padded`,
    the batched (B, Lt, Dv), (B, Lt, Da). The connectors are frozen here (ltx-trainer trains neither).
    The connectors compute in their own dtype; the Gemma states are cast to it."""

    def __init__(self, text_encoder: LTX2TextEncoder, connectors: LTX2TextConnectors):
        super().__init__()
        c = connectors.config
        if (c.caption_channels, c.text_states) != (text_encoder.dim, text_encoder.num_states):
            raise ValueError(f"the connectors read {c.text_states} states of width {c.caption_channels}; the text "
                             f"encoder gives {text_encoder.num_states} of width {text_encoder.dim}")
        self.text_encoder = text_encoder
        self.connectors = connectors.eval().requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:  # the Gemma's (the trainer names its caches by it)
        return next(self.text_encoder.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.text_encoder.parameters()).device

    @torch.no_grad()
    def encode_padded(self, prompts: list[str] | str) -> tuple[torch.Tensor, torch.Tensor]:
        """video (B, max_length, Dv), audio (B, max_length, Da) in the connectors' dtype."""
        states, mask = self.text_encoder.hidden_states(prompts)
        return self.connectors(states, mask)

    def encode(self, prompts: list[str] | str) -> list[LTX2PromptEmbeds]:
        """One `LTX2PromptEmbeds` per prompt, the same alone or in any batch (each row's normalisation reads
        only its own tokens; Gemma is causal and the padding is masked)."""
        prompts = _check_prompts(prompts)
        if not prompts:
            return []
        video, audio = self.encode_padded(prompts)
        return [LTX2PromptEmbeds(v, a) for v, a in zip(video, audio)]


# ---------------------------------------------------------------- tiny seeded encoders (tests, presets)


def tiny_gemma3_tokenizer():
    """A byte-level BPE tokenizer with no merges (one token per UTF-8 byte, ids 0..255) plus Gemma's special
    tokens <pad> (256), <eos> (257), <bos> (258), and Gemma's post-processor: <bos> before every text.
    Built in code, no files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<eos>", "<bos>"])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", 258)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   padding_side="left")


def tiny_gemma3_config(vocab_size: int = 259):
    """A `Gemma3Config`: a 2-block, 16-wide text model (one sliding-window layer of window 4, one global),
    and a 1-block vision tower that text prompts never reach."""
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=TINY_GEMMA.hidden_size, intermediate_size=32,
                            num_hidden_layers=TINY_GEMMA.num_layers, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=8, max_position_embeddings=256, sliding_window=4,
                            layer_types=["sliding_attention", "full_attention"], pad_token_id=256, eos_token_id=257,
                            bos_token_id=258)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=16, patch_size=8)
    return Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)


def tiny_gemma3(seed: int = 0, device=None):
    """The whole tiny `Gemma3ForConditionalGeneration` (what diffusers' pipeline holds), seeded on the CPU
    with the global RNG untouched."""
    from transformers import Gemma3ForConditionalGeneration

    return build_transformers_model(Gemma3ForConditionalGeneration, tiny_gemma3_config(), seed, device)


def tiny_gemma3_text_model(seed: int = 0, device=None):
    """The language model of `tiny_gemma3(seed)` (the same weights)."""
    return tiny_gemma3(seed, device).model.language_model


def tiny_ltx2_text_encoder(seed: int = 0, device=None, max_length: int = TINY_GEMMA.max_length):
    return LTX2TextEncoder(tiny_gemma3_text_model(seed, device), tiny_gemma3_tokenizer(), max_length)


def tiny_ltx2_prompt_encoder(seed: int = 0, device=None, max_length: int = TINY_GEMMA.max_length,
                             connectors: ConnectorConfig = TINY_CONNECTORS):
    """`LTX2PromptEncoder` over the tiny Gemma and `LTX2TextConnectors(connectors, seed)`."""
    return LTX2PromptEncoder(tiny_ltx2_text_encoder(seed, device, max_length),
                             LTX2TextConnectors(connectors, seed=seed).to(device))


# ---------------------------------------------------------------- loaders (local folders only)

GEMMA_REPO = "google/gemma-3-12b-it-qat-q4_0-unquantized"  # the Gemma 3 of LTX-2 / 2.3 (diffusers' converter default)
DIFFUSERS_REPO = "Lightricks/LTX-2"


def _gemma_folders(source: str | os.PathLike) -> tuple[Path, Path]:
    """(model folder, tokenizer folder) of a Gemma 3 folder (config.json + weights + tokenizer files) or of
    a diffusers LTX-2 folder (text_encoder/ + tokenizer/); a `WeightsError` naming what to put where."""
    path = Path(source)
    download = (f"download it (no network is used here): huggingface-cli download {GEMMA_REPO} --local-dir "
                f"MODELS/gemma-3-12b, or huggingface-cli download {DIFFUSERS_REPO} --include 'text_encoder/*' "
                "'tokenizer/*' --local-dir MODELS/ltx-2, and pass that folder")
    if (path / "text_encoder").is_dir():
        if not (path / "tokenizer").is_dir():
            raise WeightsError(f"{path}: has text_encoder/ but no tokenizer/ (Gemma 3's tokenizer); {download}")
        return path / "text_encoder", path / "tokenizer"
    if not path.is_dir():
        raise WeightsError(f"{path}: no such folder; expected Gemma 3 (12B) as a transformers folder (config.json, "
                           f"*.safetensors, tokenizer.json) or a diffusers LTX-2 folder; {download}")
    if not (path / "config.json").is_file():
        raise WeightsError(f"{path}: no config.json and no text_encoder/: not a Gemma 3 or LTX-2 folder; {download}")
    return path, path


def load_ltx2_text_encoder(path: str | os.PathLike, dtype: torch.dtype | None = None, device=None,
                           quantize: str | None = None, max_length: int = MAX_LENGTH) -> LTX2TextEncoder:
    """`LTX2TextEncoder` from a Gemma 3 folder or a diffusers LTX-2 folder (`_gemma_folders`). The checkpoint
    is the multimodal `Gemma3ForConditionalGeneration`: it is loaded whole, then only its language model is
    kept (the vision tower and the LM head are freed). dtype None keeps the stored dtype; quantize None,
    "qfloat8" or "qint8" (optimum-quanto weights, frozen)."""
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration

    check_quantize(quantize)
    model_dir, tokenizer_dir = _gemma_folders(path)
    full = Gemma3ForConditionalGeneration.from_pretrained(str(model_dir), local_files_only=True,
                                                          dtype=dtype if dtype is not None else "auto")
    model = full.model.language_model
    del full
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    encoder = LTX2TextEncoder(model.to(device), tokenizer, max_length)
    quantize_encoder(encoder.model, quantize)
    return encoder
