"""Sequence parallelism (Ulysses) of the LTX-2 DiT over both streams on 2 CPU ranks over gloo.

One launch of 2 ranks: with SP=2 (`attach`; `UlyssesSequenceParallel.self_attention`, `cross_modal_attention`,
`text_attention`, `split` / `gather` by stream) the forward's two outputs and every parameter's gradient
(summed over the ranks and halved, as DeepSpeed averages) equal the same model without SP on the same inputs:
t2v and i2v (per-token video timesteps, the 2.5 keyframe embedding), padded text, a video token count AND an
audio one that do not divide 2 (rank 1 holds a padded token of each stream), counts that do with no text
padding at all (2.0's caption projections), with no / some / every block checkpointed. 4 heads: each rank
holds 2, so the exchange must keep them in order.
And what an SP=2 rank keeps for backward (`CPUAllocationTracker`) equals the memory plan's
`ltx2_activation_bytes` at sp=2 exactly (full fine-tune and LoRA, t2v and i2v, a checkpointed block, both streams
padded; the SP=1 cases: test_plan_ltx2.py).
Run this file as a script (`--worker OUT`) to be one rank of a launch.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import helpers
import pytest
import ranks
import torch
import torch.distributed as dist

from video_dit.families.ltx2.dit import LTX2DiT
from video_dit.families.ltx2.dit_config import LTX2_DIT_CONFIGS
from video_dit.parallel.sequence import attach, init_sequence_parallel

# the tiny configs with 4 heads (video 4 x 8, audio 4 x 4: the same widths)
HEADS = dict(num_attention_heads=4, attention_head_dim=8, audio_num_attention_heads=4, audio_attention_head_dim=4)
CONFIGS = {v: replace(LTX2_DIT_CONFIGS[f"tiny_{v}"], **HEADS) for v in ("2.0", "2.3", "2.5")}
# max |SP=2 - SP=1| / max |SP=1|, outputs and each gradient (fp32; the split attention sums in another order).
# Measured (torch 2.13 CPU, one thread): outputs <= 1.9e-7, gradients <= 2.6e-6 (the text attention's key
# biases, whose gradient nearly cancels over the queries); the tolerance is ~12x the larger.
RTOL = 3e-5

# name -> (variant, mode, latent grid (F', h, w), audio latent frames, text padded?, checkpointed blocks)
CASES = {
    "t2v_odd": ("2.3", "t2v", (3, 1, 3), 5, True, 0),  # 9 video, 5 audio tokens: rank 1 pads one of each
    "i2v_odd": ("2.5", "i2v", (3, 1, 3), 5, True, 0),
    "t2v_odd_checkpointing": ("2.3", "t2v", (3, 1, 3), 5, True, 2),
    "i2v_odd_one_checkpointed": ("2.5", "i2v", (3, 1, 3), 5, True, 1),
    "2.0_even_unmasked": ("2.0", "t2v", (2, 2, 3), 6, False, 0),  # 12 and 6 tokens, no padding anywhere
}
TEXT = 6


def tiny_model(variant: str, seed: int = 0) -> LTX2DiT:
    """A tiny LTX-2 DiT with every weight random and non-trivial (its seeded init zeroes the gates' logits,
    the keyframe embedding and the output Linears, which would hide the blocks); the same on every rank."""
    return helpers.randomize_all(LTX2DiT(CONFIGS[variant], init_seed=0), seed=seed, norm_std=0.2, vector_std=0.1)


def inputs(variant: str, mode: str, grid: tuple[int, int, int], frames: int, text_padded: bool, seed: int = 1):
    """(forward keywords, video loss weight, audio loss weight) for a batch of 2."""
    cfg = CONFIGS[variant]
    g = torch.Generator().manual_seed(seed)
    width = (cfg.caption_channels,) * 2 if not cfg.caption_proj_before_connector \
        else (cfg.hidden_size, cfg.audio_hidden_size)
    t = torch.tensor([900.0, 120.0])
    kw = dict(video=torch.randn(2, cfg.in_channels, *grid, generator=g), video_timestep=t,
              audio=torch.randn(2, 2, frames, cfg.audio_in_channels // 2, generator=g),
              audio_timestep=torch.tensor([400.0, 700.0]),
              video_context=torch.randn(2, TEXT, width[0], generator=g),
              audio_context=torch.randn(2, TEXT, width[1], generator=g), fps=24.0)
    if text_padded:
        mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1] * TEXT], dtype=torch.bool)  # as the trainer's batches
        kw.update(video_context_mask=mask, audio_context_mask=mask)
    if mode == "i2v":  # the first latent frame's tokens at timestep 0 (marked as keyframes: 2.5)
        L, first = math.prod(grid), grid[1] * grid[2]
        tokens = t[:, None].repeat(1, L)
        tokens[:, :first] = 0.0
        kw["video_timestep"] = tokens
        if cfg.use_keyframes_abs_pos_embedding:
            kw["keyframes_mask"] = (torch.arange(L) < first).float().expand(2, L)
    weights = (torch.randn(2, cfg.out_channels, *grid, generator=g), torch.randn(kw["audio"].shape, generator=g))
    return kw, weights


# ~12 s; the trainer's SP 2 = SP 1 for LTX-2 stays in CI (test_train_ltx2.py) (docs/tests.md, "Kept out of CI")
@pytest.mark.slow
@pytest.mark.multirank
def test_ltx2_sp2_matches_single_process(tmp_path):
    procs = ranks.start([__file__, "--worker", str(tmp_path)], cwd=tmp_path, log_prefix=tmp_path / "ltx2", world=2)
    ranks.wait(procs, tmp_path / "ltx2", timeout=300)
    results = [json.loads((tmp_path / f"ltx2_rank{r}.json").read_text()) for r in range(2)]
    worst = {"out": 0.0, "grad": 0.0}
    for rank, res in enumerate(results):
        assert sorted(res) == sorted([*CASES, "memory"]), res
        for name, c in ((n, c) for n, c in res.items() if n != "memory"):
            print(f"rank {rank} {name}: output {c['out_err']:.1e}, gradient {c['grad_err']:.1e} ({c['worst']})")
        for name, c in ((n, c) for n, c in res.items() if n != "memory"):
            assert c["out_err"] < RTOL, (rank, name, c)
            assert c["grad_err"] < RTOL, (rank, name, c["grad_err"], c["worst"])
            assert c["missing"] == [], (rank, name, c["missing"])  # every gradient of SP=1 reaches some rank
            padded = CASES[name][2:4]
            assert c["padded"] == [math.prod(padded[0]) % 2, padded[1] % 2], (rank, name, c)
            worst = {"out": max(worst["out"], c["out_err"]), "grad": max(worst["grad"], c["grad_err"])}
        assert all(m["saved"] == m["planned"] for m in res["memory"].values()), (rank, res["memory"])
    print(f"\nSP=2 vs SP=1: outputs {worst['out']:.1e}, gradients {worst['grad']:.1e} (relative)")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _worker(out: Path) -> None:
    import deepspeed  # the ranks only: a slow import the test process does not need

    deepspeed.init_distributed("gloo")
    info = init_sequence_parallel(2)

    def run(model, kw, weights):
        model.zero_grad(set_to_none=True)
        video, audio = model(**kw)  # (B, C, F', h, w), (B, Ca, T, M)
        ((video * weights[0]).sum() + (audio * weights[1]).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and p.grad.any()}
        return (video.detach(), audio.detach()), grads

    results = {}
    for name, (variant, mode, grid, frames, text_padded, ckpt) in CASES.items():
        model = tiny_model(variant)
        model.set_checkpointed_blocks(ckpt)
        kw, weights = inputs(variant, mode, grid, frames, text_padded)
        y_ref, g_ref = run(model, kw, weights)
        attach(model, info)
        assert model.seq_parallel.recompute == (ckpt < len(model.blocks))
        y_sp, g_sp = run(model, kw, weights)
        locals_ = {stream: local for (stream, local) in model.seq_parallel._valid}  # each stream's per-rank length
        model.seq_parallel = None
        errs, missing = {}, []
        for n, gr in g_ref.items():  # a rank whose tokens do not reach a parameter has no gradient for it
            g = g_sp.get(n, torch.zeros_like(gr))
            dist.all_reduce(g)  # DeepSpeed averages over all ranks
            errs[n] = _rel(g / 2, gr)
            if not g.any():
                missing.append(n)
        worst = max(errs, key=errs.get)
        results[name] = {"out_err": max(_rel(a, b) for a, b in zip(y_sp, y_ref)), "grad_err": errs[worst],
                         "worst": worst, "missing": missing,
                         "padded": [2 * locals_["video"] - math.prod(grid), 2 * locals_["audio"] - frames]}
    results["memory"] = {name: _saved_under_sp(info, *case) for name, case in MEMORY.items()}
    (out / f"ltx2_rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


# the memory cases at SP=2: (LoRA rank, mode, checkpointed blocks of 2): 27 video and 9 audio tokens, both padded
MEMORY = {"full_t2v": (None, "t2v", 0), "lora_t2v": (4, "t2v", 0), "full_i2v_one_checkpointed": (None, "i2v", 1),
          "full_i2v": (None, "i2v", 0), "full_t2v_one_checkpointed": (None, "t2v", 1),
          "lora_i2v": (4, "i2v", 0)}


def _saved_under_sp(info, lora, mode, ckpt) -> dict:
    """What one SP=2 rank keeps after the forward of a batch of 1 (2.3; 27 video and 9 audio tokens, 14 / 5 per
    rank; 6 text tokens), measured as test_plan_ltx2 measures it, and what the plan says."""
    from video_dit.families.ltx2.dit import LORA_TARGETS
    from video_dit.families.ltx2.memory import ltx2_activation_bytes
    from video_dit.lora import add_lora
    from video_dit.models.activation_terms import Setting
    from video_dit.parallel.memory import CPUAllocationTracker

    model = tiny_model("2.3")
    if lora:
        add_lora(model, lora, targets=LORA_TARGETS)
    model.set_checkpointed_blocks(ckpt)
    attach(model, info)
    grid, frames = (3, 3, 3), 9
    kw, weights = inputs("2.3", mode, grid, frames, True)
    kw = {k: v[:1] if isinstance(v, torch.Tensor) else v for k, v in kw.items()}  # batch 1
    sum(o.sum() for o in model(**kw)).backward()  # gradients and RoPE tables exist before the measured step
    with CPUAllocationTracker() as tracker:
        loss = sum((o - w[:1]).square().mean() for o, w in zip(model(**kw), weights))
        saved = tracker.settled_live() - 4  # 4: the loss itself
    del loss
    setting = Setting(0, sp=2, checkpointing=ckpt > 0, checkpoint_blocks=ckpt)
    planned = ltx2_activation_bytes(CONFIGS["2.3"], grid, setting, lora_rank=lora, s=4, text_len=TEXT,
                                    audio_tokens=frames, per_token=mode == "i2v", text_masked=True)
    return {"saved": saved, "planned": planned.saved}


if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "--worker":
    torch.set_num_threads(1)
    _worker(Path(sys.argv[2]))
