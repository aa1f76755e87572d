"""One attention entry point for the whole package.

    attention(q, k, v, *, backend="native", attn_mask=None)   q (B, Lq, H, Dh), k/v (B, Lk, H, Dh) -> (B, Lq, H, Dh)

Backends (`BACKENDS`), the optional ones imported behind guards:
  native   torch SDPA, torch's own kernel choice (flash / memory-efficient / cuDNN, CPU included); the default
  flash    flash-attn 2 (`flash_attn.flash_attn_func`)
  flash3   FlashAttention 3, Hopper (`flash_attn_interface.flash_attn_func`, from flash-attention's hopper/)
  sage     SageAttention (`sageattention.sageattn`, quantized q/k): forward only, it has no backward
The optional kernels take no mask: masked calls (padded text, sequence-parallel padding) go through
SDPA whatever the backend (documented, not silent). Modules that attend carry an `attention_backend`
flag read inside their `forward`; `set_attention_backend` flips that flag and never swaps module
instances (so LoRA/quantization wrappers and checkpoints are untouched).
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn

BACKENDS = ("native", "flash", "flash3", "sage")
# backend -> (module, function, what to install)
_OPTIONAL = {
    "flash": ("flash_attn", "flash_attn_func", "pip install flash-attn"),
    "flash3": ("flash_attn_interface", "flash_attn_func",
               "FlashAttention 3: build flash-attention's hopper/ package (cd hopper && python setup.py install)"),
    "sage": ("sageattention", "sageattn", "pip install sageattention"),
}


def _load(backend: str):
    module, name, _ = _OPTIONAL[backend]
    try:  # optional kernels; everything works without them
        return getattr(importlib.import_module(module), name)
    except ImportError:  # the package is simply not installed
        return None


_KERNELS = {backend: _load(backend) for backend in _OPTIONAL}


def available(backend: str) -> bool:
    """Whether `backend` can run here (native always; the others when their package imports)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; accepted: {', '.join(BACKENDS)}")
    return backend == "native" or _KERNELS[backend] is not None


def flash_available() -> bool:
    return available("flash")


def missing_backend(backend: str) -> str:
    """What to say when `backend`'s package is not installed: the package and how to install it."""
    module, _, install = _OPTIONAL[backend]
    return (f"attention backend {backend!r} needs the {module} package, which is not installed ({install}); "
            "use 'native' (torch SDPA)")


def _missing(backend: str) -> RuntimeError:
    return RuntimeError(missing_backend(backend))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str = "native",
              attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention without dropout or causality.

    q: (B, Lq, H, Dh), k, v: (B, Lk, H, Dh), same dtype. attn_mask: optional bool (B, Lk) key mask
    (True = attend) or anything SDPA broadcasts to (B, H, Lq, Lk). Returns (B, Lq, H, Dh).
    The optional kernels have no mask argument: masked calls always go through SDPA.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; accepted: {', '.join(BACKENDS)}")
    if backend != "native" and attn_mask is None:
        kernel = _KERNELS[backend]
        if kernel is None:
            raise _missing(backend)
        if backend == "sage":
            if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
                raise RuntimeError("attention backend 'sage' has no backward (SageAttention is forward only): "
                                   "use it for sampling, and 'native', 'flash' or 'flash3' for training")
            return kernel(q, k, v, tensor_layout="NHD", is_causal=False)
        out = kernel(q, k, v)
        return out[0] if isinstance(out, tuple) else out  # some flash3 releases also return the LSE
    if attn_mask is not None and attn_mask.dtype == torch.bool and attn_mask.dim() == 2:
        attn_mask = attn_mask[:, None, None, :]  # (B, Lk) -> (B, 1, 1, Lk)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=attn_mask)  # (B, H, Lq, Dh)
    return out.transpose(1, 2)  # (B, Lq, H, Dh)


def set_attention_backend(model: nn.Module, backend: str) -> nn.Module:
    """Set the `attention_backend` flag on every attending module of `model` (one of `BACKENDS`)."""
    if not available(backend):
        raise _missing(backend)
    found = 0
    for module in model.modules():
        if hasattr(module, "attention_backend"):
            module.attention_backend = backend
            found += 1
    if not found:
        raise ValueError(f"{type(model).__name__} has no module with an `attention_backend` flag")
    return model


def joint_attention(q, k, v, txt_q, txt_k, txt_v, txt_key_mask, backend: str = "native"):
    """One softmax attention over [video | text] tokens: q, k, v (B, L, H, Dh), txt_* (B, Lt, H, Dh),
    txt_key_mask (B, Lt) bool (False = padding, never attended to) or None -> ((B, L, H, Dh), (B, Lt, H, Dh)).
    Every video token is a valid key. Padded text queries get some finite output, read by nothing."""
    L = q.shape[1]
    mask = None if txt_key_mask is None else F.pad(txt_key_mask, (L, 0), value=True)  # (B, L + Lt)
    out = attention(torch.cat([q, txt_q], 1), torch.cat([k, txt_k], 1), torch.cat([v, txt_v], 1),
                    backend=backend, attn_mask=mask)  # (B, L + Lt, H, Dh)
    return out[:, :L], out[:, L:]
