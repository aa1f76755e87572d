"""Text encoder: per-prompt (Lt_i, D) embeds, batch invariance, the three sources, quantization, errors."""

import copy

import pytest
import torch
from safetensors.torch import save_file
from transformers import ByT5Tokenizer, UMT5EncoderModel

from video_dit.families import get_preset
from video_dit.families.wan.loading import load_text_encoder
from video_dit.families.wan.text_encoder import TextEncoder, build_umt5, clean_prompt
from video_dit.models.weights import WeightsError

PROMPTS = ["a red fox runs through snow", "", "  an   old &amp; quiet harbour at dawn, slow pan  "]


@pytest.fixture(scope="module")
def tiny():
    return load_text_encoder("preset:tiny")


def test_embeds_are_2d_natural_length_and_batch_invariant(tiny):
    cfg = get_preset("tiny").text_encoder
    batch = tiny.encode(PROMPTS)
    assert len(batch) == len(PROMPTS)
    for prompt, emb in zip(PROMPTS, batch):
        n_tokens = len(clean_prompt(prompt).encode("utf-8")) + 1  # ByT5: one id per byte, plus EOS
        assert emb.shape == (n_tokens, cfg.d_model)
        alone = tiny.encode([prompt])[0]
        assert torch.equal(alone, emb)  # identical alone and in a batch
    assert not torch.equal(batch[0][:1], batch[2][:1])  # the content matters
    assert tiny.encode("a red fox runs through snow")[0].shape == batch[0].shape


def test_embeds_match_the_unpadded_encoder_output(tiny):
    # The padded, masked batch gives the same vectors as running the prompt with no padding at all.
    ids = torch.tensor([list(b"a red fox runs through snow")]) + 3  # ByT5: byte + 3
    ids = torch.cat([ids, torch.tensor([[1]])], dim=1)  # EOS
    ref = tiny.model(input_ids=ids).last_hidden_state[0]
    torch.testing.assert_close(tiny.encode(PROMPTS[:1])[0], ref, atol=1e-5, rtol=1e-5)


def test_truncation_at_text_len(tiny):
    emb = tiny.encode(["x" * 500])[0]
    assert emb.shape[0] == get_preset("tiny").text_encoder.text_len


def test_tiny_preset_is_seeded(tiny):
    again = load_text_encoder("preset:tiny")
    for (k, a), b in zip(tiny.model.state_dict().items(), again.model.state_dict().values()):
        assert torch.equal(a, b), k
    assert tiny.device.type == "cpu" and tiny.dtype == torch.float32


def test_diffusers_folder_and_single_file(tmp_path, tiny):
    """A diffusers folder and a single safetensors file (fp32, and cast to bf16 on load) give transformers'
    own model's embeds exactly (measured: 0 difference in both dtypes; bf16 rounding is 0.04 at values up
    to 4, so the bf16 load is compared with transformers' bf16 model, not the fp32 one). Every norm weight
    is drawn 1 + N(0, 0.2): one left at 1 (a weight that failed to load) moves the embeds by 0.3 or more."""
    cfg = get_preset("tiny").text_encoder
    model = build_umt5(cfg, seed=7)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():  # T5's init sets every RMSNorm weight to 1, which would hide an unloaded one
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(tmp_path / "text_encoder")
    ByT5Tokenizer().save_pretrained(tmp_path / "tokenizer")
    ref = TextEncoder(model, ByT5Tokenizer(), text_len=512).encode(PROMPTS)

    from_folder = load_text_encoder(tmp_path)
    assert isinstance(from_folder.model, UMT5EncoderModel)
    for a, b in zip(from_folder.encode(PROMPTS), ref):
        assert torch.equal(a, b)

    sd = {k: v.clone() for k, v in model.state_dict().items() if k != "encoder.embed_tokens.weight"}
    save_file(sd, str(tmp_path / "umt5.safetensors"))
    for dtype in (torch.float32, torch.bfloat16):
        from_file = load_text_encoder(tmp_path / "umt5.safetensors", tokenizer=tmp_path / "tokenizer", dtype=dtype)
        assert from_file.model.config.num_layers == cfg.num_layers
        assert from_file.model.config.num_heads == cfg.num_heads and from_file.dtype == dtype
        want = ref if dtype == torch.float32 else \
            TextEncoder(copy.deepcopy(model).to(dtype), ByT5Tokenizer(), text_len=512).encode(PROMPTS)
        for a, b in zip(from_file.encode(PROMPTS), want):
            assert a.dtype == dtype and torch.equal(a, b)
        # the comparison can fail: the last norm weight left at 1
        with torch.no_grad():
            from_file.model.encoder.final_layer_norm.weight.fill_(1.0)
        assert max((a.float() - b.float()).abs().max() for a, b in zip(from_file.encode(PROMPTS), want)) > 0.1


def test_qfloat8_quantization_stays_close(tiny):
    q = load_text_encoder("preset:tiny", quantize="qfloat8")
    from optimum.quanto import QLinear

    assert any(isinstance(m, QLinear) for m in q.model.modules())
    a, b = q.encode(PROMPTS[:1])[0], tiny.encode(PROMPTS[:1])[0]
    assert a.shape == b.shape and not torch.equal(a, b)
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99


def test_clear_errors(tmp_path):
    with pytest.raises(WeightsError, match="Wan-AI/Wan2.1-T2V-1.3B-Diffusers"):
        load_text_encoder(tmp_path / "missing")
    with pytest.raises(WeightsError, match="umT5-XXL"):
        load_text_encoder("preset:wan2.1-t2v-1.3b")
    with pytest.raises(KeyError, match="did you mean 'tiny'"):
        load_text_encoder("preset:tiyn")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="text_encoder/config.json"):
        load_text_encoder(tmp_path / "empty")
    save_file({"foo.weight": torch.zeros(2, 2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(WeightsError, match="tokenizer=FOLDER"):
        load_text_encoder(tmp_path / "x.safetensors")
    with pytest.raises(WeightsError, match="not a transformers umT5"):
        load_text_encoder(tmp_path / "x.safetensors", tokenizer=tmp_path)
    with pytest.raises(ValueError, match="brings its own tokenizer"):
        load_text_encoder("preset:tiny", tokenizer=tmp_path)
    with pytest.raises(ValueError, match="qfloat8"):
        load_text_encoder("preset:tiny", quantize="fp4")


def test_config_is_typed_and_validated():
    from video_dit.families.wan.text_encoder import TextEncoderConfig
    from video_dit.typed_config import ConfigError, parse

    cfg = parse(TextEncoderConfig, {"d_model": 32, "num_heads": 2, "tokenizer": "byt5"}, "model.text_encoder")
    assert cfg.d_model == 32 and cfg.tokenizer == "byt5"
    with pytest.raises(ConfigError, match=r"model.text_encoder.tokenizer: 'bpe' is not accepted"):
        parse(TextEncoderConfig, {"tokenizer": "bpe"}, "model.text_encoder")
    with pytest.raises(ConfigError, match="did you mean 'num_heads'"):
        parse(TextEncoderConfig, {"num_head": 2}, "model.text_encoder")
    with pytest.raises(ConfigError, match="text_len: must be a positive integer"):
        build_umt5(TextEncoderConfig(text_len=0))
