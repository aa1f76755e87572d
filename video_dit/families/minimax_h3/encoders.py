"""MiniMax H3's conditioner: Qwen3-VL (transformers, frozen), read after its 50th decoder layer.

    prompt (+ keyframe images) --the presentation: per image "<Picture i>: " then <|vision_start|>, one
      <|image_pad|> per merged 2x2 patch, <|vision_end|>; then the prompt verbatim; no chat template, no special
      tokens, no padding (one sequence per prompt)--> ids (1, Lt), modality tags (Lt,): 1 text, 0 vision block
      images --Qwen3-VL's image processor (resize to whole 32-pixel merged patches, normalise)--> pixel_values,
        image_grid_thw
      --Qwen3-VL (vision tower + language model with its image tokens' 3-axis RoPE and deepstack), the output of
        decoder layer 50 of 64, not normed (the last 14 layers and the final norm are never run)--> (Lt, 5120)
                                                                                         [H3TextEncoder.encode]

That hidden state and the tags are what the DiT reads for the text rows of its packed sequence (`text_token_tags`
key its AdaLN: text rows 1, a vision block's rows 0 like video). The checkpoint is guidance-distilled: there is no
negative prompt and no unconditional pass. `t2va` prompts carry no images; `fl2va` prompts carry the first and / or
last keyframe, already put on the target canvas (diffusers `MiniMaxH3ResizeStep`); a `ref2va` request whose
references are images presents them the same way (its audio and video references add labels and timestamped video
blocks, not built here).

References: diffusers modular_pipelines/minimax_h3/encoders.py (`get_qwen3vl_prompt_embeds`,
`MiniMaxH3TextEncoderStep`, `MiniMaxH3FL2VATextEncoderStep`, `_build_presentation`) and modular_pipeline.py
(`text_encoder_layer` 50, the modality tags). MiniMax's released code has no conditioner code (its
`MiniMaxH3Qwen3VLHFEncoder` is not in the repository), so diffusers' is followed. The token types Qwen3-VL reads
(0 text, 1 image, 2 video) are made from the ids here, as transformers' `ProcessorMixin.create_mm_token_type_ids`
makes them, so only the image processor is loaded, not the whole `Qwen3VLProcessor` (whose video processor needs
torchvision). Without torchvision transformers serves the PIL backend of that image processor.
Loaders read only local folders through transformers' `from_pretrained`, never the network.
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from video_dit.models.common import EncoderWrapper, build_transformers_model, check_quantize, quantize_encoder
from video_dit.models.weights import WeightsError

TEXT_LAYER = 50  # diffusers `MiniMaxH3ModularPipeline.text_encoder_layer`: hidden_states[50]
# Per-row modality tags of MiniMax H3's packed sequence (diffusers modular_pipeline.py); they index its DiT's AdaLN
VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"


@dataclass(frozen=True)
class H3TextEncoderConfig:
    """The conditioner a preset's DiT reads: `hidden_size`-wide states after decoder layer `layer`. `tiny`: the tiny
    seeded Qwen3-VL (`tiny_h3_text_encoder`) instead of files."""

    hidden_size: int = 5120
    layer: int = TEXT_LAYER
    tiny: bool = False
    # its image processor: pixels a side per image token (patch x merge) and the area an image is resized into
    # ([M] FL2VA/processor/preprocessor_config.json: patch_size 16, merge_size 2; shortest_edge 65,536 and
    # longest_edge 16,777,216 pixels of area)
    vision_cell: int = 32
    vision_area: tuple[int, int] = (65536, 16777216)


H3_QWEN3VL = H3TextEncoderConfig()  # MiniMaxAI/MiniMax-H3 text_encoder/: Qwen3-VL, 64 layers of 5120, vision 27 x 1152
# 51 layers of 32: layer 50 is read, as released; its processor `tiny_qwen3vl_image_processor`
TINY_QWEN3VL = H3TextEncoderConfig(hidden_size=32, tiny=True, vision_cell=8, vision_area=(64, 1024))


def vision_block_rows(config: H3TextEncoderConfig, height: int, width: int) -> int:
    """The rows of one keyframe's vision block in a presented prompt: <|vision_start|>, one <|image_pad|> per image
    token, <|vision_end|> (`H3TextEncoder.presentation`), for a height x width image resized as Qwen2-VL's image
    processor resizes it (transformers `qwen2_vl.image_processing_qwen2_vl.smart_resize`: each side rounded to a
    multiple of the token's pixels, the area then scaled into the processor's bounds). Its label ("<Picture 1>: ")
    is text rows, not counted here."""
    cell, (lo, hi) = config.vision_cell, config.vision_area
    h, w = round(height / cell) * cell, round(width / cell) * cell
    if h * w > hi:
        beta = math.sqrt(height * width / hi)
        h, w = max(cell, math.floor(height / beta / cell) * cell), max(cell, math.floor(width / beta / cell) * cell)
    elif h * w < lo:
        beta = math.sqrt(lo / (height * width))
        h, w = math.ceil(height * beta / cell) * cell, math.ceil(width * beta / cell) * cell
    return (h // cell) * (w // cell) + 2


class H3PromptEmbeds(NamedTuple):
    """One prompt's conditioning: `embeds` (Lt, D) in the model's dtype, `tags` (Lt,) int64 (TEXT_TAG or VIDEO_TAG)."""

    embeds: torch.Tensor
    tags: torch.Tensor


def _check_prompts(prompts) -> list[str]:
    if isinstance(prompts, str):
        prompts = [prompts]
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            raise TypeError(f"prompts[{i}] must be a string, got {type(p).__name__}")
    return list(prompts)


class H3TextEncoder(EncoderWrapper):
    """Qwen3-VL -> MiniMax H3's text rows: `encode(prompts, images=None) -> [H3PromptEmbeds]`, what a trainer caches
    per caption.

    model: a transformers `Qwen3VLModel` (vision tower + language model; possibly quantized, frozen here). Its
    language model is cut to `layer` decoder layers and its final norm removed, so its output is
    `hidden_states[layer]` of the whole model, pre-norm (diffusers reads that index off a full forward; the
    release's 64-layer model's last 14 layers never matter). tokenizer: Qwen3-VL's (Qwen2 BPE with the vision
    tokens). image_processor: Qwen3-VL's (`merge_size` patches merged per image token)."""

    def __init__(self, model: nn.Module, tokenizer, image_processor=None, layer: int = TEXT_LAYER):
        super().__init__()
        lm = model.language_model
        if len(lm.layers) < layer:
            raise ValueError(f"MiniMax H3 reads hidden_states[{layer}] of its Qwen3-VL, the output of decoder layer "
                             f"{layer}; this model has {len(lm.layers)} (the last hidden state of a stack of exactly "
                             f"{layer} is normed, which is not that output)")
        lm.layers = lm.layers[:layer]  # the rest never affect hidden_states[layer]
        lm.norm = nn.Identity()  # hidden_states[layer] is taken before the final norm
        self.model = model.eval().requires_grad_(False)
        self.tokenizer, self.image_processor, self.layer = tokenizer, image_processor, layer
        ids = {name: tokenizer.convert_tokens_to_ids(name) for name in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)}
        config = model.config
        for name, key in ((VISION_START, "vision_start_token_id"), (VISION_END, "vision_end_token_id"),
                          (IMAGE_PAD, "image_token_id"), (VIDEO_PAD, "video_token_id")):
            if ids[name] != getattr(config, key):
                raise ValueError(f"the tokenizer's {name} is id {ids[name]}, the model's {key} is "
                                 f"{getattr(config, key)}: not the tokenizer of this Qwen3-VL")
        self.ids = ids

    @property
    def dim(self) -> int:
        return int(self.model.config.text_config.hidden_size)

    def _text(self, value: str) -> list[int]:
        return self.tokenizer(value, add_special_tokens=False)["input_ids"]

    def presentation(self, prompt: str, images: list | None = None) -> tuple[list[int], list[int], dict]:
        """(token ids, modality tags, vision inputs) of one prompt: per image its label and vision block, then the
        prompt (diffusers `MiniMaxH3FL2VATextEncoderStep`; without images `MiniMaxH3TextEncoderStep`). The images
        (PIL) are processed as one batch, in the order given (the packed order: first, then last keyframe)."""
        ids, tags, vision = [], [], {}
        if images:
            if self.image_processor is None:
                raise ValueError("this H3TextEncoder has no image processor; load it with the model's processor/ "
                                 "folder to encode keyframes")
            out = self.image_processor(images=list(images), return_tensors="pt")
            vision = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
            merge = self.image_processor.merge_size ** 2
            for i, grid in enumerate(out["image_grid_thw"]):
                label = self._text(f"<Picture {i + 1}>: ")
                block = [self.ids[VISION_START]] + [self.ids[IMAGE_PAD]] * (int(grid.prod()) // merge) \
                    + [self.ids[VISION_END]]
                ids += label + block
                tags += [TEXT_TAG] * len(label) + [VIDEO_TAG] * len(block)
        text = self._text(prompt)
        ids += text
        tags += [TEXT_TAG] * len(text)
        return ids, tags, vision

    @torch.no_grad()
    def encode_one(self, prompt: str, images: list | None = None) -> H3PromptEmbeds:
        """One prompt (and its keyframes) -> `H3PromptEmbeds`: embeds (Lt, D), tags (Lt,)."""
        ids, tags, vision = self.presentation(prompt, images)
        if not ids:  # the empty prompt (a trainer's caption dropout): one pad token, as ai-toolkit's H3 trainer
            ids, tags = [self.tokenizer.pad_token_id or 0], [TEXT_TAG]  # presents it (text_encoder.py; no reference)
        device, dtype = self.device, self.dtype
        input_ids = torch.tensor([ids], dtype=torch.long, device=device)
        # Qwen3-VL's token types (0 text, 1 image, 2 video): its 3-axis RoPE over each run of vision tokens
        types = (input_ids == self.ids[IMAGE_PAD]).long() + 2 * (input_ids == self.ids[VIDEO_PAD]).long()
        kwargs = {k: v.to(device, dtype) if k.startswith("pixel_") else v.to(device) for k, v in vision.items()}
        out = self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), mm_token_type_ids=types,
                         use_cache=False, **kwargs)
        return H3PromptEmbeds(out.last_hidden_state[0], torch.tensor(tags, dtype=torch.long))  # (Lt, D), (Lt,)

    def encode(self, prompts: list[str] | str, images: list | None = None) -> list[H3PromptEmbeds]:
        """One `H3PromptEmbeds` per prompt, each its own sequence (MiniMax H3 packs one request into one sequence:
        no padding, no batch to share it with). `images`: None, or one entry per prompt, each None or a list of
        PIL keyframes on the target canvas in packed order."""
        prompts = _check_prompts(prompts)
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"images has {len(images)} entries for {len(prompts)} prompts; give one list (or None) "
                             "per prompt")
        return [self.encode_one(p, None if images is None else images[i]) for i, p in enumerate(prompts)]


# ---------------------------------------------------------------- tiny seeded encoders (tests, presets)


def tiny_qwen3vl_tokenizer():
    """A byte-level BPE tokenizer with no merges (one token per UTF-8 byte, ids 0..255) plus Qwen3-VL's special
    tokens <|endoftext|> (256), <|vision_start|> (257), <|vision_end|> (258), <|image_pad|> (259), <|video_pad|>
    (260). Built in code, no files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def tiny_qwen3vl_image_processor():
    """Qwen3-VL's image processor at 4-pixel patches (merged 2 x 2, so 8-pixel image tokens), images resized to
    64 .. 1024 pixels of area."""
    from transformers import Qwen2VLImageProcessor  # without torchvision, transformers serves its PIL backend

    lo, hi = TINY_QWEN3VL.vision_area  # the tiny conditioner's record: 4 x 2 = its 8-pixel `vision_cell`
    return Qwen2VLImageProcessor(patch_size=4, merge_size=2, temporal_patch_size=2,
                                 size={"shortest_edge": lo, "longest_edge": hi})


def tiny_qwen3vl_config(layers: int = TEXT_LAYER + 1):
    """A `Qwen3VLConfig`: a `layers`-deep (51: layer 50 is read as released), 32-wide language model (2 heads of 16,
    interleaved 3-axis RoPE 4 / 2 / 2) and a 2-block, 16-wide vision tower of 4-pixel patches with one deepstack
    layer, token ids of `tiny_qwen3vl_tokenizer`."""
    from transformers import Qwen3VLConfig

    text = dict(vocab_size=261, hidden_size=TINY_QWEN3VL.hidden_size, intermediate_size=64, num_hidden_layers=layers,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                 "mrope_interleaved": True})
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TINY_QWEN3VL.hidden_size,
                  patch_size=4, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16,
                  deepstack_visual_indexes=[0])
    return Qwen3VLConfig(text_config=text, vision_config=vision, vision_start_token_id=257, vision_end_token_id=258,
                         image_token_id=259, video_token_id=260)


def tiny_qwen3vl(seed: int = 0, device=None, layers: int = TEXT_LAYER + 1):
    """The whole tiny `Qwen3VLForConditionalGeneration` (what diffusers' pipeline holds), seeded on the CPU."""
    from transformers import Qwen3VLForConditionalGeneration

    return build_transformers_model(Qwen3VLForConditionalGeneration, tiny_qwen3vl_config(layers), seed, device)


def tiny_h3_text_encoder(seed: int = 0, device=None) -> H3TextEncoder:
    """`H3TextEncoder` over the `Qwen3VLModel` of `tiny_qwen3vl(seed)` (the same weights)."""
    return H3TextEncoder(tiny_qwen3vl(seed, device).model, tiny_qwen3vl_tokenizer(), tiny_qwen3vl_image_processor())


# ---------------------------------------------------------------- loaders (local folders only)

REPO = "MiniMaxAI/MiniMax-H3"


def _folders(source: str | os.PathLike) -> tuple[Path, Path, Path | None]:
    """(model, tokenizer, image processor) folders of a MiniMax H3 folder (text_encoder/, tokenizer/, processor/) or
    of one Qwen3-VL folder holding all three; a `WeightsError` naming what to put where."""
    path = Path(source)
    download = (f"download it (no network is used here): huggingface-cli download {REPO} --include 'text_encoder/*' "
                f"'tokenizer/*' 'processor/*' --local-dir MODELS/minimax-h3, and pass that folder")
    if (path / "text_encoder").is_dir():
        if not (path / "tokenizer").is_dir():
            raise WeightsError(f"{path}: has text_encoder/ but no tokenizer/ (Qwen3-VL's tokenizer); {download}")
        processor = path / "processor" if (path / "processor" / "preprocessor_config.json").is_file() else None
        return path / "text_encoder", path / "tokenizer", processor
    if not path.is_dir():
        raise WeightsError(f"{path}: no such folder; expected MiniMax H3's Qwen3-VL conditioner as a pipeline folder "
                           f"(text_encoder/, tokenizer/, processor/) or one Qwen3-VL folder; {download}")
    if not (path / "config.json").is_file():
        raise WeightsError(f"{path}: no config.json and no text_encoder/: not a Qwen3-VL or MiniMax H3 folder; "
                           f"{download}")
    return path, path, path if (path / "preprocessor_config.json").is_file() else None


def load_h3_text_encoder(source: str | os.PathLike, dtype: torch.dtype | None = None, device=None,
                         quantize: str | None = None, layer: int = TEXT_LAYER) -> H3TextEncoder:
    """`H3TextEncoder` from a MiniMax H3 folder or a Qwen3-VL folder (`_folders`). The checkpoint is a
    `Qwen3VLForConditionalGeneration`; only its `Qwen3VLModel` is built, with `layer` decoder layers (the later
    layers' and the LM head's weights are skipped as they are read, so they never take memory). dtype None keeps
    the stored dtype; quantize None, "qfloat8" or "qint8" (optimum-quanto weights, frozen). Without a processor
    folder keyframes cannot be encoded (an error says so when asked)."""
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer, Qwen3VLModel

    check_quantize(quantize)
    model_dir, tokenizer_dir, processor_dir = _folders(source)
    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    if config.model_type != "qwen3_vl":
        raise WeightsError(f"{model_dir}: a {config.model_type!r} model; MiniMax H3's conditioner is Qwen3-VL")
    if config.text_config.num_hidden_layers < layer:
        raise WeightsError(f"{model_dir}: {config.text_config.num_hidden_layers} decoder layers; MiniMax H3 reads the "
                           f"output of layer {layer}")
    config = copy.deepcopy(config)
    config.text_config.num_hidden_layers = layer
    model = Qwen3VLModel.from_pretrained(str(model_dir), config=config, local_files_only=True,
                                         dtype=dtype if dtype is not None else "auto")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    image_processor = (AutoImageProcessor.from_pretrained(str(processor_dir), local_files_only=True)
                       if processor_dir is not None else None)
    encoder = H3TextEncoder(model.to(device), tokenizer, image_processor, layer)
    quantize_encoder(encoder.model, quantize)
    return encoder
