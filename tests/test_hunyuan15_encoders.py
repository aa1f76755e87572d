"""HunyuanVideo 1.5 encoders: equal to what diffusers' HunyuanVideo15Pipeline / ...ImageToVideoPipeline
compute from the same tiny random components (Qwen2.5-VL text model, ByT5, SigLIP); seeded tiny
builders; local-folder loaders and their errors; qfloat8.

diffusers hard-codes the template crop to 108 (Qwen2.5-VL's real tokenizer); Tencent computes it by
finding "<|im_start|>user\\n", which is what we do, so the diffusers pipeline is given our crop for the
tiny tokenizer (`test_crop_start_is_the_template_before_the_prompt` checks the crop itself). Tencent's
"image" template has no diffusers counterpart and is checked on its own.
"""

import inspect

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import ByT5Tokenizer

from video_dit.families.hunyuan15 import encoders as H
from video_dit.families.wan.loading import WeightsError

CPU = torch.device("cpu")
PROMPTS = ["a red fox runs through snow", "",
           'a neon sign saying "OPEN 24h" above “café”, then "OPEN 24h" again',
           "  two  spaces\nand a newline, then 雪 and a much longer tail " * 3]


def assert_rel(ours, ref, tol=1e-5):
    """max |ours - ref| <= tol * max |ref| (the brief's 1e-5 relative), shapes equal."""
    assert ours.shape == ref.shape
    err, scale = (ours.float() - ref.float()).abs().max().item(), ref.float().abs().max().item()
    assert scale > 0 and err <= tol * scale, f"max abs error {err} > {tol} x {scale}"


def rel_rms(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.fixture(scope="module")
def text():
    return H.tiny_hy15_text_encoder(seed=0)


@pytest.fixture(scope="module")
def glyph():
    return H.tiny_hy15_glyph_encoder(seed=0)


@pytest.fixture(scope="module")
def image():
    return H.tiny_hy15_image_encoder(seed=0)


@pytest.fixture(scope="module")
def pipes(text):
    """diffusers' t2v and i2v pipelines over separately built copies of the same tiny components (our
    wrapper drops the text model's last two blocks, so the reference gets a whole model)."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15ImageToVideoPipeline,
        HunyuanVideo15Pipeline,
    )

    vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 8), layers_per_block=1,
                                      spatial_compression_ratio=2, temporal_compression_ratio=1)
    parts = dict(text_encoder=H.tiny_qwen_text_model(0), tokenizer=H.tiny_qwen_tokenizer(), transformer=None,
                 vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder_2=H.tiny_t5_encoder(0),
                 tokenizer_2=ByT5Tokenizer(), guider=ClassifierFreeGuidance())
    t2v = HunyuanVideo15Pipeline(**parts)
    i2v = HunyuanVideo15ImageToVideoPipeline(**parts, image_encoder=H.tiny_siglip(0),
                                             feature_extractor=H.siglip_processor(32))
    for pipe in (t2v, i2v):
        pipe.prompt_template_encode_start_idx = text.crop_start  # diffusers' 108 is the real tokenizer's crop
    return t2v, i2v


def test_constants_are_the_pipelines(pipes):
    t2v, i2v = pipes
    for pipe in (t2v, i2v):
        assert pipe.system_message == H.SYSTEM_MESSAGES["video"]
        assert (pipe.tokenizer_max_length, pipe.tokenizer_2_max_length) == (H.TEXT_LEN, H.GLYPH_LEN)
        assert (pipe.vision_num_semantic_tokens, pipe.vision_states_dim) == (H.IMAGE_TOKENS, H.IMAGE_DIM)
    sig = inspect.signature(type(t2v)._get_mllm_prompt_embeds).parameters
    assert sig["num_hidden_layers_to_skip"].default == H.HIDDEN_LAYERS_SKIPPED
    assert sig["system_message"].default == H.SYSTEM_MESSAGES["video"]


def test_crop_start_is_the_template_before_the_prompt(text):
    tok = text.tokenizer
    ids, _ = text.tokenize(["a cat"])
    prefix = f"<|im_start|>system\n{H.SYSTEM_MESSAGES['video']}<|im_end|>\n<|im_start|>user\n"
    assert tok.decode(ids[0, : text.crop_start]) == prefix
    assert tok.decode(ids[0, text.crop_start:text.crop_start + 5]) == "a cat"

    img = H.HY15TextEncoder(H.tiny_qwen_text_model(0), H.tiny_qwen_tokenizer(), template="image")
    ids, _ = img.tokenize(["a cat"])
    image_prefix = prefix.replace(H.SYSTEM_MESSAGES["video"], H.SYSTEM_MESSAGES["image"])
    assert tok.decode(ids[0, : img.crop_start]) == image_prefix
    assert img.crop_start < text.crop_start
    # the image template gives the same prompt tokens, seen after another system message
    a, b = img.encode(["a cat"])[0], text.encode(["a cat"])[0]
    assert a.shape == b.shape and not torch.equal(a, b)

    plain = H.tiny_qwen_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="no '<\\|im_start\\|>user"):
        H.HY15TextEncoder(H.tiny_qwen_text_model(0), plain)
    with pytest.raises(ValueError, match="template='video2'; accepted"):
        H.tiny_hy15_text_encoder(template="video2")


def test_text_embeds_match_diffusers(text, pipes):
    embeds, mask, _, _ = pipes[0].encode_prompt(PROMPTS, device=CPU, batch_size=len(PROMPTS))
    ours, ours_mask = text.encode_padded(PROMPTS)
    assert ours.shape == (len(PROMPTS), H.TEXT_LEN, text.dim) and ours.dtype == torch.float32
    assert ours_mask.dtype == torch.int64 and torch.equal(ours_mask.float(), mask)
    assert_rel(ours, embeds)

    rows = text.encode(PROMPTS)
    lengths = [r.shape[0] for r in rows]
    assert lengths == mask.sum(1).long().tolist() and len(set(lengths)) == len(PROMPTS)
    for r, e in zip(rows, embeds):
        assert_rel(r, e[: r.shape[0]])
    # the empty prompt is encoded as " " (one byte token), then the kept generation prompt:
    # <|im_end|> "\n" <|im_start|> "assistant" "\n" (special tokens one id each, the rest one id per byte)
    assert lengths[1] == 1 + 1 + 1 + 1 + len("assistant") + 1


def test_text_truncation_matches_diffusers(pipes):
    short = H.tiny_hy15_text_encoder(seed=0, text_len=16)
    ref, ref_mask = type(pipes[0])._get_mllm_prompt_embeds(
        pipes[0].text_encoder, pipes[0].tokenizer, PROMPTS, CPU, tokenizer_max_length=16,
        system_message=H.SYSTEM_MESSAGES["video"], crop_start=short.crop_start)
    ours, mask = short.encode_padded(PROMPTS)
    assert torch.equal(mask, ref_mask)
    assert_rel(ours, ref)
    assert [r.shape[0] for r in short.encode(PROMPTS)] == [16, 14, 16, 16]


def test_text_embeds_do_not_depend_on_the_batch(text):
    batch = text.encode(PROMPTS)
    for prompt, row in zip(PROMPTS, batch):
        torch.testing.assert_close(text.encode(prompt)[0], row, rtol=1e-6, atol=1e-7)


def test_glyph_prompt_is_diffusers():
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import extract_glyph_texts

    cases = ["no quotes here", 'a sign "OPEN"', 'both "A" and "B"', 'repeated "A", "A" and “A”',
             '“curly” and "straight"', 'empty ""', 'unclosed "quote', 'nested "out “in” out"', '"x"',
             'dup "A" "B" "A"', "multi\n\"line\ntext\""]
    for p in cases:
        assert H.glyph_prompt(p) == extract_glyph_texts(p), p
    assert H.glyph_prompt('repeated "A", "A" and “B”') == 'Text "A". Text "B". '


def test_glyph_embeds_match_diffusers(glyph, pipes):
    _, _, embeds, mask = pipes[0].encode_prompt(PROMPTS, device=CPU, batch_size=len(PROMPTS))
    ours, ours_mask = glyph.encode_padded(PROMPTS)
    assert ours.shape == (len(PROMPTS), H.GLYPH_LEN, glyph.dim) and ours_mask.dtype == torch.int64
    assert torch.equal(ours_mask.float(), mask)
    assert_rel(ours, embeds)
    assert not ours[[0, 1, 3]].any()  # no quoted text: zeros, all masked

    rows = glyph.encode(PROMPTS)
    expected = len('Text "OPEN 24h". Text "café". '.encode()) + 1  # ByT5: one id per byte, plus EOS
    assert [r.shape[0] for r in rows] == [0, 0, expected, 0]
    assert_rel(rows[2], embeds[2, :expected])
    alone = glyph.encode(PROMPTS[2])[0]
    assert_rel(alone, rows[2], tol=1e-6)


def _photo(seed, size=(48, 40), mode="RGB"):
    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(arr).convert(mode)


def test_image_embeds_match_diffusers(image, pipes):
    i2v = pipes[1]
    for img in (_photo(0), _photo(1, (33, 57), mode="L")):
        ref = i2v.encode_image(img, batch_size=1, device=CPU, dtype=torch.float32)
        ours = image.encode(img)
        assert ours.shape == (1, image.tokens, image.dim) == (1, 16, 32)
        assert_rel(ours, ref)
    two = image.encode([_photo(0), _photo(2)])
    assert two.shape == (2, 16, 32) and not torch.equal(two[0], two[1])
    assert_rel(two[:1], i2v.encode_image(_photo(0), batch_size=1, device=CPU, dtype=torch.float32))


def test_image_tensor_input_is_tencents_uint8_conversion(image, pipes):
    # Tencent's train.py: ((x + 1) / 2 * 255).clip(0, 255).astype(uint8): truncated, so 0 -> 127, not 128
    x = torch.tensor([-1.0, 0.0, 1.0, 0.999, -0.5]).view(1, 1, 1, 5).expand(1, 3, 1, 5)
    assert H.to_uint8_images(x)[0][0, :, 0].tolist() == [0, 127, 255, 254, 63]
    frames = torch.rand(2, 3, 40, 48, generator=torch.Generator().manual_seed(0)) * 2 - 1
    ours = image.encode(frames)
    for i, arr in enumerate(H.to_uint8_images(frames)):
        ref = pipes[1].encode_image(Image.fromarray(arr), batch_size=1, device=CPU, dtype=torch.float32)
        assert_rel(ours[i:i + 1], ref)
    with pytest.raises(ValueError, match=r"\(N, 3, H, W\)"):
        image.encode(frames[:, :2])


def test_t2v_image_embeds():
    z = H.t2v_image_embeds(2, dtype=torch.bfloat16)
    assert z.shape == (2, 729, 1152) and z.dtype == torch.bfloat16 and not z.any()


def test_pad_embeds_restores_the_dit_layout(text):
    rows = text.encode(PROMPTS)
    padded, mask = H.pad_embeds(rows, H.TEXT_LEN)
    ref, ref_mask = text.encode_padded(PROMPTS)
    assert torch.equal(mask, ref_mask)
    assert torch.equal(padded[mask.bool()], ref[ref_mask.bool()]) and not padded[~mask.bool()].any()
    with pytest.raises(ValueError, match="longer than length=8"):
        H.pad_embeds(rows, 8)


@pytest.mark.parametrize("build", [H.tiny_qwen_text_model, H.tiny_t5_encoder, H.tiny_siglip])
def test_tiny_builders_are_seeded_and_device_independent(build):
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    a = build(0)
    assert torch.equal(torch.get_rng_state(), cpu_state)  # the global RNG is untouched
    if cuda_state is not None:
        assert all(torch.equal(s, t) for s, t in zip(torch.cuda.get_rng_state_all(), cuda_state))
    b, c = build(0), build(1)
    with torch.device("meta"):  # a default device does not change where (or how) the weights are drawn
        d = build(0)
    sa, sb, sc, sd = (m.state_dict() for m in (a, b, c, d))
    assert all(torch.equal(sa[k], sb[k]) and torch.equal(sa[k], sd[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].is_floating_point() and sa[k].std() > 0)
    if torch.cuda.is_available():
        e = build(0, device="cuda")
        assert all(torch.equal(v.cpu(), sa[k]) for k, v in e.state_dict().items())


def test_missing_folders_name_the_path_and_the_download(tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(WeightsError, match="huggingface-cli download hunyuanvideo-community/HunyuanVideo-1.5-"
                                           "Diffusers-480p_t2v --include 'text_encoder/\\*' 'tokenizer/\\*'") as e:
        H.load_hy15_text_encoder(missing)
    assert isinstance(e.value, ValueError) and str(missing) in str(e.value)
    with pytest.raises(WeightsError, match="'text_encoder_2/\\*' 'tokenizer_2/\\*'"):
        H.load_hy15_glyph_encoder(missing)
    with pytest.raises(WeightsError, match="480p_i2v --include 'image_encoder/\\*'"):
        H.load_hy15_image_encoder(missing)
    H.tiny_qwen_text_model(0).save_pretrained(tmp_path / "half" / "text_encoder")
    with pytest.raises(WeightsError, match=r"half: missing tokenizer/ \(its tokenizer\)"):
        H.load_hy15_text_encoder(tmp_path / "half")
    with pytest.raises(ValueError, match="quantize='fp4'"):
        H.load_hy15_text_encoder(tmp_path / "half", quantize="fp4")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A diffusers-layout folder of tiny components (seed 3) and the same components in memory."""
    root = tmp_path_factory.mktemp("hy15")
    qwen, t5, siglip = H.tiny_qwen_text_model(3), H.tiny_t5_encoder(3), H.tiny_siglip(3)
    processor = H.siglip_processor(32, image_mean=[0.4, 0.5, 0.6], image_std=[0.2, 0.3, 0.4])
    qwen.save_pretrained(root / "text_encoder")
    H.tiny_qwen_tokenizer().save_pretrained(root / "tokenizer")
    t5.save_pretrained(root / "text_encoder_2")
    ByT5Tokenizer().save_pretrained(root / "tokenizer_2")
    siglip.save_pretrained(root / "image_encoder")
    processor.save_pretrained(root / "feature_extractor")
    memory = (H.HY15TextEncoder(qwen, H.tiny_qwen_tokenizer()), H.HY15GlyphEncoder(t5, ByT5Tokenizer()),
              H.HY15ImageEncoder(siglip, processor))
    return root, memory


def test_loaders_read_the_diffusers_layout(folder):
    root, (text, glyph, image) = folder
    loaded = H.load_hy15_text_encoder(root)
    assert loaded.crop_start == text.crop_start and len(loaded.model.layers) == 2
    for a, b in zip(loaded.encode(PROMPTS), text.encode(PROMPTS)):
        assert torch.equal(a, b)
    for a, b in zip(H.load_hy15_glyph_encoder(root).encode(PROMPTS), glyph.encode(PROMPTS)):
        assert torch.equal(a, b)
    img = H.load_hy15_image_encoder(root)
    assert list(img.processor.image_mean) == [0.4, 0.5, 0.6]  # from feature_extractor/
    assert torch.equal(img.encode(_photo(0)), image.encode(_photo(0)))
    default_processor = H.HY15ImageEncoder(image.model, H.siglip_processor(32))
    assert not torch.equal(img.encode(_photo(0)), default_processor.encode(_photo(0)))

    bf16 = H.load_hy15_glyph_encoder(root, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16.encode(PROMPTS[2])[0].dtype == torch.bfloat16


def test_qfloat8_stays_within_float8_precision(folder):
    """float8 e4m3 keeps 3 mantissa bits: each weight is off by at most 2^-4 of itself. Through s
    quantized matmuls in series (4 per block: q/k/v -> out, up/gate or fc1 -> down; 2 blocks run in each
    tiny encoder) independent errors grow like sqrt(s), so the output is off by less than 2^-4 sqrt(8)
    in relative RMS; and it is off (not equal)."""
    from optimum.quanto import QLinear, qfloat8

    root, (text, glyph, image) = folder
    bound = 2 ** -4 * 8 ** 0.5
    pairs = [(H.load_hy15_text_encoder(root, quantize="qfloat8"), text, lambda e: torch.cat(e.encode(PROMPTS))),
             (H.load_hy15_glyph_encoder(root, quantize="qfloat8"), glyph, lambda e: torch.cat(e.encode(PROMPTS))),
             (H.load_hy15_image_encoder(root, quantize="qfloat8"), image, lambda e: e.encode(_photo(0)))]
    for q, f, run in pairs:
        linears = [m for m in q.model.modules() if isinstance(m, QLinear)]
        assert linears and all(m.weight_qtype == qfloat8 for m in linears)
        assert q.dtype == torch.float32
        err = rel_rms(run(q), run(f))
        assert 1e-4 < err < bound, (type(q).__name__, err)
