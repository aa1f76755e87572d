"""What every wrapper around a held network asks of it: the device it runs on and its activation dtype.

`module_dtype_device` reads the first floating-point parameter, so a quantized model (optimum-quanto's
integer / float8 weights) reports the dtype of its non-quantized parameters, the one its activations use.
"""

from __future__ import annotations

import torch
from torch import nn


def module_dtype_device(module: nn.Module) -> tuple[torch.dtype, torch.device]:
    """dtype and device of `module`'s first floating-point parameter."""
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype, p.device
    raise ValueError(f"{type(module).__name__} has no floating-point parameters")


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
