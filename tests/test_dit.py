"""VideoDiT: parity with diffusers' WanTransformer3DModel, conversions, the sequence-parallel seam,
gradient checkpointing, activation memory, quantization and the attention entry point."""

import threading

import helpers
import pytest
import torch

from video_dit.bench.common import profiled_peak
from video_dit.families.wan.config import DiTConfig
from video_dit.families.wan.convert import dit_from_diffusers, dit_to_diffusers
from video_dit.families.wan.dit import VideoDiT, dit_flops
from video_dit.models.attention import attention, flash_available, set_attention_backend

diffusers = pytest.importorskip("diffusers")

HEADS, HEAD_DIM, TEXT_DIM, TEXT_LEN = 2, 16, 24, 10


IMAGE_DIM, IMAGE_TOKENS = 20, 5  # a small CLIP width / token count (Wan 2.1: 1280 / 257)
# Parity tolerances from the measured errors (2-core x86 CPU, torch 2.13, diffusers 0.42.1): outputs of
# magnitude ~2, max |diff| 1.2e-6 .. 1.6e-6 (t2v, per-token, in_dim 36), tolerance 2e-5 (13x); the image
# branch 6.2e-7 / 6.8e-7 relative (FLF2V / I2V), tolerance 1e-5 (15x). One entry of a norm weight left at 1
# (a weight that failed to load) moves them 4.6e-3 / 2.3e-3 relative or more (checked in each test).
PARITY_ATOL, IMAGE_PARITY_RTOL = 2e-5, 1e-5


def reference(in_dim=4, out_dim=4, seed=0, image=None):
    """A small random diffusers Wan transformer, norms (and FLF2V's pos_embed) perturbed so their
    weights matter too. image: None, "i2v" (Wan 2.1 I2V: image_dim + added_kv_proj_dim) or "flf2v"
    (+ pos_embed_seq_len)."""
    return helpers.diffusers_wan(in_dim, out_dim, seed, head_dim=HEAD_DIM, text_dim=TEXT_DIM, image=image,
                                 image_dim=IMAGE_DIM, image_tokens=IMAGE_TOKENS)


def ours_from(ref) -> VideoDiT:
    c = ref.config
    image = {} if c.image_dim is None else dict(image_dim=c.image_dim, image_tokens=IMAGE_TOKENS,
                                                 num_images=2 if c.pos_embed_seq_len else 1)
    cfg = DiTConfig(in_dim=c.in_channels, out_dim=c.out_channels, dim=HEADS * HEAD_DIM, ffn_dim=c.ffn_dim,
                    freq_dim=c.freq_dim, text_dim=c.text_dim, num_heads=HEADS, num_layers=c.num_layers,
                    text_len=TEXT_LEN, **image)
    with torch.device("meta"):
        model = VideoDiT(cfg)
    model.load_state_dict(dit_from_diffusers(ref.state_dict()), assign=True)
    return model.eval()


def tiny(seed=0, **changes) -> VideoDiT:
    """helpers.tiny_dit: in/out 4, dim 32, 2 heads, 2 blocks, text 24 x 10, the head randomised."""
    return helpers.tiny_dit(seed, **changes)


def inputs(model, B=2, frames=3, h=4, w=6, seed=1):
    torch.manual_seed(seed)
    c = model.config
    x = torch.randn(B, c.in_dim, frames, h, w)
    context = torch.randn(B, c.text_len, c.text_dim)
    return x, torch.tensor([999.0, 250.0])[:B], context


@pytest.mark.parametrize("case", ["t2v", "per_token", "in_dim_36"])
def test_parity_with_diffusers(case):
    ref = reference(in_dim=36, out_dim=16) if case == "in_dim_36" else reference()
    ours = ours_from(ref)
    x, t, context = inputs(ours)
    if case == "per_token":  # Wan 2.2 TI2V: (B, L) timesteps, first-frame tokens at 0
        L = 3 * 2 * 3
        t = torch.rand(2, L) * 1000
        t[:, :6] = 0
    with torch.no_grad():
        expected = ref(x, t, context, return_dict=False)[0]
        got = ours(x, t, context)
    assert got.shape == expected.shape == (2, ours.config.out_dim, 3, 4, 6)
    assert (got - expected).abs().max().item() <= PARITY_ATOL
    with torch.no_grad():  # the comparison can fail: one entry of a norm weight left at 1
        ours.blocks[1].self_attn.norm_q.weight[0] = 1.0
        assert (ours(x, t, context) - expected).abs().max().item() > PARITY_ATOL


@pytest.mark.parametrize("image", ["i2v", "flf2v"])
def test_image_branch_parity_with_diffusers(image):
    """Wan 2.1 I2V / FLF2V: diffusers concatenates [image | text] and splits at length - 512, so the
    text context is 512 tokens here; FLF2V features go to diffusers as (2B, tokens, .), to us (B, 2 tokens, .)."""
    ref = reference(in_dim=36, out_dim=16, image=image)
    ours = ours_from(ref)
    x, t, _ = inputs(ours)
    context = torch.randn(2, 512, TEXT_DIM)
    clip = torch.randn(2, ours.config.image_context_len, IMAGE_DIM)
    with torch.no_grad():
        expected = ref(x, t, context, encoder_hidden_states_image=clip.reshape(-1, IMAGE_TOKENS, IMAGE_DIM),
                       return_dict=False)[0]
        got = ours(x, t, context, clip_fea=clip)
        # the image branch matters: other features, another output
        assert (ours(x, t, context, clip_fea=clip.flip(0)) - got).abs().max() > 1e-2
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= IMAGE_PARITY_RTOL * expected.abs().max().item()
    with torch.no_grad():  # the comparison can fail: one entry of the image keys' norm weight left at 1
        ours.blocks[1].cross_attn.norm_k_img.weight[0] = 1.0
        off = ours(x, t, context, clip_fea=clip)
    assert (off - expected).abs().max().item() > IMAGE_PARITY_RTOL * expected.abs().max().item()
    with pytest.raises(ValueError, match="clip_fea must be"):
        ours(x, t, context)
    with pytest.raises(ValueError, match="no image branch"):
        ours_from(reference(in_dim=36, out_dim=16))(x, t, context, clip_fea=clip)


def test_conversion_round_trips_exactly():
    sd = reference(in_dim=36, out_dim=16, image="flf2v").state_dict()
    native = dit_from_diffusers(sd)
    assert {"img_emb.emb_pos", "img_emb.proj.4.bias", "blocks.1.cross_attn.norm_k_img.weight"} <= set(native)
    assert set(native) == set(ours_from(reference(in_dim=36, out_dim=16, image="flf2v")).state_dict())
    back = dit_to_diffusers(native)
    assert list(back) == list(sd) and all(back[k] is sd[k] for k in sd)
    comfy = {"model.diffusion_model." + k: v for k, v in native.items()}
    assert dit_to_diffusers(comfy).keys() == sd.keys()
    assert dit_from_diffusers(dit_to_diffusers(comfy)).keys() == native.keys()
    # an unused image-query norm some diffusers I2V files carry is dropped, as diffusers drops it
    assert dit_from_diffusers({**sd, "blocks.0.attn2.norm_added_q.weight": torch.ones(3)}).keys() == native.keys()


def test_list_context_is_zero_padded_to_text_len():
    model = tiny().eval()
    x, t, _ = inputs(model)
    prompts = [torch.randn(3, TEXT_DIM), torch.randn(7, TEXT_DIM)]
    padded = torch.zeros(2, TEXT_LEN, TEXT_DIM)
    padded[0, :3], padded[1, :7] = prompts
    with torch.no_grad():
        assert torch.equal(model(x, t, prompts), model(x, t, padded))
        # a mask over the padding changes the result (the pretrained behaviour attends to it)
        mask = padded.abs().sum(-1) > 0
        assert not torch.allclose(model(x, t, padded, context_mask=mask), model(x, t, padded))
    with pytest.raises(ValueError, match="text_len"):
        model(x, t, [torch.randn(TEXT_LEN + 1, TEXT_DIM)] * 2)


def test_per_token_timesteps_equal_to_broadcast_when_uniform():
    model = tiny().eval()
    x, t, context = inputs(model)
    with torch.no_grad():
        a = model(x, t, context)
        b = model(x, t[:, None].expand(2, 18), context)
    assert (a - b).abs().max() < 1e-5
    with pytest.raises(ValueError, match="per-token"):
        model(x, torch.zeros(2, 5), context)


class ThreadSeqParallel:
    """Two ranks as two threads: split takes this rank's half; attention all-gathers k/v; gather
    concatenates the halves. Records the token counts the blocks saw."""

    def __init__(self, rank, shared):
        self.rank, self.shared, self.seen = rank, shared, []

    def split(self, t, dim):
        return t.chunk(2, dim=dim)[self.rank]

    def _all_gather(self, t, dim):
        s = self.shared
        s["slots"][self.rank] = t
        s["barrier"].wait()
        out = torch.cat(s["slots"], dim=dim)
        s["barrier"].wait()
        return out

    def attention(self, q, k, v):
        self.seen.append(q.shape[1])
        return attention(q, self._all_gather(k, 1), self._all_gather(v, 1))

    def gather(self, t, dim):
        return self._all_gather(t, dim)


@pytest.mark.parametrize("per_token, image", [(False, False), (True, False), (False, True)])
def test_sequence_parallel_seam(per_token, image):
    """image: the Wan 2.1 FLF2V image branch (its cross-attention stays local, the image tokens whole)."""
    branch = dict(image_dim=IMAGE_DIM, image_tokens=IMAGE_TOKENS, num_images=2) if image else {}
    models = [tiny(**branch).eval(), tiny(**branch).eval()]  # one replica per "rank"
    x, t, context = inputs(models[0])
    extra = {"clip_fea": torch.randn(2, 2 * IMAGE_TOKENS, IMAGE_DIM)} if image else {}
    if per_token:
        t = torch.rand(2, 18) * 1000
    with torch.no_grad():
        expected = models[0](x, t, context, **extra)
    shared = {"slots": [None, None], "barrier": threading.Barrier(2)}
    results, errors = [None, None], []

    def rank(r):
        try:
            models[r].seq_parallel = ThreadSeqParallel(r, shared)
            with torch.no_grad():
                results[r] = models[r](x, t, context, **extra)
        except Exception as exc:  # surfaced below, with the rank
            errors.append((r, exc))
            shared["barrier"].abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors, errors
    for r in range(2):
        assert models[r].seq_parallel.seen == [9, 9]  # each block attended over half of the 18 tokens
        assert (results[r] - expected).abs().max() < 1e-5


def test_image_branch_gradients_under_checkpointing():
    """Block checkpointing re-runs the image branch in backward: the same gradients, img_emb included."""
    model = tiny(image_dim=IMAGE_DIM, image_tokens=IMAGE_TOKENS)
    x, t, context = inputs(model)
    clip = torch.randn(2, IMAGE_TOKENS, IMAGE_DIM)
    grads = []
    for checkpointing in (False, True):
        model.enable_gradient_checkpointing() if checkpointing else model.disable_gradient_checkpointing()
        model.zero_grad(set_to_none=True)
        model(x, t, context, clip_fea=clip).square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert grads[0]["img_emb.proj.1.weight"].abs().sum() > 0 and grads[0]["blocks.1.cross_attn.k_img.weight"].abs().sum() > 0
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7, msg=n)


def test_gradient_checkpointing_same_grads_and_less_memory():
    model = tiny(dim=64, ffn_dim=256, num_heads=4)
    x, t, context = inputs(model, B=1, frames=4, h=16, w=16)  # 256 tokens

    def step():
        model.zero_grad(set_to_none=True)
        model(x, t, context).square().mean().backward()

    base_peak = profiled_peak(step)
    base = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.enable_gradient_checkpointing()
    ckpt_peak = profiled_peak(step)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, base[n], rtol=1e-5, atol=1e-6, msg=n)
    model.enable_gradient_checkpointing(offload=True)
    step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, base[n], rtol=1e-5, atol=1e-6, msg=n)
    model.disable_gradient_checkpointing()
    assert ckpt_peak < 0.8 * base_peak, (ckpt_peak, base_peak)


def test_recomputed_activations_same_grads_as_stock_autograd_and_less_memory():
    model = tiny(dim=64, ffn_dim=256, num_heads=4)
    x, t, context = inputs(model, B=1, frames=4, h=16, w=16)  # 256 tokens
    t = torch.rand(1, 256) * 1000  # per-token: the (B, L, D) modulation path

    def step():
        model.zero_grad(set_to_none=True)
        model(x, t, context).square().mean().backward()

    grads, peaks = [], []
    for recompute in (True, False):
        for block in model.blocks:
            block.recompute = recompute
        peaks.append(profiled_peak(step))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], rtol=1e-5, atol=1e-7, msg=n)
    assert peaks[0] < 0.85 * peaks[1], peaks


def test_qfloat8_quantized_forward_and_backward():
    quanto = pytest.importorskip("optimum.quanto")
    model = tiny()
    x, t, context = inputs(model)
    with torch.no_grad():
        full = model(x, t, context)
    quanto.quantize(model, weights=quanto.qfloat8)
    quanto.freeze(model)
    assert type(model.blocks[0].ffn[2]).__name__ == "QLinear"  # every Linear replaced, names kept
    x.requires_grad_(True)
    out = model(x, t, context)
    out.square().mean().backward()
    assert out.shape == full.shape and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert model.blocks[0].modulation.grad is not None
    rel = (out.detach() - full).norm() / full.norm()
    assert 0 < rel < 0.1  # fp8 weights: close to, not equal to, the full-precision output


def test_meta_build_device_dtype_and_backend_flag():
    with torch.device("meta"):
        model = VideoDiT(DiTConfig(dim=32, ffn_dim=64, freq_dim=16, text_dim=TEXT_DIM, num_heads=2,
                                   num_layers=1, text_len=TEXT_LEN))
    assert model.device.type == "meta"
    sd = {k: torch.randn(v.shape) for k, v in model.state_dict().items()}
    model.load_state_dict(sd, assign=True)
    assert model.device.type == "cpu" and model.dtype == torch.float32
    assert model.to(torch.bfloat16).dtype == torch.bfloat16
    if not flash_available():
        with pytest.raises(RuntimeError, match="flash_attn"):
            set_attention_backend(model, "flash")
    with pytest.raises(ValueError, match="accepted"):
        set_attention_backend(model, "xformers")
    set_attention_backend(model, "native")
    assert model.blocks[0].self_attn.attention_backend == "native"


def test_config_validation_and_flops():
    with pytest.raises(ValueError, match="num_heads"):
        DiTConfig(dim=100, num_heads=12)
    with pytest.raises(ValueError, match="did you mean 'num_heads'"):
        DiTConfig.from_dict({"num_head": 12})
    cfg = DiTConfig(dim=64, ffn_dim=128, num_heads=4, num_layers=2, text_dim=32, freq_dim=16)
    # doubling tokens more than doubles the FLOPs (attention is quadratic); batch is linear
    assert dit_flops(cfg, 2048, 16) > 2 * dit_flops(cfg, 1024, 16)
    assert dit_flops(cfg, 1024, 16, batch=3) == 3 * dit_flops(cfg, 1024, 16)
    # lower bound: the Linears applied to the L video tokens (self q,k,v,o, cross q,o, FFN), 2 blocks
    on_tokens = 6 * 64 * 64 + 2 * 64 * 128
    lower = 2 * 2 * 1024 * on_tokens
    attention = 2 * 4 * 1024 * 1024 * 64  # self-attention scores + weighted sum, 2 blocks
    assert lower + attention < dit_flops(cfg, 1024, 16) < 1.2 * (lower + attention)
    # the image branch adds, per block, k_img/v_img on Li tokens and attention over them, plus its MLP
    i2v = DiTConfig(**{**cfg.__dict__, "image_dim": 40, "image_tokens": 10, "num_images": 2})
    added = 2 * (2 * 20 * 64 * 2 * 64 + 4 * 1024 * 20 * 64) + 2 * 20 * 40 * (40 + 64)
    assert dit_flops(i2v, 1024, 16) - dit_flops(cfg, 1024, 16) == added


def test_bfloat16_model_tracks_float32():
    model = tiny(dim=64, num_heads=4)
    x, t, context = inputs(model)
    low = VideoDiT(model.config).to(torch.bfloat16)
    low.load_state_dict(model.state_dict())
    out, out_low = model(x, t, context), low(x, t, context)
    assert out_low.dtype == torch.float32  # `.to(bf16)` casts as cast_dit: the head is a float32 island
    assert (out_low.float() - out).norm() / out.norm() < 0.03
    out.square().mean().backward()
    out_low.float().square().mean().backward()
    for name in ("blocks.0.self_attn.norm_q.weight", "blocks.1.modulation", "time_embedding.0.weight"):
        a, b = model.get_parameter(name).grad, low.get_parameter(name).grad
        assert b.dtype == torch.float32 and (b - a).norm() / a.norm() < 0.03, name  # islands: `.to` = cast_dit
