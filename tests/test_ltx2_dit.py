"""LTX2DiT: parity with diffusers' LTX2VideoTransformer3DModel on random weights (2.0 / 2.3 / 2.5 flag sets at
tiny widths, t2v and i2v), the documented ltx-core / diffusers difference, siblings that must fail, block
checkpointing, the sequence-parallel seam, the key conversions and LoRA keys, configs, seeded init, FLOPs."""

import copy
import threading

import helpers
import pytest
import torch


from video_dit.bench.common import profiled_live_after  # noqa: E402
from video_dit.families.ltx2 import layers as ltx2_layers  # noqa: E402
from video_dit.families.ltx2.convert import (ltx2_config_from_diffusers, ltx2_config_to_diffusers,  # noqa: E402
                                             ltx2_from_diffusers, ltx2_key_layout, ltx2_lora_from_file,
                                             ltx2_lora_to_comfy, ltx2_native_for, ltx2_to_diffusers, ltx2_to_native)
from video_dit.families.ltx2.dit import LORA_TARGETS, LTX2DiT, cast_ltx2_dit, ltx2_dit_flops  # noqa: E402
from video_dit.families.ltx2.dit_config import LTX2_DIT_CONFIGS, LTX2DiTConfig  # noqa: E402
from video_dit.models.attention import attention  # noqa: E402
from video_dit.models.weights import WeightsError  # noqa: E402

diffusers = pytest.importorskip("diffusers")

# max |ours - diffusers| / max |diffusers|, float32. Measured (torch 2.13 CPU, one thread): t2v 1.7e-7 ..
# 3.2e-7, i2v 1.3e-7 .. 4.1e-7 over the cases below; the tolerance is ~12x the largest.
PARITY_RTOL = 5e-6
FRAMES, HEIGHT, WIDTH, AUDIO_FRAMES, TEXT = 3, 4, 4, 10, 6  # 48 video tokens, 10 audio tokens
FPS = 25.0

CASES = {
    "2.0": LTX2_DIT_CONFIGS["tiny_2.0"],
    "2.3": LTX2_DIT_CONFIGS["tiny_2.3"],
    "2.5": LTX2_DIT_CONFIGS["tiny_2.5"],
    # the other RoPE layout and precision, a 1x2x2 patch, the KV-cacheable text modulation (no prompt adaLN)
    "interleaved_f32_patch122_no_prompt_adaln": LTX2DiTConfig(**{
        **LTX2_DIT_CONFIGS["tiny_2.3"].__dict__, "rope_type": "interleaved", "frequencies_precision": "float32",
        "patch_size": (1, 2, 2), "use_prompt_adaln_single": False}),
}


def reference(cfg: LTX2DiTConfig, seed: int = 0):
    """diffusers' model of `cfg`, every weight random and non-trivial (matrices N(0, 1/fan_in), norm scales
    1 + N(0, 0.2), tables and biases N(0, 0.1)): zeroed gates, tables or unit norms would hide their weights."""
    torch.manual_seed(seed)
    ref = diffusers.LTX2VideoTransformer3DModel(**ltx2_config_to_diffusers(cfg)).eval()
    return helpers.randomize_all(ref, seed=seed, norm_std=0.2, vector_std=0.1)


def ours_from(sd: dict, cfg: LTX2DiTConfig) -> LTX2DiT:
    with torch.device("meta"):
        model = LTX2DiT(cfg)
    model.load_state_dict(ltx2_native_for(model, sd, "reference"), assign=True)
    return model.eval()


def inputs(cfg: LTX2DiTConfig, mode: str, seed: int = 1) -> dict:
    """Our forward's keyword arguments. t2v: one timestep per sample, the same for both streams; i2v: the
    first latent frame's tokens at timestep 0 (and marked as keyframes for 2.5). Sample 0's text is padded."""
    g = torch.Generator().manual_seed(seed)
    width = (cfg.caption_channels,) * 2 if not cfg.caption_proj_before_connector \
        else (cfg.hidden_size, cfg.audio_hidden_size)
    t = torch.tensor([900.0, 300.0])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * TEXT])
    kw = dict(video=torch.randn(2, cfg.in_channels, FRAMES, HEIGHT, WIDTH, generator=g), video_timestep=t,
              audio=torch.randn(2, 2, AUDIO_FRAMES, cfg.audio_in_channels // 2, generator=g), audio_timestep=t,
              video_context=torch.randn(2, TEXT, width[0], generator=g),
              audio_context=torch.randn(2, TEXT, width[1], generator=g),
              video_context_mask=mask, audio_context_mask=mask, fps=FPS)
    if mode == "i2v":
        pt, ph, pw = cfg.patch_size
        L, first = FRAMES // pt * (HEIGHT // ph) * (WIDTH // pw), HEIGHT // ph * (WIDTH // pw)
        tokens = t[:, None].repeat(1, L)
        tokens[:, :first] = 0.0
        kw.update(video_timestep=tokens, video_sigma=t)
        if cfg.use_keyframes_abs_pos_embedding:
            kw["keyframes_mask"] = (torch.arange(L) < first).float().expand(2, L)
    return kw


def run_reference(ref, cfg: LTX2DiTConfig, kw: dict, cross_timestep: bool):
    """diffusers' call as its pipelines make it: latents packed by its pipeline's `_pack_latents` /
    `_pack_audio_latents`, the coordinates made inside from the sizes and fps, sigma = the timestep."""
    pipe = diffusers.LTX2Pipeline
    pt, p = cfg.patch_size[0], cfg.patch_size[1]
    video, audio = kw["video"], kw["audio"]
    keyframes = kw.get("keyframes_mask")
    with torch.no_grad():
        out_v, out_a = ref(
            pipe._pack_latents(video, p, pt), pipe._pack_audio_latents(audio), kw["video_context"],
            kw["audio_context"], kw["video_timestep"], kw["audio_timestep"],
            sigma=kw.get("video_sigma", kw["video_timestep"]), audio_sigma=kw["audio_timestep"],
            encoder_attention_mask=kw["video_context_mask"], audio_encoder_attention_mask=kw["audio_context_mask"],
            num_frames=FRAMES, height=HEIGHT, width=WIDTH, fps=kw["fps"], audio_num_frames=AUDIO_FRAMES,
            use_cross_timestep=cross_timestep, return_dict=False,
            video_keyframes_mask=None if keyframes is None else keyframes[..., None])
    out_v = pipe._unpack_latents(out_v, FRAMES // pt, HEIGHT // p, WIDTH // p, p, pt)
    return out_v, pipe._unpack_audio_latents(out_a, AUDIO_FRAMES, audio.shape[3])


def rel_err(got, expected) -> float:
    return ((got.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def errors(model, ref, cfg, kw, cross_timestep, ours_kw=None):
    """(video, audio) relative errors of `model` on kw (or `ours_kw`) against diffusers' `ref` on kw."""
    with torch.no_grad():
        got = model(**(ours_kw or kw))
    expected = run_reference(ref, cfg, kw, cross_timestep)
    assert [t.shape for t in got] == [t.shape for t in expected]
    return rel_err(got[0], expected[0]), rel_err(got[1], expected[1])


def constant_a2v_gate(ref):
    """The a2v gate's timestep MLP made constant (its output Linear's weight zeroed): the one weight through
    which ltx-core and diffusers differ with per-token timesteps (see `LTX2DiT`'s module docstring)."""
    with torch.no_grad():
        ref.av_cross_attn_video_a2v_gate.emb.timestep_embedder.linear_2.weight.zero_()
    return ref


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_diffusers_t2v_and_i2v(case):
    cfg = CASES[case]
    ref = reference(cfg)
    model = ours_from(ref.state_dict(), cfg)
    t2v = inputs(cfg, "t2v")
    # t2v: both streams at one timestep, where ltx-core's a2v / v2a modulation equals both of diffusers' modes
    measured = {f"t2v cross_timestep={c}": errors(model, ref, cfg, t2v, c) for c in (True, False)}
    # i2v (per-token video timesteps): diffusers' use_cross_timestep=False takes the a2v scale / shift from the
    # video's own timesteps as ltx-core does; the a2v gate (ltx-core: the audio's sigma) is made constant
    ref, i2v = constant_a2v_gate(ref), inputs(cfg, "i2v")
    model = ours_from(ref.state_dict(), cfg)
    measured["i2v"] = errors(model, ref, cfg, i2v, False)
    print(f"\nparity {case}: " + ", ".join(f"{k} video {v:.1e} audio {a:.1e}" for k, (v, a) in measured.items()))
    assert max(max(e) for e in measured.values()) <= PARITY_RTOL, measured
    with torch.no_grad():  # every conditioning input reaches both outputs (through the a2v / v2a attention too)
        base = model(**i2v)
        for key in ("video_context", "audio_context", "audio", "video"):
            changed = model(**{**i2v, key: i2v[key].flip(0)})
            assert min(rel_err(changed[0], base[0]), rel_err(changed[1], base[1])) > 1e-3, key


def test_i2v_differs_from_diffusers_through_the_a2v_gate_as_documented():
    """ltx-core gates audio->video by the audio's sigma, diffusers (either mode) by the video's per-token
    timesteps: with a timestep-dependent gate the two models differ in i2v, on the video mostly."""
    cfg = CASES["2.3"]
    ref = reference(cfg)
    model = ours_from(ref.state_dict(), cfg)
    err_video, err_audio = errors(model, ref, cfg, inputs(cfg, "i2v"), False)
    print(f"\ni2v with diffusers' a2v gate: video {err_video:.2f}, audio {err_audio:.3f}")  # measured 0.49, 0.045
    assert err_video > 0.05 and err_audio > 1e-3


def test_parity_fails_on_one_weight_or_one_flag():
    """Siblings of the parity test that must fail: one perturbed table row, another RoPE layout, another fps,
    another a2v gate multiplier (each changes the output far beyond PARITY_RTOL)."""
    cfg = CASES["2.3"]
    ref = reference(cfg)
    kw = inputs(cfg, "t2v")
    sd = ref.state_dict()
    bad_weight = dict(sd)
    bad_weight["transformer_blocks.1.audio_a2v_cross_attn_scale_shift_table"] = \
        sd["transformer_blocks.1.audio_a2v_cross_attn_scale_shift_table"] + 0.05
    failing = {
        "a2v table row": errors(ours_from(bad_weight, cfg), ref, cfg, kw, True),
        "rope_type": errors(ours_from(sd, LTX2DiTConfig(**{**cfg.__dict__, "rope_type": "interleaved"})), ref, cfg, kw,
                            True),
        "fps": errors(ours_from(sd, cfg), ref, cfg, kw, True, ours_kw={**kw, "fps": 24.0}),
        "av_ca multiplier": errors(ours_from(sd, LTX2DiTConfig(**{**cfg.__dict__,
                                                                    "av_ca_timestep_scale_multiplier": 1})),
                                   ref, cfg, kw, True),
    }
    print("\nfailing siblings: " + ", ".join(f"{k} {max(v):.1e}" for k, v in failing.items()))
    assert all(max(v) > 100 * PARITY_RTOL for v in failing.values()), failing


def test_call_convention_and_video_sigma_from_per_token_timesteps():
    """The house's call `dit(x, timestep, context, audio=, audio_timestep=, audio_context=)` (the audio stream
    keyword-only); with per-token timesteps and no video_sigma, the sigma is the per-sample maximum: the same
    output as the sample's t given explicitly (first-frame conditioning), not as another sigma."""
    cfg = CASES["2.3"]
    model = ours_from(reference(cfg).state_dict(), cfg)
    kw = inputs(cfg, "i2v")
    given = {k: v for k, v in kw.items() if k not in ("video", "video_timestep", "video_context")}
    with torch.no_grad():
        explicit = model(kw["video"], kw["video_timestep"], kw["video_context"], **given)
        derived = model(kw["video"], kw["video_timestep"], kw["video_context"],
                        **{k: v for k, v in given.items() if k != "video_sigma"})
        other = model(**{**kw, "video_sigma": kw["video_sigma"] * 0.5})
    assert torch.equal(explicit[0], derived[0]) and torch.equal(explicit[1], derived[1])
    assert rel_err(other[0], explicit[0]) > 1e-3  # the sigma is read: a wrong one would show
    with pytest.raises(TypeError):
        model(kw["video"], kw["video_timestep"], kw["video_context"], kw["audio"], kw["audio_timestep"])


GUIDANCE_RTOL = 5e-6  # measured (float32, one thread): STG pass 2.6e-7 / 1.5e-7, isolated 3.1e-7 / 2.0e-7; ~16x


def test_guidance_passes_match_diffusers():
    """The perturbed pass of spatio-temporal guidance (both streams' self-attention skipped in block 1:
    diffusers' `spatio_temporal_guidance_blocks` of a `perturbed_attn` model) and the modality-isolated pass
    (`isolate_modalities`: no a2v / v2a) equal diffusers' on random weights; each changes the output."""
    cfg = CASES["2.3"]
    ref = diffusers.LTX2VideoTransformer3DModel(**ltx2_config_to_diffusers(cfg), perturbed_attn=True).eval()
    ref = helpers.randomize_all(ref, seed=0, norm_std=0.2, vector_std=0.1)
    model = ours_from(ref.state_dict(), cfg)
    kw = inputs(cfg, "t2v")
    pipe, p = diffusers.LTX2Pipeline, cfg.patch_size[1]
    measured = {}
    with torch.no_grad():
        plain = model(**kw)
        for name, ours_kw, ref_kw in (("stg", dict(video_stg_blocks=(1,), audio_stg_blocks=(1,)),
                                       dict(spatio_temporal_guidance_blocks=[1])),
                                      ("isolated", dict(isolate_modalities=True), dict(isolate_modalities=True))):
            got = model(**kw, **ours_kw)
            out_v, out_a = ref(pipe._pack_latents(kw["video"], p, 1), pipe._pack_audio_latents(kw["audio"]),
                               kw["video_context"], kw["audio_context"], kw["video_timestep"], kw["audio_timestep"],
                               sigma=kw["video_timestep"], audio_sigma=kw["audio_timestep"],
                               encoder_attention_mask=kw["video_context_mask"],
                               audio_encoder_attention_mask=kw["audio_context_mask"], num_frames=FRAMES,
                               height=HEIGHT, width=WIDTH, fps=FPS, audio_num_frames=AUDIO_FRAMES,
                               use_cross_timestep=True, return_dict=False, **ref_kw)
            expected = (pipe._unpack_latents(out_v, FRAMES, HEIGHT // p, WIDTH // p, p, 1),
                        pipe._unpack_audio_latents(out_a, AUDIO_FRAMES, kw["audio"].shape[3]))
            measured[name] = (rel_err(got[0], expected[0]), rel_err(got[1], expected[1]))
            assert min(rel_err(got[0], plain[0]), rel_err(got[1], plain[1])) > 1e-3, name  # the pass differs
        only_video = model(**kw, video_stg_blocks=(1,))
        past_the_end = model(**kw, video_stg_blocks=(cfg.num_layers,), audio_stg_blocks=(cfg.num_layers,))
    print("\nguidance passes vs diffusers: " + ", ".join(f"{k} video {v:.1e} audio {a:.1e}"
                                                          for k, (v, a) in measured.items()))
    assert max(max(e) for e in measured.values()) <= GUIDANCE_RTOL, measured
    assert torch.equal(past_the_end[0], plain[0]) and torch.equal(past_the_end[1], plain[1])
    assert rel_err(only_video[0], plain[0]) > 1e-3 and rel_err(only_video[1], plain[1]) > 1e-4  # via a2v / v2a


def test_block_checkpointing_same_gradients():
    cfg = CASES["2.5"]
    model = ours_from(reference(cfg).state_dict(), cfg).train()
    kw = inputs(cfg, "i2v")
    grads = []
    for on in (False, True):
        model.enable_gradient_checkpointing() if on else model.disable_gradient_checkpointing()
        model.zero_grad(set_to_none=True)
        video, audio = model(**kw)
        (video.square().mean() + audio.square().mean()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[1].keys() == grads[0].keys() == {n for n, _ in model.named_parameters()}
    for n in ("transformer_blocks.0.audio_to_video_attn.to_k.weight", "av_ca_a2v_gate_adaln_single.linear.weight",
              "keyframes_abs_pos_embedding", "prompt_adaln_single.linear.weight"):
        assert grads[0][n].abs().sum() > 0, n
    worst = max(rel_err(grads[1][n], grads[0][n]) for n in grads[0] if grads[0][n].abs().max() > 0)
    print(f"\ncheckpointed vs not: worst gradient error {worst:.1e}")
    for n in grads[0]:  # measured: bitwise equal (0.0); the tolerance leaves room for a reordered recompute
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7, msg=n)
    model.set_attention_backend("native")
    with pytest.raises(ValueError, match="accepted"):
        model.set_attention_backend("xformers")


@pytest.mark.parametrize("case,dtype", [("2.0", torch.float32), ("2.5", torch.bfloat16)])
def test_recomputed_activations_same_gradients_and_less_memory(case, dtype):
    """The blocks' recipes (`LTX2Block.recompute`, `RecomputeSaved`) give the gradients of stock autograd,
    bit for bit (the same ops re-run), in float32 and in bf16 (the float32 copies of bf16 tensors are
    recipes too), and keep less: the activations alive after forward against the same model with the
    recipes off (measured 0.73 (2.0), 0.74 (2.5 bf16: gated attention, text adaLN) at these tiny sizes,
    where the text and the modulation tables weigh as much as the 48 video tokens; 0.43 at the LTX-2 bench's
    CPU widths, one block). Checkpointed blocks and compiled ones keep no recipes (`_set_block_recompute`)."""
    cfg = CASES[case]
    model = cast_ltx2_dit(ours_from(reference(cfg).state_dict(), cfg).train(), dtype)
    kw = inputs(cfg, "i2v")  # per-token video timesteps: the (B, L, k D) modulation path
    kw = {k: v.to(dtype) if k in ("video", "audio", "video_context", "audio_context") else v for k, v in kw.items()}

    def loss():
        video, audio = model(**kw)
        return video.float().square().mean() + audio.float().square().mean()

    grads, kept = [], []
    for recompute in (True, False):
        model.set_recompute_saved(recompute)
        assert [b.recompute for b in model.transformer_blocks] == [recompute] * cfg.num_layers
        model.zero_grad(set_to_none=True)
        out, alive = profiled_live_after(loss)
        kept.append(alive)
        out.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() == {n for n, _ in model.named_parameters()}
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=0, atol=0, msg=n)
    print(f"\nrecipes on / off, activations kept after forward: {kept[0] / kept[1]:.2f} ({kept[0]} / {kept[1]} B)")
    assert kept[0] < 0.8 * kept[1], kept
    model.set_recompute_saved(True)
    model.set_checkpointed_blocks(1)
    assert [b.recompute for b in model.transformer_blocks] == [False, True]


class ThreadSeqParallel:
    """Two ranks as two threads: split takes this rank's half of a stream's tokens; self_attention and
    cross_modal_attention all-gather the keys / values of the key stream; text_attention is local."""

    def __init__(self, rank, shared):
        self.rank, self.shared, self.calls = rank, shared, []

    def split(self, t, dim, stream):
        return t.chunk(2, dim=dim)[self.rank]

    def gather(self, t, dim, stream):
        return self._all_gather(t, dim)

    def _all_gather(self, t, dim):
        s = self.shared
        s["slots"][self.rank] = t
        s["barrier"].wait()
        out = torch.cat(s["slots"], dim=dim)
        s["barrier"].wait()
        return out

    def self_attention(self, q, k, v, stream):
        self.calls.append(("self", stream, q.shape[1]))
        return attention(q, self._all_gather(k, 1), self._all_gather(v, 1))

    def cross_modal_attention(self, q, k, v, q_stream, kv_stream):
        self.calls.append(("cross", q_stream, kv_stream, q.shape[1], k.shape[1]))
        return attention(q, self._all_gather(k, 1), self._all_gather(v, 1))

    def text_attention(self, q, k, v, key_mask):
        self.calls.append(("text", q.shape[1], k.shape[1]))
        return attention(q, k, v, attn_mask=key_mask)


def test_sequence_parallel_seam_is_the_only_attention_path(monkeypatch):
    cfg = CASES["2.5"]
    sd = reference(cfg).state_dict()
    models = [ours_from(sd, cfg), ours_from(sd, cfg)]  # one replica per "rank"
    kw = inputs(cfg, "i2v")  # per-token timesteps: their modulation rows are split too
    with torch.no_grad():
        expected = models[0](**kw)

    def no_direct_attention(*args, **kwargs):
        raise AssertionError("a block attended outside the seq_parallel seam")

    monkeypatch.setattr(ltx2_layers, "attention", no_direct_attention)
    shared = {"slots": [None, None], "barrier": threading.Barrier(2)}
    results, failures = [None, None], []

    def rank(r):
        try:
            models[r].seq_parallel = ThreadSeqParallel(r, shared)
            with torch.no_grad():
                results[r] = models[r](**kw)
        except Exception as exc:  # surfaced below, with the rank
            failures.append((r, exc))
            shared["barrier"].abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not failures, failures
    per_block = [("self", "video", 24), ("text", 24, TEXT), ("self", "audio", 5), ("text", 5, TEXT),
                 ("cross", "video", "audio", 24, 5), ("cross", "audio", "video", 5, 24)]
    worst = max(rel_err(results[r][s], expected[s]) for r in range(2) for s in range(2))
    print(f"\ntwo ranks vs one: {worst:.1e}")
    for r in range(2):
        assert models[r].seq_parallel.calls == per_block * cfg.num_layers
    assert worst < 3e-6  # measured 1.8e-7 (the halves' attention sums in another order); ~16x


def test_bad_inputs_are_named():
    cfg = CASES["2.3"]
    model = LTX2DiT(cfg, init_seed=0)
    kw = inputs(cfg, "i2v")
    bad = {"video_sigma": ({**kw, "video_sigma": kw["video_sigma"][:1]}, r"video_sigma has shape \(1,\); expected \(2,\)"),
           "audio layout": ({**kw, "audio": kw["audio"].transpose(2, 3)}, r"audio has shape \(2, 2, 4, 10\)"),
           "video timestep": ({**kw, "video_timestep": kw["video_timestep"][:, :5]},
                              r"expected \(2,\) or \(2, 48\)"),
           "context width": ({**kw, "audio_context": kw["video_context"]},
                             r"audio_context .* expected \(2, tokens, 16\)"),
           "keyframes": ({**kw, "keyframes_mask": torch.ones(2, 48)}, "only by a model with use_keyframes_abs_pos"),
           "frames": ({**kw, "video": kw["video"][:, :4]}, r"expected \(B, 8, F', h, w\)")}
    for what, (args, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            model(**args)
    with pytest.raises(ValueError, match=r"LTX2DiTConfig.num_layers=0: a positive integer is accepted"):
        LTX2DiTConfig(num_layers=0)
    with pytest.raises(ValueError, match=r"cross_attention_dim: cross_attention_dim=2048 .* hidden_size=4096"):
        LTX2DiTConfig(cross_attention_dim=2048)


def test_conversions_round_trip_and_bad_keys_are_named():
    cfg = CASES["2.5"]
    diffusers_sd = reference(cfg).state_dict()
    native = ltx2_from_diffusers(diffusers_sd)
    with torch.device("meta"):
        assert native.keys() == LTX2DiT(cfg).state_dict().keys()
    back = ltx2_to_diffusers(native)
    assert back.keys() == diffusers_sd.keys() and all(back[k] is diffusers_sd[k] for k in back)
    again = ltx2_from_diffusers(back)
    assert again.keys() == native.keys() and all(again[k] is native[k] for k in native)
    # spot checks against diffusers' scripts/convert_ltx2_to_diffusers.py rename dicts
    d = diffusers_sd
    for ours, theirs in (("adaln_single.emb.timestep_embedder.linear_1.weight",
                          "time_embed.emb.timestep_embedder.linear_1.weight"),
                         ("transformer_blocks.1.scale_shift_table_a2v_ca_video",
                          "transformer_blocks.1.video_a2v_cross_attn_scale_shift_table"),
                         ("transformer_blocks.0.audio_to_video_attn.k_norm.weight",
                          "transformer_blocks.0.audio_to_video_attn.norm_k.weight")):
        assert native[ours] is d[theirs], ours
    assert native["av_ca_v2a_gate_adaln_single.linear.bias"] is d["av_cross_attn_audio_v2a_gate.linear.bias"]
    assert native["audio_prompt_adaln_single.linear.weight"] is d["audio_prompt_adaln.linear.weight"]
    # a Lightricks single file: the DiT under model.diffusion_model., beside the connectors and other components
    single = {f"model.diffusion_model.{k}": v for k, v in native.items()}
    single.update({"model.diffusion_model.video_embeddings_connector.learnable_registers": torch.zeros(1),
                   "text_embedding_projection.aggregate_embed.weight": torch.zeros(1),
                   "vae.decoder.conv_in.conv.weight": torch.zeros(1), "vocoder.conv_pre.weight": torch.zeros(1)})
    comfy = {f"diffusion_model.{k}": v for k, v in native.items()}
    for layout, sd in (("native", single), ("native", comfy), ("diffusers", diffusers_sd),
                       ("diffusers", {f"transformer.{k}": v for k, v in diffusers_sd.items()})):
        out = ltx2_to_native(sd)
        assert out.keys() == native.keys() and all(out[k] is native[k] for k in native)
    assert ltx2_key_layout(native) == "native" and ltx2_key_layout(diffusers_sd) == "diffusers"
    # unknown keys, missing and wrong-shape ones are named with the source
    with pytest.raises(ValueError,
                       match=r"ckpt\.safetensors: .*1 unexpected keys, first: transformer_blocks\.0\.attn1\.to_x"):
        ltx2_to_native({**native, "transformer_blocks.0.attn1.to_x.weight": torch.zeros(1)}, "ckpt.safetensors")
    with pytest.raises(ValueError, match="first: blocks.0.self_attn.q.weight"):
        ltx2_to_native({"blocks.0.self_attn.q.weight": torch.zeros(1)})
    with torch.device("meta"):
        model = LTX2DiT(cfg)
    partial = {k: v for k, v in native.items() if k != "proj_out.bias"}
    partial["patchify_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(WeightsError, match=r"(?s)file\.safetensors.*1 missing: proj_out\.bias.*wrong shape: "
                                           r"patchify_proj\.weight: file \(3, 3\)"):
        ltx2_native_for(model, partial, "file.safetensors")


def test_lora_keys_are_comfyuis():
    from video_dit.lora import add_lora, lora_state_dict

    cfg = CASES["2.3"]
    model = ours_from(reference(cfg).state_dict(), cfg)
    add_lora(model, rank=2, targets=LORA_TARGETS)
    native = lora_state_dict(model)
    assert len(native) == cfg.num_layers * (6 * 4 + 2 * 2) * 2  # 6 attentions x 4 Linears + 2 FFNs x 2, A and B
    comfy = ltx2_lora_to_comfy(native, alpha=2.0)
    assert "diffusion_model.transformer_blocks.1.audio_to_video_attn.to_out.0.lora_A.weight" in comfy
    assert comfy["diffusion_model.transformer_blocks.0.ff.net.0.proj.alpha"].item() == 2.0
    back, alpha, rank = ltx2_lora_from_file(comfy)
    assert (alpha, rank) == (2.0, 2) and back.keys() == native.keys()
    # an ltx-trainer file: `diffusion_model.` + peft names, no alpha (scale 1); a diffusers file: `transformer.`
    trainer = {f"diffusion_model.{k}": v for k, v in native.items()}
    assert ltx2_lora_from_file(trainer)[1:] == (2.0, 2)
    assert ltx2_lora_from_file({f"transformer.{k}": v for k, v in native.items()})[0].keys() == native.keys()
    with pytest.raises(WeightsError,
                       match=r"x\.safetensors: LoRA on 1 modules .* first: transformer_blocks\.0\.attn9\.to_q"):
        ltx2_lora_from_file({"diffusion_model.transformer_blocks.0.attn9.to_q.lora_A.weight": torch.zeros(2, 4),
                             "diffusion_model.transformer_blocks.0.attn9.to_q.lora_B.weight": torch.zeros(4, 2)},
                            "x.safetensors")


def test_configs():
    for name, cfg in LTX2_DIT_CONFIGS.items():
        assert ltx2_config_from_diffusers(ltx2_config_to_diffusers(cfg)) == cfg, name
    for name in ("tiny_2.0", "tiny_2.5"):  # diffusers' own config of the model built from ours
        assert ltx2_config_from_diffusers(dict(reference(LTX2_DIT_CONFIGS[name]).config)) == LTX2_DIT_CONFIGS[name]
    # the 2.3 checkpoint header's "transformer" dict (the keys this model reads and its fixed ones)
    header = {"_class_name": "AVTransformer3DModel", "activation_fn": "gelu-approximate", "attention_bias": True,
              "attention_head_dim": 128, "caption_channels": 3840, "cross_attention_dim": 4096, "dropout": 0.0,
              "in_channels": 128, "norm_elementwise_affine": False, "norm_eps": 1e-06, "num_attention_heads": 32,
              "num_layers": 48, "out_channels": 128, "qk_norm": "rms_norm", "positional_embedding_theta": 10000.0,
              "positional_embedding_max_pos": [20, 2048, 2048], "timestep_scale_multiplier": 1000,
              "av_ca_timestep_scale_multiplier": 1000.0, "causal_temporal_positioning": True,
              "audio_num_attention_heads": 32, "audio_attention_head_dim": 64, "audio_out_channels": 128,
              "audio_cross_attention_dim": 2048, "audio_positional_embedding_max_pos": [20],
              "use_middle_indices_grid": True, "apply_gated_attention": True, "caption_proj_before_connector": True,
              "connector_num_layers": 8, "cross_attention_adaln": True, "rope_type": "split",
              "frequencies_precision": "float64"}
    assert LTX2DiTConfig.from_dict(header) == LTX2_DIT_CONFIGS["2.3"]
    with pytest.raises(ValueError, match="did you mean 'num_layers'"):
        LTX2DiTConfig.from_dict({**header, "num_layer": 2})
    with pytest.raises(ValueError, match="qk_norm='layer_norm' is not supported"):
        LTX2DiTConfig.from_dict({**header, "qk_norm": "layer_norm"})
    with pytest.raises(ValueError, match="audio_num_attention_heads.*accepted: the video's num_attention_heads=32"):
        LTX2DiTConfig(audio_num_attention_heads=16, audio_attention_head_dim=128)
    with pytest.raises(ValueError, match="rope_type.*accepted: 'split' or 'interleaved'"):
        LTX2DiTConfig(rope_type="axial")
    with pytest.raises(ValueError, match="gated_attn=True but audio_gated_attn=False"):
        ltx2_config_from_diffusers({**ltx2_config_to_diffusers(LTX2_DIT_CONFIGS["2.3"]), "audio_gated_attn": False})
    # the released widths: the same parameters as diffusers' model (on the meta device, 1 and 2 blocks);
    # with 48 blocks, ~19B parameters (the 19B of ltx-2-19b; 2.3's "22B" counts the text connectors too)
    counts = []
    for layers in (1, 2):
        cfg = LTX2DiTConfig(**{**LTX2_DIT_CONFIGS["2.5"].__dict__, "num_layers": layers})
        with torch.device("meta"):
            ours = {k: tuple(v.shape) for k, v in ltx2_to_diffusers(LTX2DiT(cfg).state_dict()).items()}
            theirs = {k: tuple(v.shape) for k, v in
                      diffusers.LTX2VideoTransformer3DModel(**ltx2_config_to_diffusers(cfg)).state_dict().items()}
        assert ours == theirs
        counts.append(sum(torch.Size(s).numel() for s in ours.values()))
    assert 18.9e9 < counts[0] + 47 * (counts[1] - counts[0]) < 19.0e9


def test_seeded_init_and_float32_islands():
    cfg = CASES["2.5"]
    a, b = LTX2DiT(cfg, init_seed=3).state_dict(), LTX2DiT(cfg, init_seed=3).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with torch.device("meta"):
        meta = LTX2DiT(cfg)
    meta.to_empty(device="cpu")
    meta.initialize_weights(3)
    assert all(torch.equal(a[k], v) for k, v in meta.state_dict().items())
    for k in ("proj_out.weight", "keyframes_abs_pos_embedding", "transformer_blocks.0.attn2.to_gate_logits.weight"):
        assert not a[k].any(), k
    assert a["transformer_blocks.1.scale_shift_table"].std().item() == pytest.approx(cfg.hidden_size ** -0.5, rel=0.3)
    low = cast_ltx2_dit(copy.deepcopy(LTX2DiT(cfg, init_seed=3)), torch.bfloat16)
    dtypes = {n: p.dtype for n, p in low.named_parameters()}
    assert dtypes["transformer_blocks.0.attn1.to_q.weight"] == torch.bfloat16 == low.compute_dtype
    for n in ("adaln_single.linear.weight", "transformer_blocks.0.scale_shift_table_a2v_ca_audio", "proj_out.weight",
              "transformer_blocks.1.audio_attn2.q_norm.weight", "keyframes_abs_pos_embedding"):
        assert dtypes[n] == torch.float32, n


def test_bf16_error_no_larger_than_diffusers_bf16():
    cfg = CASES["2.3"]
    ref = reference(cfg)
    model = ours_from(ref.state_dict(), cfg)
    kw = inputs(cfg, "t2v")
    double = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kw.items()}
    with torch.no_grad():
        truth = copy.deepcopy(model).double()(**double)
        ours = copy.deepcopy(model).to(torch.bfloat16)(**kw)  # cast_ltx2_dit: the islands stay float32
    ref_bf16 = copy.deepcopy(ref).to(torch.bfloat16)
    theirs = run_reference(ref_bf16, cfg, {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point()
                                           else v for k, v in kw.items()}, True)
    err_ours = max(rel_err(o, t) for o, t in zip(ours, truth))
    err_theirs = max(rel_err(o, t) for o, t in zip(theirs, truth))
    print(f"\nbf16 vs float64: ours {err_ours:.2e}, diffusers {err_theirs:.2e}")
    assert 0 < err_ours <= err_theirs


def test_flops_equal_the_matmuls_a_forward_runs(monkeypatch):
    """ltx2_dit_flops against a count made while a forward runs: 2 * in * out per row of every Linear call
    (forward hooks) and 4 * Lq * Lk * Dh * H per attention call (the attention entry point wrapped)."""
    counted = [0]

    def count_linear(module, args, out):
        counted[0] += 2 * args[0].numel() // module.in_features * module.in_features * module.out_features

    def counting_attention(q, k, v, **kwargs):
        counted[0] += 4 * q.shape[0] * q.shape[1] * k.shape[1] * q.shape[2] * q.shape[3]
        return attention(q, k, v, **kwargs)

    monkeypatch.setattr(ltx2_layers, "attention", counting_attention)
    for case in ("2.0", "2.5"):
        cfg = CASES[case]
        model = LTX2DiT(cfg, init_seed=0)
        hooks = [m.register_forward_hook(count_linear) for m in model.modules() if isinstance(m, torch.nn.Linear)]
        counted[0] = 0
        with torch.no_grad():
            model(**inputs(cfg, "t2v"))  # two samples at two distinct timesteps
        for h in hooks:
            h.remove()
        expected = ltx2_dit_flops(cfg, FRAMES * HEIGHT * WIDTH, AUDIO_FRAMES, TEXT, batch=2)
        assert counted[0] == expected, (case, counted[0], expected)
    public = ltx2_dit_flops(LTX2_DIT_CONFIGS["2.3"], 21 * 16 * 24, 126, 256)  # 121 frames of 512 x 768
    assert 2e14 < public < 4e14  # ~19B parameters over ~8.2k tokens (2 x 19e9 x 8.2e3 = 3.1e14 + attention)
