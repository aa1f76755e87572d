"""Sequence parallelism (Ulysses) of the HunyuanVideo 1.5 DiT on 2 CPU ranks over gloo.

One launch of 2 ranks: with SP=2 (`attach`, `UlyssesSequenceParallel.joint_attention`) the forward output
and every parameter's gradient (averaged over the ranks, as DeepSpeed does) equal the same model without
SP on the same inputs: t2v and i2v (SigLIP and ByT5 tokens), padded text tokens, a video token count that
does not divide 2 (rank 1 holds a padded token) and one that does with no text padding at all, with and
without block checkpointing. The text stream is replicated: its parameters' gradients included.
And what an SP=2 rank keeps for backward (`CPUAllocationTracker`) equals the memory plan's
`hy15_activation_bytes` at sp=2 exactly (full fine-tune and LoRA; the SP=1 cases: test_plan_hunyuan15.py).
Run this file as a script (`--worker OUT`) to be one rank of a launch.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import replace
from pathlib import Path

import helpers
import pytest
import ranks
import torch
import torch.distributed as dist

from video_dit.families.hunyuan15.config import HY15_DIT_CONFIGS
from video_dit.families.hunyuan15.dit import HunyuanVideo15DiT
from video_dit.families.hunyuan15.memory import hy15_activation_bytes
from video_dit.models.activation_terms import Setting
from video_dit.parallel.memory import CPUAllocationTracker
from video_dit.parallel.sequence import SPInfo, attach, init_sequence_parallel, model_heads

# tiny_i2v with 4 heads (2 per rank: the exchange must keep the heads in order), head dim 16
CONFIG = replace(HY15_DIT_CONFIGS["tiny_i2v"], heads_num=4, rope_dim_list=(4, 6, 6))
# max abs difference / max abs value (fp32; summation order differs): measured 0 on the output (the same bits
# here), tolerance 1e-6; 7.6e-7 on the gradients, tolerance 1e-5 (13x)
OUT_RTOL, GRAD_RTOL = 1e-6, 1e-5

# name -> (mode, latent grid (F', h, w), text padded?, block checkpointing?)
CASES = {
    "t2v_odd": ("t2v", (3, 1, 3), True, False),  # 9 video tokens: rank 1 holds one padded token
    "i2v_odd": ("i2v", (3, 1, 3), True, False),
    "t2v_odd_checkpointing": ("t2v", (3, 1, 3), True, True),
    "i2v_odd_checkpointing": ("i2v", (3, 1, 3), True, True),
    "t2v_even_unmasked": ("t2v", (2, 2, 3), False, False),  # 12 tokens, no padding anywhere: no mask at all
}


def tiny_model() -> HunyuanVideo15DiT:
    """A tiny HunyuanVideo 1.5 DiT with every weight random and non-trivial (the seeded init zeroes the
    adaLN, output and condition-type layers, which would hide the blocks): matrices N(0, 1/fan_in),
    norm scales 1 + N(0, 0.2), other vectors N(0, 0.1); from one generator, the same on every rank."""
    return helpers.randomize_all(HunyuanVideo15DiT(CONFIG, init_seed=0), seed=0, norm_std=0.2, vector_std=0.1)


def inputs(mode: str, grid: tuple[int, int, int], text_padded: bool, seed: int = 1):
    """(x, t, kwargs, loss weight) for a batch of 2; i2v: first-frame condition, SigLIP and ByT5 tokens."""
    g = torch.Generator().manual_seed(seed)
    C = CONFIG.in_channels
    Fr, h, w = grid
    x = torch.zeros(2, 2 * C + 1, Fr, h, w)  # (B, 2C+1, F', h, w): [noisy | condition | mask]
    x[:, :C] = torch.randn(2, C, Fr, h, w, generator=g)
    kw = {"context": torch.randn(2, 6, CONFIG.text_states_dim, generator=g)}
    if text_padded:
        kw["context_mask"] = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    if mode == "i2v":
        x[:, C:2 * C, 0] = torch.randn(2, C, h, w, generator=g)
        x[:, 2 * C, 0] = 1.0
        kw["image_embeds"] = torch.randn(2, 5, CONFIG.vision_states_dim, generator=g)
        kw["glyph"] = torch.randn(2, 3, CONFIG.byt5_states_dim, generator=g)
        kw["glyph_mask"] = torch.tensor([[1, 1, 0], [0, 0, 0]])  # sample 1: no glyph tokens at all
    weight = torch.randn(2, CONFIG.out_channels, Fr, h, w, generator=g)
    return x, torch.tensor([900.0, 120.0]), kw, weight


def test_attach_reads_the_hunyuan15_head_count():
    assert model_heads(CONFIG) == 4
    with torch.device("meta"):
        model = HunyuanVideo15DiT(replace(CONFIG, heads_num=2, rope_dim_list=None))  # 2 heads of 32
    with pytest.raises(ValueError, match=r"sequence_parallel_size=4.*num_heads=2.*\[1, 2\]"):
        attach(model, SPInfo(group=None, sp_rank=0, sp_size=4, dp_rank=0, dp_size=1))  # before any process group
    assert model.seq_parallel is None
    attach(model, SPInfo(group=None, sp_rank=0, sp_size=1, dp_rank=0, dp_size=1))
    assert model.seq_parallel is None


@pytest.mark.multirank
def test_hunyuan15_sp2_matches_single_process(tmp_path):
    procs = ranks.start([__file__, "--worker", str(tmp_path)], cwd=tmp_path, log_prefix=tmp_path / "hy15", world=2)
    ranks.wait(procs, tmp_path / "hy15", timeout=300)
    results = [json.loads((tmp_path / f"hy15_rank{r}.json").read_text()) for r in range(2)]
    for rank, res in enumerate(results):
        assert sorted(res) == sorted([*CASES, "memory"]), res
        for name, c in ((n, c) for n, c in res.items() if n != "memory"):
            assert c["out_err"] < OUT_RTOL, (rank, name, c)
            assert c["grad_err"] < GRAD_RTOL, (rank, name, c["grad_err"], c["worst"])
            # the text k/v Linears (weight, bias) of every block get a gradient through the seam, and the text
            # q of all but the last block (whose text output nothing reads)
            assert c["txt_qkv_grads"] == CONFIG.mm_double_blocks_depth * 6 - 2, (rank, name, c)
            assert c["padded"] == (0 if name.endswith("even_unmasked") else 1), (rank, name, c)
        for lora in (None, 4):
            memory = res["memory"][str(lora)]
            assert memory["saved"] == memory["planned"], (rank, lora, memory)


def _worker(out: Path) -> None:
    import deepspeed  # the ranks only: a slow import the test process does not need

    deepspeed.init_distributed("gloo")
    info = init_sequence_parallel(2)

    def run(model, x, t, kw, weight):
        model.zero_grad(set_to_none=True)
        y = model(x, t, **kw)  # (B, C_out, F', h, w)
        (y * weight).sum().backward()
        return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    results = {}
    for name, (mode, grid, text_padded, ckpt) in CASES.items():
        model = tiny_model()
        if ckpt:
            model.enable_gradient_checkpointing()
        x, t, kw, weight = inputs(mode, grid, text_padded)
        y_ref, g_ref = run(model, x, t, kw, weight)
        attach(model, info)
        y_sp, g_sp = run(model, x, t, kw, weight)
        _, local = next(iter(model.seq_parallel._valid))  # (stream, the split's per-rank length)
        model.seq_parallel = None
        assert g_sp.keys() == g_ref.keys(), sorted(set(g_sp) ^ set(g_ref))
        errs = {}
        for n, gr in g_sp.items():
            dist.all_reduce(gr)  # DeepSpeed averages over all ranks
            errs[n] = ((gr / 2 - g_ref[n]).abs().max() / g_ref[n].abs().max().clamp_min(1e-12)).item()
        worst = max(errs, key=errs.get)
        results[name] = {"out_err": ((y_sp - y_ref).abs().max() / y_ref.abs().max()).item(),
                         "grad_err": errs[worst], "worst": worst,
                         "txt_qkv_grads": sum(1 for n in g_sp if re.search(r"\.txt_attn_[qkv]\.", n)
                                              and g_ref[n].abs().max() > 0),
                         "padded": 2 * local - math.prod(grid)}  # padded video tokens of the split
    results["memory"] = {str(lora): _saved_under_sp(info, lora) for lora in (None, 4)}
    (out / f"hy15_rank{dist.get_rank()}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _saved_under_sp(info, lora) -> dict:
    """What one SP=2 rank keeps after the forward of an i2v batch of 2 (32 video tokens, 16 per rank; 5
    SigLIP, 3 ByT5 and 6 Qwen tokens), and what the plan says."""
    from video_dit.families.hunyuan15.dit import LORA_TARGETS
    from video_dit.lora import add_lora

    model = tiny_model()
    if lora:
        add_lora(model, lora, targets=LORA_TARGETS)
    attach(model, info)
    grid = (2, 4, 4)
    x, t, kw, weight = inputs("i2v", grid, True)
    model(x, t, **kw).sum().backward()  # gradients and RoPE tables exist before the measured step
    with CPUAllocationTracker() as tracker:
        loss = (model(x, t, **kw) - weight).square().mean()
        saved = tracker.settled_live() - 4  # 4: the loss itself
    del loss
    planned = hy15_activation_bytes(CONFIG, grid, Setting(0, sp=2, micro_batch=2), lora_rank=lora, s=4, text_len=6,
                                    glyph_len=3, image_len=5)
    return {"saved": saved, "planned": planned.saved}


if __name__ == "__main__" and len(sys.argv) >= 3 and sys.argv[1] == "--worker":
    torch.set_num_threads(1)
    _worker(Path(sys.argv[2]))
