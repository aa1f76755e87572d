"""What the networks share: the seeded, device-independent initialisation of our own DiTs (one
generator per parameter name), and for the wrappers of transformers' networks (the text and image
encoders) building one seeded or on the meta device and asking it for its device and activation dtype.

`module_dtype_device` reads the first floating-point parameter, so a quantized model (optimum-quanto's
integer / float8 weights) reports the dtype of its non-quantized parameters, the one its activations use.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager, nullcontext
from typing import Callable

import torch
from torch import nn


def parameter_generator(seed: int, name: str) -> torch.Generator:
    """The CPU generator of one parameter's initial values: seeded by (seed, parameter name)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2 ** 63 - 1))


def initialize_by_name(module: nn.Module, init: Callable, config, seed: int | None) -> None:
    """`init(config, name, parameter, generator)` for every materialised parameter of `module`, each
    generator seeded by (`seed`, name) (`parameter_generator`): the same values whatever order or device
    the parameters are made in. `seed=None` draws the seed from torch's global CPU RNG, so
    `torch.manual_seed(s); Model(cfg)` stays reproducible. A no-op on the meta device."""
    params = [(n, p) for n, p in module.named_parameters() if p.device.type != "meta"]
    if params and seed is None:
        seed = int(torch.randint(0, 2 ** 62, (), device="cpu").item())
    for name, p in params:
        init(config, name, p, parameter_generator(seed, name))


class IslandCast:
    """What a DiT with float32 islands (norms, modulation tables, embeddings kept float32 while the bulk
    computes in bf16) adds to `nn.Module` (first in its bases): `to(dtype)` that keeps the islands, and
    `precision`, the forward's autocast. The class names its cast (`cast_dit`, `cast_hy15_dit`) in `cast`
    and keeps `compute_dtype` (None: the bulk weights' dtype) and a `dtype` property."""

    def cast(self, dtype: torch.dtype):
        raise NotImplementedError

    def to(self, *args, **kwargs):
        """`nn.Module.to`, except that a floating dtype casts as `self.cast(dtype)` does: the float32
        islands stay float32 and the bulk computes in `dtype`. Why: code that owns the model casts it
        whole (ai-toolkit's trainer calls `unet.to(device, dtype=train_dtype)` after `load_model` and
        after each preview), which would make the islands bf16. Every parameter is cast as a frozen one
        (the trainer's float32 masters come from the cast's `masters=True`); the pure cast is
        `nn.Module.to(model, dtype)`."""
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is None or not dtype.is_floating_point:
            return super().to(*args, **kwargs)
        if device is not None:
            super().to(device, non_blocking=non_blocking)
        return self.cast(dtype)

    def precision(self, device_type: str):
        """The forward's context: a bf16 / fp16 model (`compute_dtype`, else its bulk weights' dtype) runs
        under torch autocast in that dtype, as Wan and Tencent run theirs; its weight cache is off (each
        weight is used once per forward; the cache would keep a low-precision copy of every weight until
        the forward ends). A float32 / float64 model adds nothing: a caller's autocast applies."""
        dtype = self.compute_dtype or self.dtype
        if dtype in (torch.bfloat16, torch.float16):
            return torch.autocast(device_type, dtype=dtype, cache_enabled=False)
        return nullcontext()


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
    with seeded_cpu_rng(0 if seed is None else seed):
        model = cls(hf_config)
    return model.to(device).eval() if device is not None else model.eval()


@contextmanager
def seeded_cpu_rng(seed: int):
    """Inside the block, modules are built on the CPU with torch's CPU generator seeded with `seed`
    (an enclosing device context does not apply); afterwards the generator's state is as before.
    No CUDA generator is read or reseeded: the same seed gives the same weights whatever the device
    the result is moved to, and the caller's random streams are untouched."""
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.default_generator.manual_seed(seed)
        yield


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


ENCODER_QUANTIZE = ("qfloat8", "qint8")  # optimum-quanto weight types of a frozen encoder (text, image)


def check_quantize(quantize: str | None) -> None:
    if quantize is not None and quantize not in ENCODER_QUANTIZE:
        raise ValueError(f"quantize={quantize!r}; accepted: None, {', '.join(ENCODER_QUANTIZE)}")


def quantize_encoder(model: nn.Module, quantize: str | None) -> None:
    """Quantize a frozen encoder's weights in place (optimum-quanto, `quantize` from ENCODER_QUANTIZE)
    and freeze them; None leaves it as it is."""
    if quantize is None:
        return
    from optimum import quanto

    quanto.quantize(model, weights=getattr(quanto, quantize))
    quanto.freeze(model)
