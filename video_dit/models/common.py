"""What the wrappers of transformers' networks (the text and image encoders) share: building one
seeded or on the meta device, and asking it for its device and activation dtype.

`module_dtype_device` reads the first floating-point parameter, so a quantized model (optimum-quanto's
integer / float8 weights) reports the dtype of its non-quantized parameters, the one its activations use.
"""

from __future__ import annotations

import torch
from torch import nn


def module_dtype_device(module: nn.Module) -> tuple[torch.dtype, torch.device]:
    """dtype and device of `module`'s first floating-point parameter (works through wrappers such as a
    DeepSpeed engine, whose ZeRO-3 placeholders keep their dtype and device)."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype, p.device
    raise ValueError(f"{type(module).__name__} has no floating-point parameters")


def build_transformers_model(cls, hf_config, seed: int | None = 0, device=None) -> nn.Module:
    """`cls(hf_config)` (a transformers model class and its config) in eval mode: randomly initialised
    from `seed` (transformers' own init, the same weights for the same seed, torch's global RNG
    untouched), or on the meta device when `device="meta"` (for `load_state_dict(..., assign=True)`)."""
    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"):
            return cls(hf_config).eval()
    # Built on CPU from the CPU generator alone (torch.manual_seed would also reseed CUDA's global
    # generators, which fork_rng(devices=[]) does not restore), so the weights do not depend on the
    # device or a default device, and every global RNG is as it was.
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.random.default_generator.manual_seed(0 if seed is None else seed)
        model = cls(hf_config)
    return model.to(device).eval() if device is not None else model.eval()


class EncoderWrapper(nn.Module):
    """Base of the frozen encoders that hold one transformers network as `self.model` (text, image)."""

    model: nn.Module

    @property
    def device(self) -> torch.device:
        return module_dtype_device(self.model)[1]

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (a quantized model reports its non-quantized parameters' dtype)."""
        return module_dtype_device(self.model)[0]
