"""LTX-2's text path: the connectors equal to diffusers' LTX2TextConnectors on random weights (LTX-2's and
LTX-2.3's feature extractors), the Gemma 3 features + connectors equal to diffusers' LTX2Pipeline
`encode_prompt` and connectors call on a tiny random Gemma 3, where ltx-core and diffusers disagree (no
registers), tokenisation, per-prompt encoding, key layouts and loaders, qfloat8.

Parity tolerances are about 10-20x the error measured here (float32, CPU); "could fail" siblings show
the measure fails on a small change."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from video_dit.families.ltx2 import audio_convert as AC
from video_dit.families.ltx2 import text_encoder as TE
from video_dit.families.ltx2.connectors import (
    LTX2_CONNECTORS, LTX23_CONNECTORS, TINY_CONNECTORS, TINY_CONNECTORS_V2, ConnectorConfig, LTX2TextConnectors,
    StreamConfig)
from video_dit.models.weights import WeightsError

diffusers = pytest.importorskip("diffusers")
from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors as DiffusersConnectors  # noqa: E402

NO_REGISTERS = replace(TINY_CONNECTORS, video=replace(TINY_CONNECTORS.video, registers=None),
                       audio=replace(TINY_CONNECTORS.audio, registers=None))
PROMPTS = ["a red square moves left", "  two birds  ", ""]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return ((a - b).abs().max() / b.abs().max()).item()


def _connectors(config: ConnectorConfig, seed: int = 0) -> tuple[LTX2TextConnectors, DiffusersConnectors]:
    """Ours with every 1-D parameter (biases, RMSNorm scales) moved off its init, and diffusers' with the
    same weights."""
    ours = LTX2TextConnectors(config, seed=seed).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ours.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    ref = DiffusersConnectors(**AC.connectors_config_to_diffusers(config)).eval()
    ref.load_state_dict(AC.connectors_to_diffusers(ours.state_dict()))
    return ours, ref


def _states(config: ConnectorConfig, length: int = 16, seed: int = 1):
    """Stacked states (2, length, D, N) of spread-out scale and left-padded masks of 6 and 13 tokens."""
    g = torch.Generator().manual_seed(seed)
    states = 3 * torch.randn(2, length, config.caption_channels, config.text_states, generator=g)
    mask = torch.zeros(2, length, dtype=torch.int64)
    mask[0, -6:] = 1
    mask[1, -13:] = 1
    return states, mask


CONNECTOR_TOL = 5e-6  # measured: <= 4.0e-7 relative (v1, v2, no registers; video and audio): ~12x


@pytest.mark.parametrize("config", [TINY_CONNECTORS, TINY_CONNECTORS_V2], ids=["ltx2-v1", "ltx23-v2"])
@torch.no_grad()
def test_connectors_match_diffusers(config):
    """LTX-2's (masked mean/range norm, one projection) and LTX-2.3's (per-token RMS, two projections,
    gated attention) connectors equal diffusers' on left-padded states, flattened or not: video
    (B, Lt, Dv), audio (B, Lt, Da), the mask all ones."""
    ours, ref = _connectors(config)
    states, mask = _states(config)
    video, audio = ours(states, mask)
    ref_video, ref_audio, ref_mask = ref(states.flatten(2), mask, padding_side="left")
    assert video.shape == (2, 16, config.video.dim) and audio.shape == (2, 16, config.audio.dim)
    assert torch.equal(ref_mask, torch.ones_like(mask))
    assert _rel(video, ref_video) < CONNECTOR_TOL and _rel(audio, ref_audio) < CONNECTOR_TOL
    assert torch.equal(ours(states.flatten(2), mask)[0], video)


@torch.no_grad()
def test_connectors_parity_could_fail():
    """One register nudged by 1e-2, or the RoPE positions read over 4095 instead of rope_max_pos, fail the
    same measure by 10x or more."""
    ours, ref = _connectors(TINY_CONNECTORS)
    states, mask = _states(TINY_CONNECTORS)
    ref_video = ref(states, mask)[0]
    ours.video_embeddings_connector.learnable_registers[2, 0] += 1e-2
    assert _rel(ours(states, mask)[0], ref_video) > 10 * CONNECTOR_TOL
    ours.video_embeddings_connector.learnable_registers[2, 0] -= 1e-2
    ours.video_embeddings_connector.config = replace(TINY_CONNECTORS, rope_max_pos=31)
    assert _rel(ours(states, mask)[0], ref_video) > 10 * CONNECTOR_TOL


@torch.no_grad()
def test_connectors_without_registers_follow_ltx_core():
    """Without registers ltx-core moves the valid tokens to the front before the connectors (they are
    trained right-padded) and diffusers does not: ours on left padding equals diffusers on the same
    states right-padded, and differs from diffusers on left padding (RoPE positions shift)."""
    ours, ref = _connectors(NO_REGISTERS)
    states, mask = _states(NO_REGISTERS)
    video, audio = ours(states, mask)
    right_states = torch.stack([torch.roll(s, -int((1 - m).sum()), dims=0) for s, m in zip(states, mask)])
    right_mask = torch.stack([torch.roll(m, -int((1 - m).sum())) for m in mask])
    ref_video, ref_audio, _ = ref(right_states, right_mask, padding_side="right")
    assert _rel(video, ref_video) < CONNECTOR_TOL and _rel(audio, ref_audio) < CONNECTOR_TOL
    assert _rel(video, ref(states, mask, padding_side="left")[0]) > 1e-2


def test_connector_errors():
    with pytest.raises(ValueError, match="feature extractor 'v1' projects to caption_channels=16"):
        replace(TINY_CONNECTORS, video=StreamConfig(heads=2, head_dim=4, registers=8))
    ours = LTX2TextConnectors(TINY_CONNECTORS, seed=0)
    states, mask = _states(TINY_CONNECTORS, length=12)
    with pytest.raises(ValueError, match="12 text tokens is not a multiple of the 8 learnable registers"):
        ours(states, mask)
    with pytest.raises(ValueError, match="expected states \\(B, Lt, 16, 3\\)"):
        ours(states[..., :2], mask)
    with pytest.raises(ValueError, match="rope_type='interleaved'.*only 'split'"):
        AC.connectors_config_from_diffusers({"rope_type": "interleaved"})


def test_released_connector_configs_come_from_diffusers_defaults_and_converter():
    """LTX-2's config is diffusers' LTX2TextConnectors defaults with split RoPE (what its converter sets), and
    has the parameter count those numbers give; both releases' configs convert to diffusers and back."""
    import inspect

    defaults = {k: p.default for k, p in inspect.signature(DiffusersConnectors.__init__).parameters.items()
                if k != "self"}
    assert AC.connectors_config_from_diffusers({**defaults, "rope_type": "split"}) == LTX2_CONNECTORS
    for config in (LTX2_CONNECTORS, LTX23_CONNECTORS):
        assert AC.connectors_config_from_diffusers(AC.connectors_config_to_diffusers(config)) == config
    with torch.device("meta"):
        n = sum(p.numel() for p in LTX2TextConnectors(LTX2_CONNECTORS).parameters())
    d = 3840  # projection 49 d -> d, no bias; per stream 128 registers and 2 blocks: q, k, v, out (+ biases),
    block = 4 * (d * d + d) + 2 * d + (d * 4 * d + 4 * d) + (4 * d * d + d)  # q/k norms, ff 4x (+ biases)
    assert n == 49 * d * d + 2 * (128 * d + 2 * block)


# ---------------------------------------------------------------- Gemma 3 + connectors vs diffusers' pipeline


@pytest.fixture(scope="module")
def pipeline_and_ours():
    """diffusers' LTX2Pipeline holding only a tiny random Gemma 3 (the whole multimodal model), its tokenizer
    and the connectors; ours over the same Gemma's language model and the same connector weights."""
    full = TE.tiny_gemma3(seed=0)
    ours_conn, ref_conn = _connectors(TINY_CONNECTORS)
    pipe = diffusers.LTX2Pipeline(scheduler=None, vae=None, audio_vae=None, text_encoder=full,
                                  tokenizer=TE.tiny_gemma3_tokenizer(), connectors=ref_conn, transformer=None,
                                  vocoder=None)
    ours = TE.LTX2PromptEncoder(TE.LTX2TextEncoder(full.model.language_model, TE.tiny_gemma3_tokenizer(), 32),
                                ours_conn)
    return pipe, ours


TEXT_TOL = 5e-6  # measured: Gemma states 0 (the same network), context <= 2.4e-7 relative: ~20x


@torch.no_grad()
def test_prompt_encoding_matches_diffusers_pipeline(pipeline_and_ours):
    """`encode_prompt` (Gemma 3's stacked hidden states, flattened, left padded to 32 with <bos> first) and the
    pipeline's connectors call equal ours: `LTX2TextEncoder.encode_padded` and `LTX2PromptEncoder.encode_padded`."""
    pipe, ours = pipeline_and_ours
    embeds, mask, _, _ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, max_sequence_length=32,
                                            device="cpu")
    our_embeds, our_mask = ours.text_encoder.encode_padded(PROMPTS)
    assert our_embeds.shape == (3, 32, 16 * 3) and torch.equal(our_mask, mask)
    assert _rel(our_embeds, embeds) < TEXT_TOL
    ref_video, ref_audio, _ = pipe.connectors(embeds, mask, padding_side="left")
    video, audio = ours.encode_padded(PROMPTS)
    assert _rel(video, ref_video) < TEXT_TOL and _rel(audio, ref_audio) < TEXT_TOL


@torch.no_grad()
def test_prompt_encoding_parity_could_fail(pipeline_and_ours):
    """The states one layer off (the embeddings stacked twice, the last block dropped) fail the measure."""
    pipe, ours = pipeline_and_ours
    embeds, mask, _, _ = pipe.encode_prompt(PROMPTS[:2], do_classifier_free_guidance=False, max_sequence_length=32,
                                            device="cpu")
    ref_video = pipe.connectors(embeds, mask, padding_side="left")[0]
    states, our_mask = ours.text_encoder.hidden_states(PROMPTS[:2])
    assert _rel(ours.connectors(states, our_mask)[0], ref_video) < TEXT_TOL
    shifted = torch.cat([states[:, :, :, :1], states[:, :, :, :-1]], dim=3)
    assert _rel(ours.connectors(shifted, our_mask)[0], ref_video) > 10 * TEXT_TOL


def test_tokenize_bos_left_padding_and_truncation():
    """<bos> (258) first, <pad> (256) on the left, the text stripped, one id per byte, truncation at
    max_length counting <bos>; a tokenizer without a <bos> post-processor still gets one (ltx-core)."""
    enc = TE.tiny_ltx2_text_encoder(seed=0, max_length=8)
    ids, mask = enc.tokenize(["  ab ", "abcdefghij"])
    assert ids.tolist()[0] == [256] * 5 + [258] + list(enc.tokenizer("ab", add_special_tokens=False)["input_ids"])
    assert mask.tolist() == [[0] * 5 + [1] * 3, [1] * 8] and ids[1, 0] == 258
    enc.tokenizer._tokenizer.post_processor = None
    assert torch.equal(enc.tokenize(["  ab "])[0], ids[:1])


def test_encode_per_prompt_is_batch_independent(pipeline_and_ours):
    """One (max_length, D) video and audio context per prompt, the same alone as in a batch."""
    _, ours = pipeline_and_ours
    rows = ours.encode(PROMPTS)
    assert [tuple(r.video.shape) for r in rows] == [(32, 16)] * 3 and rows[0].audio.shape == (32, 16)
    alone = ours.encode(PROMPTS[1])[0]
    assert torch.allclose(alone.video, rows[1].video, atol=1e-6)
    assert torch.allclose(alone.audio, rows[1].audio, atol=1e-6)
    assert ours.encode([]) == []
    with pytest.raises(TypeError, match="prompts\\[1\\] must be a string"):
        ours.encode(["a", 3])


def test_tiny_gemma_is_seeded_and_leaves_the_global_rng():
    state = torch.get_rng_state()
    a, b, c = TE.tiny_gemma3_text_model(0), TE.tiny_gemma3_text_model(0), TE.tiny_gemma3_text_model(1)
    assert torch.equal(torch.get_rng_state(), state)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa) and not torch.equal(sa["embed_tokens.weight"],
                                                                            sc["embed_tokens.weight"])


# ---------------------------------------------------------------- layouts, loading, quantization


def test_connector_layouts_round_trip_and_bad_key():
    """ours -> diffusers -> ours, ours -> Lightricks' DiT file (beside DiT keys) -> ours; a bad key is named."""
    sd = LTX2TextConnectors(TINY_CONNECTORS_V2, seed=0).state_dict()
    dit = {"model.diffusion_model.transformer_blocks.0.attn1.to_q.weight": torch.zeros(1),
           "model.diffusion_model.proj_in.weight": torch.zeros(1), "vae.decoder.conv_in.conv.weight": torch.zeros(1)}
    for layout, converted in (("diffusers", AC.connectors_to_diffusers(sd)),
                              ("original", {**AC.connectors_to_original(sd), **dit}), ("native", sd)):
        back, found = AC.connectors_to_native(converted)
        assert found == layout and back.keys() == sd.keys() and all(back[k] is sd[k] for k in sd)
    under_dit = {"model.diffusion_model." + k: v for k, v in sd.items()}  # the projection under the DiT prefix too
    assert AC.connectors_to_native(under_dit)[0].keys() == sd.keys()
    bad = AC.connectors_to_diffusers(sd)
    bad["video_connector.transformer_blocks.0.attn1.norm_v.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="not in the diffusers layout of the LTX-2 text connectors: "
                                         "video_connector.transformer_blocks.0.attn1.norm_v.weight"):
        AC.connectors_to_native(bad)


def test_load_connectors_and_text_encoder_from_folders(tmp_path):
    """Connectors from a diffusers `connectors/` folder and from a Lightricks DiT file (config by the
    projection found: v1 -> LTX-2's, checked against the shapes, which name the file and keys); the text
    encoder from a diffusers pipeline folder (text_encoder/, tokenizer/) equal to the in-memory one."""
    ours, ref = _connectors(TINY_CONNECTORS)
    ref.save_pretrained(tmp_path / "pipe" / "connectors")
    loaded = AC.load_ltx2_connectors(tmp_path / "pipe")
    assert loaded.config == TINY_CONNECTORS and all(torch.equal(v, ours.state_dict()[k])
                                                    for k, v in loaded.state_dict().items())
    save_file({k: v.contiguous() for k, v in AC.connectors_to_original(ours.state_dict()).items()},
              tmp_path / "dit.safetensors")
    with pytest.raises(WeightsError, match="dit.safetensors \\(original layout\\): weights do not fit "
                                           "LTX2TextConnectors(.|\n)*wrong shape: text_embedding_projection"):
        AC.load_ltx2_connectors(tmp_path / "dit.safetensors")
    assert AC.load_ltx2_connectors(tmp_path / "dit.safetensors", config=TINY_CONNECTORS).config == TINY_CONNECTORS

    TE.tiny_gemma3(seed=2).save_pretrained(tmp_path / "pipe" / "text_encoder")
    TE.tiny_gemma3_tokenizer().save_pretrained(tmp_path / "pipe" / "tokenizer")
    enc = TE.load_ltx2_text_encoder(tmp_path / "pipe", max_length=32)
    mem = TE.tiny_ltx2_text_encoder(seed=2, max_length=32)
    assert torch.equal(enc.encode_padded(PROMPTS)[0], mem.encode_padded(PROMPTS)[0])
    assert sum(p.numel() for p in enc.model.parameters()) == sum(p.numel() for p in mem.model.parameters())


def test_missing_text_encoder_names_what_to_put_where(tmp_path):
    with pytest.raises(WeightsError, match="missing: no such folder; expected Gemma 3 \\(12B\\).*huggingface-cli "
                                           "download google/gemma-3-12b-it-qat-q4_0-unquantized"):
        TE.load_ltx2_text_encoder(tmp_path / "missing")
    (tmp_path / "half" / "text_encoder").mkdir(parents=True)
    with pytest.raises(WeightsError, match="has text_encoder/ but no tokenizer/.*--include 'text_encoder/\\*' "
                                           "'tokenizer/\\*'"):
        TE.load_ltx2_text_encoder(tmp_path / "half")
    with pytest.raises(ValueError, match="quantize='fp4'"):
        TE.load_ltx2_text_encoder(tmp_path / "half", quantize="fp4")


def test_qfloat8_text_encoder_stays_within_float8_precision():
    """float8 e4m3 weights (3 mantissa bits: each weight off by at most 2^-4 of itself) through the 2 blocks'
    7 quantized matmuls in series: the stacked states are off by less than 2^-4 sqrt(7) in relative RMS,
    and off (not equal)."""
    from optimum.quanto import QLinear, qfloat8

    from video_dit.models.common import quantize_encoder

    ref = TE.tiny_ltx2_text_encoder(seed=0)
    q = TE.tiny_ltx2_text_encoder(seed=0)
    quantize_encoder(q.model, "qfloat8")
    linears = [m for m in q.model.modules() if isinstance(m, QLinear)]
    assert linears and all(m.weight_qtype == qfloat8 for m in linears)
    a, b = q.hidden_states(PROMPTS)[0], ref.hidden_states(PROMPTS)[0]
    err = ((a - b).pow(2).mean() / b.pow(2).mean()).sqrt().item()
    assert 1e-4 < err < 2 ** -4 * 7 ** 0.5, err


def test_the_plan_counts_a_released_gemma_from_its_architecture(capsys):
    """Without the Gemma's files, the memory plan counts Gemma 3 12B's language model from its config
    (`GEMMA3_12B_TEXT`, built on the meta device): the count derived here from the same numbers, layer by
    layer. The example job (configs/ltx2.3_lora_121x704x1280_8gpu.yaml, as the README quotes it) then plans
    on a machine without any of its files; LTX-2.5's Gemma 4 is not built here and says so."""
    from video_dit import cli
    from video_dit.families import ltx2 as family
    from video_dit.families.ltx2.presets import LTX2_PRESETS

    c = TE.GEMMA3_12B_TEXT
    D, Dh, q, kv, inner = c["hidden_size"], c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], \
        c["intermediate_size"]
    attention = D * q * Dh + 2 * D * kv * Dh + q * Dh * D + 2 * Dh  # q, k, v, o (no biases) and the q / k norms
    layer = attention + 3 * D * inner + 4 * D  # gate, up, down; four RMSNorms
    derived = c["vocab_size"] * D + c["num_hidden_layers"] * layer + D  # embeddings, blocks, the final norm
    assert TE.gemma3_12b_parameters() == derived == 11_766_034_176
    counts = family.MEMORY.encoder_parameters(LTX2_PRESETS["ltx2.3-22b-dev"], ["text_encoder"])
    with torch.device("meta"):
        connectors = sum(p.numel() for p in LTX2TextConnectors(LTX23_CONNECTORS).parameters())
    assert counts["text_encoder"] == derived + connectors
    with pytest.raises(WeightsError, match="Gemma 4"):
        family.MEMORY.encoder_parameters(LTX2_PRESETS["ltx2.5-dev"], ["text_encoder"])
    job = Path(__file__).resolve().parents[1] / "configs" / "ltx2.3_lora_121x704x1280_8gpu.yaml"
    assert cli.main(["plan", str(job), "--gpus", "8", "--gpu-mem", "80", "--host-mem", "1024",
                     "--bucket", "121x704x1280"]) == 0
    out = capsys.readouterr().out
    assert "121x704x1280   14080" in out and "ZeRO-3, SP 1" in out
