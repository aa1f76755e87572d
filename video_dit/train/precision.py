"""The dtype policy of training: which dtype a job computes in, how its DiT is built and stored, and
the quantization of a LoRA job's frozen base.

  train.dtype bf16   bf16 on GPU ranks; CPU ranks train in float32 (CPU bf16 matmuls are slow)
                     unless `train.cpu_bf16` forces bf16 (to test that path on CPU)
  the build          a LoRA job's frozen base in the training dtype (its float32 islands float32),
                     a full fine-tune in float32 (every parameter is trainable: float32 masters)
  the storage        the family's cast (`DiTArch.cast`) with masters=True: trainable parameters float32 (the
                     optimizer's master weights, updated in place by AdamW), the frozen bulk in the
                     training dtype except the float32 islands; the forward under bf16 autocast with
                     its float32 islands, as Wan runs its float32 weights. DeepSpeed's own bf16 mode
                     stays off (`parallel/zero.py`): it would cast every parameter
  quantization       after `deepspeed.initialize` (which walks and casts every parameter), the frozen
                     Linears of the blocks as optimum-quanto weights; ZeRO 0-2 only (ZeRO-3 cannot
                     partition packed tensors: refused by the config)
"""

from __future__ import annotations

import torch

from video_dit.devices import on_gpu


def train_dtype(name: str, cpu_bf16: bool = False) -> torch.dtype:
    """The compute dtype of a job's `train.dtype`: bf16 on GPU; on CPU ranks float32 (CPU bf16
    matmuls are slow) unless `train.cpu_bf16` forces bf16 (for testing the bf16 path on CPU)."""
    if name in ("bf16", "bfloat16") and (on_gpu() or cpu_bf16):
        return torch.bfloat16
    return torch.float32


def cpu_fp32_notice(name: str, dtype: torch.dtype) -> str | None:
    """The one log line of a job that asks for bf16 and trains in float32 on CPU ranks (else None)."""
    if name in ("bf16", "bfloat16") and dtype == torch.float32:
        return ("train.dtype is bf16, but these are CPU ranks: training in float32 (CPU bf16 matmuls are slow); "
                "set train.cpu_bf16: true to train in bf16 here")
    return None


def build_dtype(dtype: torch.dtype, lora: bool) -> torch.dtype:
    """The dtype a DiT trained in `dtype` is built / loaded at (`build_dit(dtype=)`): a LoRA job's
    frozen base in `dtype` (its float32 islands stay float32), a full fine-tune in float32 (every
    parameter is trainable: float32 master weights)."""
    return dtype if lora else torch.float32


def cast_for_training(model, dtype: torch.dtype, arch):
    """The DiT's storage for training in `dtype`, set after its trainable parameters are chosen: its
    family's cast (`arch`: `families.DiTArch`) with `masters=True` (module docstring).
    ZeRO-3 parameters, already partitioned, must have their dtype from the build (`build_dtype`): a
    partition is never cast here."""
    want = arch.param_dtypes(model, dtype, masters=True)
    wrong = [n for n, p in model.named_parameters() if hasattr(p, "ds_tensor") and p.dtype != want[n]]
    if wrong:
        raise RuntimeError(f"ZeRO-3 parameters {', '.join(wrong[:3])} are {dict(model.named_parameters())[wrong[0]].dtype}, "
                           f"not their training dtype {want[wrong[0]]}: build the DiT at build_dtype()")
    return arch.cast(model, dtype, masters=True)


def quantize_frozen(model, qtype: str, arch) -> None:
    """optimum-quanto weights for the frozen Linears of the blocks; the LoRA adapters and the float32
    islands (time MLPs, head: the family's `float32_modules`) stay in full precision."""
    from optimum import quanto

    exclude = ["*lora_A*", "*lora_B*", *(f"{name}*" for name in arch.float32_modules)]
    quanto.quantize(model, weights=getattr(quanto, qtype), exclude=exclude)
    quanto.freeze(model)
