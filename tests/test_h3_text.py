"""MiniMax H3's Qwen3-VL conditioner on a tiny random Qwen3-VL (51 decoder layers, so hidden_states[50] is read as
released): its rows and tags against diffusers' own encoder blocks (t2va: the prompt alone; fl2va: two keyframes),
that the index read is 50 (not the last, not 49), the loader (folders, truncation, qfloat8) and its errors.

Errors are relative: max |ours - reference| / max |reference|."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from video_dit.families.minimax_h3.encoders import (TEXT_LAYER, TEXT_TAG, VIDEO_TAG, H3TextEncoder,
                                                    load_h3_text_encoder, tiny_h3_text_encoder, tiny_qwen3vl,
                                                    tiny_qwen3vl_image_processor, tiny_qwen3vl_tokenizer)
from video_dit.models.weights import WeightsError

diffusers = pytest.importorskip("diffusers")
from transformers import Qwen3VLProcessor  # noqa: E402

from diffusers.modular_pipelines import PipelineState  # noqa: E402
from diffusers.modular_pipelines.minimax_h3 import encoders as h3_encoders  # noqa: E402
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline as P  # noqa: E402

PROMPT = "A robot dances in the rain, neon light on wet streets."
# measured 0 (bitwise: the same modules on the same inputs); 1e-6 leaves room for a kernel choice
PARITY_TOL = 1e-6


def _keyframes() -> list:
    return [Image.fromarray((np.random.default_rng(s).random((24, 40, 3)) * 255).astype("uint8")) for s in (0, 1)]


def _processor():
    """transformers' `Qwen3VLProcessor`, assembled without its video processor (which needs torchvision, not
    installed here): the blocks use its image processor and `create_mm_token_type_ids` only."""
    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    tokenizer = tiny_qwen3vl_tokenizer()
    processor.tokenizer, processor.image_processor = tokenizer, tiny_qwen3vl_image_processor()
    processor.image_token_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    processor.video_token_id = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    return processor


@pytest.fixture(scope="module")
def pair():
    """(diffusers' components over the whole tiny Qwen3VLForConditionalGeneration, our encoder over a second copy
    of the same weights: ours cuts its layers in place)."""
    components = SimpleNamespace(text_encoder=tiny_qwen3vl(0), tokenizer=tiny_qwen3vl_tokenizer(),
                                 processor=_processor(),
                                 text_encoder_layer=P.text_encoder_layer.fget(None), text_tag=P.text_tag.fget(None),
                                 video_tag=P.video_tag.fget(None), _execution_device=torch.device("cpu"))
    return components, tiny_h3_text_encoder(0)


def _run(block, components, **inputs):
    state = PipelineState()
    for key, value in inputs.items():
        state.set(key, value)
    block(components, state)
    return state.get("prompt_embeds")[0], state.get("text_token_tags")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_t2va_rows_match_the_pipeline(pair):
    """A prompt alone: the same rows as `MiniMaxH3TextEncoderStep` (the prompt verbatim, no template, no special
    tokens, hidden_states[50]), all tagged text."""
    components, encoder = pair
    assert components.text_encoder_layer == TEXT_LAYER
    assert (components.text_tag, components.video_tag) == (TEXT_TAG, VIDEO_TAG)
    want, want_tags = _run(h3_encoders.MiniMaxH3TextEncoderStep(), components, prompt=PROMPT)
    (got,) = encoder.encode(PROMPT)
    assert got.embeds.shape == want.shape == (len(PROMPT.encode()), 32)
    assert _rel(got.embeds, want) < PARITY_TOL
    assert torch.equal(got.tags, want_tags) and (got.tags == TEXT_TAG).all()


def test_fl2va_rows_match_the_pipeline(pair):
    """With a first and a last keyframe: the same rows as `MiniMaxH3FL2VATextEncoderStep` ("<Picture i>: " and a
    vision block per image through Qwen3-VL's vision tower and 3-axis RoPE, then the prompt), the vision blocks
    tagged as video; the images reach the prompt's rows (they differ from the t2va rows by 1.04 relative)."""
    components, encoder = pair
    frames = _keyframes()
    want, want_tags = _run(h3_encoders.MiniMaxH3FL2VATextEncoderStep(), components, prompt=PROMPT, keyframes=frames)
    (got,) = encoder.encode([PROMPT], images=[frames])
    assert got.embeds.shape == want.shape and _rel(got.embeds, want) < PARITY_TOL
    assert torch.equal(got.tags, want_tags) and (got.tags == VIDEO_TAG).sum() == 2 * (1 + 15 + 1)  # 3 x 5 tokens
    (alone,) = encoder.encode(PROMPT)
    n = len(alone.tags)
    assert _rel(got.embeds[-n:], alone.embeds) > 1e-2


def test_the_layer_read_is_50(pair):
    """What could go wrong: reading the last (normed) state, or layer 49. A copy cut at 49 layers gives other rows
    (measured 0.13 relative); the 51st layer's weights do not reach the rows at all (bitwise equal after changing
    them)."""
    components, encoder = pair
    (got,) = encoder.encode(PROMPT)
    full = copy.deepcopy(components.text_encoder)
    early = H3TextEncoder(full.model, tiny_qwen3vl_tokenizer(), tiny_qwen3vl_image_processor(), layer=49)
    assert _rel(early.encode(PROMPT)[0].embeds, got.embeds) > 1e-2
    changed = copy.deepcopy(components)
    changed.text_encoder = copy.deepcopy(components.text_encoder)
    with torch.no_grad():
        for p in changed.text_encoder.model.language_model.layers[50].parameters():
            p.add_(1.0)
        changed.text_encoder.model.language_model.norm.weight.mul_(3.0)
    want, _ = _run(h3_encoders.MiniMaxH3TextEncoderStep(), changed, prompt=PROMPT)
    assert torch.equal(want, _run(h3_encoders.MiniMaxH3TextEncoderStep(), components, prompt=PROMPT)[0])
    assert len(encoder.model.language_model.layers) == TEXT_LAYER
    with pytest.raises(ValueError, match=r"hidden_states\[50\].*has 20"):
        H3TextEncoder(tiny_qwen3vl(0, layers=20).model, tiny_qwen3vl_tokenizer())


def test_bad_inputs_are_named(pair):
    _, encoder = pair
    with pytest.raises(ValueError, match="2 entries for 1 prompts"):
        encoder.encode([PROMPT], images=[None, None])
    (empty,) = encoder.encode("")  # caption dropout's prompt: one pad token (ai-toolkit's H3 trainer), text-tagged
    assert empty.embeds.shape == (1, 32) and empty.tags.tolist() == [TEXT_TAG]
    with pytest.raises(TypeError, match=r"prompts\[1\] must be a string"):
        encoder.encode(["a", 3])
    tokenizer = tiny_qwen3vl_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|x|>"]})
    model = tiny_qwen3vl(0).model
    model.config.image_token_id = 261
    with pytest.raises(ValueError, match="<|image_pad|> is id 259, the model's image_token_id is 261"):
        H3TextEncoder(model, tokenizer)


def test_load_from_a_folder(pair, tmp_path):
    """A MiniMax H3 folder (text_encoder/ as Qwen3VLForConditionalGeneration, tokenizer/, processor/) loads only the
    50 layers read (the 51st and the LM head are skipped) and gives the same rows; a folder without the model names
    what to put where. (qfloat8 goes through the shared `quantize_encoder`, tested with the other encoders; here,
    by hand: 0.076 relative on this 32-wide model. Importing optimum-quanto costs seconds, so not in this file.)"""
    components, encoder = pair
    (tmp_path / "text_encoder").mkdir()  # what save_pretrained writes, without its other files
    save_file(components.text_encoder.state_dict(), str(tmp_path / "text_encoder" / "model.safetensors"))
    components.text_encoder.config.to_json_file(str(tmp_path / "text_encoder" / "config.json"))
    components.tokenizer.save_pretrained(tmp_path / "tokenizer")
    components.processor.image_processor.save_pretrained(tmp_path / "processor")
    loaded = load_h3_text_encoder(tmp_path)
    assert len(loaded.model.language_model.layers) == TEXT_LAYER
    frames = _keyframes()
    want = encoder.encode([PROMPT], images=[frames])[0]
    got = loaded.encode([PROMPT], images=[frames])[0]
    assert _rel(got.embeds, want.embeds) < PARITY_TOL and torch.equal(got.tags, want.tags)
    with pytest.raises(ValueError, match="quantize='float8'; accepted: None, qfloat8, qint8"):
        load_h3_text_encoder(tmp_path, quantize="float8")
    with pytest.raises(WeightsError, match="huggingface-cli download MiniMaxAI/MiniMax-H3 --include 'text_encoder/"):
        load_h3_text_encoder(tmp_path / "nothing")
