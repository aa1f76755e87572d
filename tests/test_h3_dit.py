"""H3DiT: parity with diffusers' MiniMaxH3Transformer3DModel on random weights, the sequence packed by diffusers'
own pipeline steps (t2va, and fl2va with first / last keyframes, a padded prompt and a vision block), siblings
that must fail, block checkpointing, the sequence-parallel seam, the key conversions (against diffusers'
single-file converter), LoRA keys (read back by diffusers' converter), configs and the released size (against
the checkpoint index's byte count), seeded init and float32 islands, FLOPs against counted matmuls."""

import copy
import threading

import helpers
import pytest
import torch

from video_dit.families.minimax_h3 import layers as h3_layers
from video_dit.families.minimax_h3 import packing
from video_dit.families.minimax_h3.convert import (deinterleave_qkv, h3_config_to_diffusers, h3_from_diffusers,
                                                   h3_key_layout, h3_lora_from_file, h3_lora_to_comfy, h3_native_for,
                                                   h3_to_diffusers, h3_to_native, infer_h3_config, interleave_qkv,
                                                   qkv_layout_of_config)
from video_dit.families.minimax_h3.dit import (ADALN_LORA_TARGETS, LORA_TARGETS, H3DiT, cast_h3_dit, h3_dit_flops,
                                               param_dtypes)
from video_dit.families.minimax_h3.dit_config import H3_DIT_CONFIGS, H3DiTConfig
from video_dit.models.attention import attention
from video_dit.models.weights import WeightsError

diffusers = pytest.importorskip("diffusers")
from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_minimax_h3_lora_to_diffusers  # noqa: E402
from diffusers.loaders.single_file_utils import convert_minimax_h3_transformer_checkpoint_to_diffusers  # noqa: E402
from diffusers.modular_pipelines.minimax_h3.before_denoise import (MiniMaxH3PrepareLayoutStep,  # noqa: E402
                                                                   MiniMaxH3SetTimestepsStep, patchify_video_latents)

# max |ours - diffusers| / max |diffusers|, float32. Measured (torch 2.13 CPU, one thread): t2va video 2.0e-7
# audio 1.6e-7, fl2va video 2.1e-7 audio 1.6e-7 (the largest over both samples); the tolerance is ~14x the largest.
PARITY_RTOL = 3e-6
CFG = H3_DIT_CONFIGS["tiny"]
FRAMES, HEIGHT, WIDTH, AUDIO_FRAMES, TEXT = 3, 4, 6, 5, 7  # 18 video rows, 6 per keyframe, 2 x 5 audio rows
TAGS = torch.tensor([1, 1, 0, 0, 0, 1, 1])  # a label, a 3-row vision block, the prompt


def reference(seed: int = 0):
    """diffusers' model of the tiny config, every weight random and non-trivial (matrices N(0, 1/fan_in), norm
    scales 1 + N(0, 0.2), biases N(0, 0.1)): the zero-initialised AdaLN and heads would hide the blocks."""
    torch.manual_seed(seed)
    ref = diffusers.MiniMaxH3Transformer3DModel(**h3_config_to_diffusers(CFG)).eval()
    return helpers.randomize_all(ref, seed=seed, norm_std=0.2, vector_std=0.1)


def ours_from(sd: dict, cfg: H3DiTConfig = CFG, qkv_layout: str = "stacked") -> H3DiT:
    with torch.device("meta"):
        model = H3DiT(cfg)
    model.load_state_dict(h3_native_for(model, sd, "reference", qkv_layout), assign=True)
    return model.eval()


def inputs(task: str, seed: int = 1) -> dict:
    """Our forward's keyword arguments for two samples at their own timesteps. fl2va: a first and a last keyframe
    at timestep 1 (0..1000: the pipeline's max(t, 0.999) in MiniMax's time), sample 0's prompt padded."""
    g = torch.Generator().manual_seed(seed)
    kw = dict(video=torch.randn(2, CFG.in_channels, FRAMES, HEIGHT, WIDTH, generator=g),
              audio=torch.randn(2, CFG.audio_channels, CFG.audio_in_channels, AUDIO_FRAMES, generator=g),
              text=torch.randn(2, TEXT, CFG.text_dim, generator=g),
              timestep=torch.tensor([250.0, 600.0]), audio_timestep=torch.tensor([400.0, 900.0]))
    if task == "fl2va":
        kw.update(text_mask=torch.tensor([[1] * 5 + [0] * 2, [1] * TEXT]).bool(), text_tags=TAGS,
                  keyframes=torch.randn(2, CFG.in_channels, 2, HEIGHT, WIDTH, generator=g),
                  keyframe_anchors=("first", "last"), keyframe_timestep=torch.tensor([1.0, 1.0]))
    return kw


def h3_time(t: torch.Tensor) -> float:
    """Our 0..1000 timestep as MiniMax's t = 1 - sigma, the float32 value the model computes."""
    return (1.0 - t.float() / 1000.0).item()


def run_reference(ref, kw: dict, anchors=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """diffusers' model on each sample as its pipeline calls it (one request, batch 1): the layout from the
    pipeline's `build_packed_sequence` (the sample's real text rows only), rows patchified by its
    `patchify_video_latents`, the row timesteps by `build_row_timesteps` (audio references at t = 1). Returns
    per sample (video, audio) velocities, MiniMax's sign, in our layouts."""
    anchors = kw.get("keyframe_anchors", ()) if anchors is None else anchors
    mask, tags = kw.get("text_mask"), kw.get("text_tags", torch.ones(TEXT, dtype=torch.long))
    out = []
    for b in range(kw["video"].shape[0]):
        n = TEXT if mask is None else int(mask[b].sum())
        pos, tt, vi, ai, ti, ncond, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            tags[:n], FRAMES, HEIGHT, WIDTH, AUDIO_FRAMES, CFG.patch_size, CFG.audio_channels, 2, 0, anchors)
        rows = [patchify_video_latents(kw["keyframes"][b:b + 1, :, k:k + 1], CFG.patch_size)
                for k in range(len(anchors))]
        rows = torch.cat(rows + [patchify_video_latents(kw["video"][b:b + 1], CFG.patch_size)])
        audio = kw["audio"][b].transpose(1, 2).reshape(-1, CFG.audio_in_channels)  # channel-major rows
        key_t = h3_time(kw["keyframe_timestep"][b]) if anchors else 1.0
        unique, index = MiniMaxH3SetTimestepsStep.build_row_timesteps(
            vi, ai, ncond, 0, n, h3_time(kw["timestep"][b]), h3_time(kw["audio_timestep"][b]), key_t, 1.0)
        with torch.no_grad():
            v, a = ref(rows[None], audio[None], kw["text"][b:b + 1, :n], unique, index, tt, pos, vi, ai, ti,
                       return_dict=False)
        v = v[0, ncond:].reshape(FRAMES, HEIGHT // 2, WIDTH // 2, CFG.in_channels, 1, 2, 2)  # decoders.py's unpack
        v = v.permute(3, 0, 4, 1, 5, 2, 6).reshape(CFG.in_channels, FRAMES, HEIGHT, WIDTH)
        out.append((v, a[0].reshape(CFG.audio_channels, AUDIO_FRAMES, -1).transpose(1, 2)))
    return out


def rel_err(got, expected) -> float:
    return ((got.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def errors(model, ref, kw, ours_kw=None, anchors=None) -> tuple[float, float]:
    """(video, audio) worst relative errors over the samples of `model` (its velocity negated: MiniMax's sign)."""
    with torch.no_grad():
        video, audio = model(**(ours_kw or kw))
    expected = run_reference(ref, kw, anchors)
    return (max(rel_err(-video[b], v) for b, (v, _) in enumerate(expected)),
            max(rel_err(-audio[b], a) for b, (_, a) in enumerate(expected)))


@pytest.mark.parametrize("task", ["t2va", "fl2va"])
def test_parity_with_diffusers(task):
    ref = reference()
    model = ours_from(ref.state_dict())
    kw = inputs(task)
    err = errors(model, ref, kw)
    print(f"\nparity {task}: video {err[0]:.1e}, audio {err[1]:.1e}")
    assert max(err) <= PARITY_RTOL, err
    with torch.no_grad():  # every input reaches both outputs
        base = model(**kw)
        for key in ("text", "audio", "video") + (("keyframes",) if task == "fl2va" else ()):
            changed = model(**{**kw, key: kw[key].flip(0)})
            assert min(rel_err(changed[0], base[0]), rel_err(changed[1], base[1])) > 1e-3, key


def test_parity_fails_on_one_weight_or_one_layout_fact():
    """Siblings of the parity test that must fail: one AdaLN row of one modality perturbed (the audio gate of
    block 1), the keyframe anchors swapped, the qkv rows read as per-head interleaved, a padded prompt's rows
    taken as real (diffusers run on sample 0's padded prompt: its rows attended to, its media clock at 7)."""
    ref = reference()
    sd = ref.state_dict()
    kw = inputs("fl2va")
    D = CFG.hidden_size
    bad = dict(sd)
    w = sd["transformer_blocks.1.adaln_proj.linear.bias"].clone()
    w[2 * 6 * D + 2 * D: 2 * 6 * D + 3 * D] += 0.05  # modality 2 (audio), gate_msa
    bad["transformer_blocks.1.adaln_proj.linear.bias"] = w
    padded = {**kw, "text_mask": None}  # diffusers sees 7 rows for sample 0, ours 5
    failing = {
        "audio AdaLN row": errors(ours_from(bad), ref, kw),
        "anchors swapped": errors(ours_from(sd), ref, kw, anchors=("last", "first")),
        "qkv interleaved": errors(ours_from(h3_from_diffusers(sd), qkv_layout="interleaved"), ref, kw),
        "padded rows as real": errors(ours_from(sd), ref, padded, ours_kw=kw),
    }
    print("\nfailing siblings: " + ", ".join(f"{k} {max(v):.1e}" for k, v in failing.items()))
    # measured: 1.4e-2, 6.5e-3, 1.7e-1, 1.8e-2 (>= 2000x PARITY_RTOL)
    assert all(max(v) > 100 * PARITY_RTOL for v in failing.values()), failing


def test_block_checkpointing_same_gradients():
    model = ours_from(reference().state_dict()).train()
    kw = inputs("fl2va")
    grads = []
    for on in (False, True):
        model.enable_gradient_checkpointing() if on else model.disable_gradient_checkpointing()
        model.zero_grad(set_to_none=True)
        video, audio = model(**kw)
        (video.square().mean() + audio.square().mean()).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[1].keys() == grads[0].keys() == {n for n, _ in model.named_parameters()}
    worst = max(rel_err(grads[1][n], grads[0][n]) for n in grads[0] if grads[0][n].abs().max() > 0)
    print(f"\ncheckpointed vs not: worst gradient error {worst:.1e}")
    for n in grads[0]:  # measured: bitwise equal (0.0); the tolerance leaves room for a reordered recompute
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7, msg=n)
    with pytest.raises(ValueError, match="accepted"):
        model.set_attention_backend("xformers")


class ThreadSeqParallel:
    """Two ranks as two threads sharing a buffer. split takes this rank's half (the model gives it an even row
    count; the AdaLN entries' half recorded); attention all-gathers k, v and the key mask over the ranks;
    gather all-gathers."""

    size = 2

    def __init__(self, rank: int, shared: dict):
        self.rank, self.shared, self.calls, self.entries = rank, shared, [], None

    def split(self, t, dim):
        assert t.shape[dim] % 2 == 0, t.shape
        part = t.chunk(2, dim=dim)[self.rank]
        if t.dtype == torch.long:  # the rows' AdaLN entries (N,)
            self.entries = part
        return part

    def _all_gather(self, t, dim):
        s = self.shared
        s["slots"][self.rank] = t
        s["barrier"].wait()
        out = torch.cat(s["slots"], dim=dim)
        s["barrier"].wait()
        return out

    def gather(self, t, dim):
        return self._all_gather(t, dim)

    def attention(self, q, k, v, key_mask):
        self.calls.append(q.shape[1])
        mask = None if key_mask is None else self._all_gather(key_mask, 1)
        return attention(q, self._all_gather(k, 1), self._all_gather(v, 1), attn_mask=mask)


@pytest.mark.parametrize("task", ["t2va", "fl2va"])
def test_sequence_parallel_seam_is_the_blocks_only_attention(task, monkeypatch):
    sd = reference().state_dict()
    models = [ours_from(sd), ours_from(sd)]  # one replica per "rank"
    kw = inputs(task)  # fl2va: 47 rows (one padded), a text key mask; t2va: 35 rows (one padded), no mask
    with torch.no_grad():
        expected = models[0](**kw)
    direct = []  # attention calls outside the seam: only the refiner's, on the text rows

    def recording_attention(q, k, v, **kwargs):
        direct.append(q.shape[1])
        return attention(q, k, v, **kwargs)

    monkeypatch.setattr(h3_layers, "attention", recording_attention)
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
    keyframe_rows = len(kw.get("keyframe_anchors", ())) * 6
    # each rank: half of every segment, rounded up (the 7 text rows: one padded row on rank 1)
    local = (TEXT + 1) // 2 + keyframe_rows // 2 + AUDIO_FRAMES + FRAMES * 3
    text_audio_video = {packing.E_TEXT, packing.E_AUDIO, packing.E_VIDEO}
    for r in range(2):
        assert models[r].seq_parallel.calls == [local] * CFG.num_layers
        held = set(models[r].seq_parallel.entries.tolist())  # every rank holds rows of every modality
        assert held == text_audio_video | ({packing.E_KEYFRAME} if keyframe_rows else set()), (r, held)
    assert direct == [TEXT] * 2 * CFG.num_refiner_layers
    worst = max(rel_err(results[r][s], expected[s]) for r in range(2) for s in range(2))
    print(f"\ntwo ranks vs one ({task}): {worst:.1e}")
    assert worst < 2e-6  # measured 1.3e-7 (t2va) / 2.0e-7 (fl2va): the halves' attention sums in another order; ~10x


def test_rank_order_gives_each_rank_a_slice_of_every_segment():
    """`packing.rank_order` on 7 text, 0 keyframe, 5 audio and 4 video rows over 2 ranks, written out by hand:
    rank 0 text 0-3, audio 7-9, video 12-13; rank 1 text 4-6 + a zero row, audio 10-11 + a zero row, video 14-15."""
    order = packing.rank_order((7, 0, 5, 4), 2)
    pad = 16
    assert order.index.tolist() == [0, 1, 2, 3, 7, 8, 9, 12, 13, 4, 5, 6, pad, 10, 11, pad, 14, 15]
    assert order.real.tolist() == [i != pad for i in order.index.tolist()]
    x = torch.randn(2, 16, 3)
    moved = order.reorder(x, 1)  # (2, 18, 3)
    assert moved.shape == (2, 18, 3) and not moved[:, ~order.real].any()
    assert torch.equal(order.restore(moved, 1), x)


def test_bad_inputs_are_named():
    model = H3DiT(CFG, init_seed=0)
    kw = inputs("fl2va")
    bad = {"audio layout": ({**kw, "audio": kw["audio"].transpose(1, 2)}, r"audio has shape \(2, 6, 2, 5\)"),
           "timestep": ({**kw, "timestep": torch.tensor([250.0, 1200.0])}, "timestep .* on 0..1000"),
           "anchor": ({**kw, "keyframe_anchors": ("first", "middle")}, "'middle' is not accepted"),
           "keyframes": ({**kw, "keyframes": kw["keyframes"][:, :, :1]}, r"len\(keyframe_anchors\)=2"),
           "left padding": ({**kw, "text_mask": kw["text_mask"].flip(1)}, "right-padded"),
           "mask shape": ({**kw, "text_mask": kw["text_mask"][:, :5]}, r"text_mask \(2, 5\): expected \(2, 7\)"),
           "tags": ({**kw, "text_tags": torch.full((TEXT,), 2)}, r"text_tags \(7,\)"),
           "video": ({**kw, "video": kw["video"][:, :, :, :3]}, r"h, w divisible by patch_size")}
    for what, (args, message) in bad.items():
        with pytest.raises(ValueError, match=message):
            model(**args)
    t2va = inputs("t2va")
    with torch.no_grad():  # a mask with no padding is no mask
        same = [torch.equal(a, b) for a, b in zip(model(**t2va), model(**t2va, text_mask=torch.ones(2, TEXT)))]
    assert same == [True, True]
    with pytest.raises(ValueError, match=r"H3DiTConfig.num_layers=0: a positive integer"):
        H3DiTConfig(num_layers=0)
    with pytest.raises(ValueError, match=r"rope_freq_dim=32: 6 x rope_freq_dim = 192"):
        H3DiTConfig(rope_freq_dim=32)


def test_conversions_round_trip_and_bad_keys_are_named():
    ref = reference()
    diffusers_sd = ref.state_dict()
    native = h3_from_diffusers(diffusers_sd)
    with torch.device("meta"):
        assert native.keys() == H3DiT(CFG).state_dict().keys()
    back = h3_to_diffusers(native)
    assert back.keys() == diffusers_sd.keys() and all(torch.equal(back[k], diffusers_sd[k]) for k in back)
    assert h3_key_layout(native) == "native" and h3_key_layout(diffusers_sd) == "diffusers"
    # MiniMax's own shards: qkv interleaved per head, the rope buffer stored; diffusers' single-file converter
    # (told the layout) must give the model diffusers' keys from them, and ours the native ones
    original = {k: interleave_qkv(v, CFG.head_dim) if k.endswith("qkv_proj.weight") else v for k, v in native.items()}
    original["rope.inv_freq"] = ref.rope.inv_freq.clone()
    assert torch.equal(ours_from(diffusers_sd).rope_inv_freq("cpu"), ref.rope.inv_freq)
    theirs = convert_minimax_h3_transformer_checkpoint_to_diffusers(dict(original), h3_config_to_diffusers(CFG),
                                                                    qkv_layout="interleaved")
    assert theirs.keys() == diffusers_sd.keys() and all(torch.equal(theirs[k], diffusers_sd[k]) for k in theirs)
    comfy = {f"model.diffusion_model.{k}": v for k, v in native.items()}
    for layout, sd in (("interleaved", original), ("stacked", comfy),
                       ("stacked", {f"transformer.{k}": v for k, v in diffusers_sd.items()})):
        out = h3_to_native(sd, qkv_layout=layout)
        assert out.keys() == native.keys() and all(torch.equal(out[k], native[k]) for k in native)
    w = torch.arange(3 * 2 * 4.0)[:, None]  # 2 heads of 4 rows: [q0 k0 v0 q1 k1 v1] -> [q0 q1 k0 k1 v0 v1]
    assert deinterleave_qkv(w, 4).flatten().tolist() == [*range(0, 4), *range(12, 16), *range(4, 8),
                                                         *range(16, 20), *range(8, 12), *range(20, 24)]
    assert qkv_layout_of_config({"_class_name": "MiniMaxH3DiTModel"}) == "interleaved"
    assert qkv_layout_of_config({"_class_name": "MiniMaxH3Transformer3DModel"}) == "stacked"
    assert infer_h3_config(diffusers_sd, rope_freq_dim=CFG.rope_freq_dim) == CFG == infer_h3_config(original)
    with pytest.raises(ValueError, match="qkv_layout='interleaved' given for diffusers' names"):
        h3_to_native(diffusers_sd, qkv_layout="interleaved")
    with pytest.raises(ValueError, match=r"ckpt\.safetensors: .*1 unexpected keys, first: blocks\.0\.attn\.to_x"):
        h3_to_native({**native, "blocks.0.attn.to_x.weight": torch.zeros(1)}, "ckpt.safetensors")
    with torch.device("meta"):
        model = H3DiT(CFG)
    partial = {k: v for k, v in native.items() if k != "final_layer.audio_out.bias"}
    partial["condition_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(WeightsError, match=r"(?s)file\.safetensors.*1 missing: final_layer\.audio_out\.bias.*wrong "
                                           r"shape: condition_proj\.weight: file \(3, 3\)"):
        h3_native_for(model, partial, "file.safetensors")


def test_lora_keys_read_by_comfyui_and_diffusers():
    from video_dit.lora import add_lora, from_comfy, lora_state_dict

    model = ours_from(reference().state_dict())
    add_lora(model, rank=2, targets=LORA_TARGETS)
    native = lora_state_dict(model)
    assert len(native) == CFG.num_layers * 4 * 2  # qkv_proj, out_proj, fc1, fc2 of every block; A and B
    assert not any("adaln_proj" in k or "token_refiner" in k for k in native)
    comfy = h3_lora_to_comfy(native, alpha=2.0)
    assert "diffusion_model.blocks.1.attn.qkv_proj.lora_A.weight" in comfy
    back, alpha, rank = from_comfy(comfy, "x", from_file=h3_lora_from_file)
    assert (alpha, rank) == (2.0, 2) and back.keys() == native.keys()
    # diffusers' converter reads our file onto modules its model has (qkv split, fc1's B halves swapped)
    converted = _convert_non_diffusers_minimax_h3_lora_to_diffusers(dict(comfy))
    modules = {n for n, _ in reference().named_modules()}
    assert {k.removeprefix("transformer.").rsplit(".", 2)[0] for k in converted} <= modules
    up = native["blocks.0.mlp.fc1.lora_B.weight"]
    assert torch.equal(converted["transformer.transformer_blocks.0.ff.net.0.proj.lora_B.weight"],
                       torch.cat(up.chunk(2)[::-1]))
    # musubi-tuner's flattened kohya names and DiffSynth's per-head-interleaved qkv (128-wide heads)
    musubi = {"lora_unet_blocks_3_attn_qkv_proj.lora_down.weight": torch.zeros(2, 5),
              "lora_unet_blocks_3_attn_qkv_proj.lora_up.weight": torch.zeros(9, 2),
              "lora_unet_blocks_3_attn_qkv_proj.alpha": torch.tensor(1.0),
              "lora_unet_token_refiner_blocks_0_mlp_fc2.lora_down.weight": torch.zeros(2, 5)}
    assert sorted(h3_lora_from_file(musubi)) == ["blocks.3.attn.qkv_proj.alpha", "blocks.3.attn.qkv_proj.lora_A.weight",
                                                 "blocks.3.attn.qkv_proj.lora_B.weight",
                                                 "token_refiner.blocks.0.mlp.fc2.lora_A.weight"]
    b = torch.randn(2 * 3 * 128, 2)
    diffsynth = h3_lora_from_file({"blocks.0.attn.qkv_proj.lora_B.default.weight": b})
    assert torch.equal(diffsynth["blocks.0.attn.qkv_proj.lora_B.weight"], deinterleave_qkv(b, 128))
    with pytest.raises(ValueError, match=r"x\.safetensors: LoRA on 1 modules .* first: blocks\.0\.attn\.to_q"):
        h3_lora_from_file({"blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 4)}, "x.safetensors")
    assert ADALN_LORA_TARGETS == r"blocks\.\d+\.adaln_proj\.linear"


def test_configs_and_the_released_size():
    # MiniMax's original config.json (FL2VA/transformer/config.json, GitHub mirror commit 8d8824e) and diffusers'
    original = {"_class_name": "MiniMaxH3DiTModel", "_diffusers_version": "0.32.2", "hidden_size": 5376,
                "num_layers": 50, "token_refiner_num_layers": 2, "num_attention_heads": 56, "attention_head_dim": 128,
                "ffn_hidden_size": 14336, "latents_dim": 24, "audio_latents_dim": 32, "patch_size": [1, 2, 2],
                "text_dim": 5120, "timestep_input_dim": 256, "time_embed_hidden_size": 5376, "time_embed_dim": 2688,
                "adaln_out_features": 96768, "final_adaln_out_features": 10752, "rope_inv_freq_len": 16,
                "norm_eps": 1e-05, "qk_norm_eps": 1e-05, "final_norm_eps": 1e-05}
    released = H3_DIT_CONFIGS["fl2va"]
    assert H3DiTConfig.from_dict(original) == released == H3_DIT_CONFIGS["ref2va"]
    assert H3DiTConfig.from_dict(h3_config_to_diffusers(released)) == released
    assert H3DiTConfig.from_dict(dict(reference().config)) == CFG
    with pytest.raises(ValueError, match="did you mean 'num_layers'"):
        H3DiTConfig.from_dict({"num_layer": 2})
    with pytest.raises(ValueError, match="adaln_out_features=96000 does not fit hidden_size=5376"):
        H3DiTConfig.from_dict({**original, "adaln_out_features": 96000})
    # the released widths on the meta device: the same shapes as diffusers' model, 1 and 2 blocks -> 50
    counts, adaln = [], 0
    for layers in (1, 2):
        cfg = H3DiTConfig(num_layers=layers)
        with torch.device("meta"):
            model = H3DiT(cfg)
            theirs = diffusers.MiniMaxH3Transformer3DModel(**h3_config_to_diffusers(cfg)).state_dict()
        ours = {k: tuple(v.shape) for k, v in h3_to_diffusers(model.state_dict()).items()}
        assert ours == {k: tuple(v.shape) for k, v in theirs.items()}
        counts.append(sum(p.numel() for p in model.parameters()))
        adaln = sum(p.numel() for n, p in model.named_parameters() if n.startswith("blocks.0.adaln_proj"))
        float32 = sum(p.numel() for n, p in model.named_parameters() if n.startswith((
            "video_patch_proj", "audio_patch_proj", "time_embedder", "final_layer.video_out", "final_layer.audio_out")))
    total = counts[0] + 49 * (counts[1] - counts[0])
    print(f"\nreleased: {total / 1e9:.3f}B parameters, block AdaLN {50 * adaln / 1e9:.3f}B")
    # the checkpoint index's byte count (FL2VA/transformer/model.safetensors.index.json total_size): bf16 but for
    # the float32 projections, timestep MLP and heads (SGLang MINIMAX_H3_FP32_PARAM_NAMES) and rope.inv_freq (16 x 4)
    assert 2 * total + 2 * float32 + 16 * 4 == 66280430144
    assert 50 * adaln == 50 * (2688 + 1) * 96768


def test_seeded_init_and_float32_islands():
    a, b = H3DiT(CFG, init_seed=3).state_dict(), H3DiT(CFG, init_seed=3).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with torch.device("meta"):
        meta = H3DiT(CFG)
    meta.to_empty(device="cpu")
    meta.initialize_weights(3)
    assert all(torch.equal(a[k], v) for k, v in meta.state_dict().items())
    for k in ("blocks.1.adaln_proj.linear.weight", "final_layer.adaln_proj.linear.bias",
              "final_layer.video_out.weight"):
        assert not a[k].any(), k
    low = cast_h3_dit(copy.deepcopy(H3DiT(CFG, init_seed=3)), torch.bfloat16)
    dtypes = {n: p.dtype for n, p in low.named_parameters()}
    for n in ("blocks.0.attn.qkv_proj.weight", "blocks.0.adaln_proj.linear.weight", "condition_proj.weight"):
        assert dtypes[n] == torch.bfloat16 == low.compute_dtype, n
    for n in ("video_patch_proj.weight", "time_embedder.proj_out.bias", "final_layer.adaln_proj.linear.weight",
              "final_layer.audio_out.weight", "blocks.1.attn.k_norm.weight", "token_refiner.final_norm.weight"):
        assert dtypes[n] == torch.float32, n
    assert param_dtypes(low, torch.bfloat16, masters=True)["blocks.0.mlp.fc1.weight"] == torch.float32


def test_bf16_error_no_larger_than_diffusers_bf16():
    ref = reference()
    model = ours_from(ref.state_dict())
    kw = inputs("t2va")
    double = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in kw.items()}
    with torch.no_grad():
        truth = copy.deepcopy(model).double()(**double)
        ours = copy.deepcopy(model).to(torch.bfloat16)(**kw)  # cast_h3_dit: the islands stay float32
    ref_bf16 = copy.deepcopy(ref).to(torch.bfloat16)  # diffusers keeps its _keep_in_fp32_modules only on load
    theirs = run_reference(ref_bf16, {k: v.to(torch.bfloat16) if k in ("video", "audio", "text") else v
                                      for k, v in kw.items()})
    err_ours = max(rel_err(o, t) for o, t in zip(ours, truth))
    err_theirs = max(max(rel_err(v, -truth[0][b]), rel_err(a, -truth[1][b])) for b, (v, a) in enumerate(theirs))
    print(f"\nbf16 vs float64: ours {err_ours:.2e}, diffusers {err_theirs:.2e}")  # measured 1.84e-3, 9.48e-3
    assert 0 < err_ours <= err_theirs


def test_flops_equal_the_matmuls_a_forward_runs(monkeypatch):
    """h3_dit_flops against a count made while a forward runs: 2 * in * out per row of every Linear call (forward
    hooks) and 4 * Lq * Lk * Dh * H per attention call (the attention entry point wrapped)."""
    counted = [0]

    def count_linear(module, args, out):
        counted[0] += 2 * args[0].numel() // module.in_features * module.in_features * module.out_features

    def counting_attention(q, k, v, **kwargs):
        counted[0] += 4 * q.shape[0] * q.shape[1] * k.shape[1] * q.shape[2] * q.shape[3]
        return attention(q, k, v, **kwargs)

    monkeypatch.setattr(h3_layers, "attention", counting_attention)
    model = H3DiT(CFG, init_seed=0)
    hooks = [m.register_forward_hook(count_linear) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for task, keyframe_rows in (("t2va", 0), ("fl2va", 12)):
        counted[0] = 0
        kw = inputs(task)
        with torch.no_grad():
            model(**kw)
        expected = h3_dit_flops(CFG, FRAMES * 6, TEXT, 2 * AUDIO_FRAMES, batch=2, keyframe_tokens=keyframe_rows)
        assert counted[0] == expected, (task, counted[0], expected)
    for h in hooks:
        h.remove()
    # the release at 768 x 1344, 124 frames (5.2 s: 37 latent frames of 24 x 42 rows, 206 x 2 audio rows), 512 text
    public = h3_dit_flops(H3_DIT_CONFIGS["fl2va"], 37 * 24 * 42, 512, 2 * 206)
    # 19.3B block Linear parameters x 2 x 38.2k rows = 1.5e15, + attention 4 N^2 I x 50 layers = 2.1e15
    assert 3e15 < public < 4e15
