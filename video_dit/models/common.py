"""What the networks share: the seeded, device-independent initialisation of our own DiTs (one
generator per parameter name), and for the wrappers of transformers' networks (the text and image
encoders) building one seeded or on the meta device and asking it for its device and activation dtype.

`module_dtype_device` reads the first floating-point parameter, so a quantized model (optimum-quanto's
integer / float8 weights) reports the dtype of its non-quantized parameters, the one its activations use.
"""

from __future__ import annotations

import hashlib
import logging
import time
from contextlib import contextmanager, nullcontext
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)

# Inductor options every compiled block gets. Mix-order reduction fuses the LayerNorm-backward row
# reduction with the adaLN modulation's reduction over tokens into one kernel; for this model's
# scale/shift tables it returns a wrongly shaped gradient ("CompiledFunctionBackward returned an invalid
# gradient ... got [1536] but expected shape compatible with [1, 1, 1536]", pytorch#178080) or, for the
# chained modulated norms of a Wan block at long sequences, silently wrong ones (pytorch#193061: torch
# 2.10+, workaround TORCHINDUCTOR_MIX_ORDER_REDUCTION=0). It only exists in Inductor's Triton backend.
COMPILE_OPTIONS = {"triton.mix_order_reduction": False}


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


class BlockTraining:
    """What a DiT made of a `blocks` list of transformer blocks adds for training (a base before
    `nn.Module`): block checkpointing of all, none or the first n blocks (`set_checkpointed_blocks`,
    `run_block` in the forward), the sequence-parallel seam's recompute flag kept in step with it, and
    regional compilation (`compile_blocks`). The class sets, in its constructor, `checkpointed_blocks =
    frozenset()`, `offload_checkpoints = False`, `recompute_saved = True`, `blocks_compiled = False`,
    `seq_parallel = None`; `_set_block_recompute` is its hook for what its blocks store in forward."""

    def enable_gradient_checkpointing(self, offload: bool = False, blocks=None) -> None:
        """Re-run blocks in backward (when grad is enabled): every block, or `blocks` (as
        `set_checkpointed_blocks` takes them). `offload`: keep the saved block inputs in CPU memory
        (pinned on CUDA) instead of on the device, for long videos."""
        self.offload_checkpoints = offload
        self.set_checkpointed_blocks(len(self.blocks) if blocks is None else blocks)

    def disable_gradient_checkpointing(self) -> None:
        self.offload_checkpoints = False
        self.set_checkpointed_blocks(0)

    def set_checkpointed_blocks(self, blocks) -> None:
        """Checkpoint only some blocks: an int n is the first n (0: none, len(blocks): all), else an
        iterable of block indices. The first blocks rather than spread ones: a step's peak is in the
        backward of the last block, so leaving the last blocks whole keeps a re-run block out of it
        (the memory plan counts it so); the compute is the same either way. Whichever blocks, the
        forward and backward compute the same numbers."""
        n = len(self.blocks)
        if isinstance(blocks, bool) or not isinstance(blocks, int):
            chosen = frozenset(int(i) for i in blocks)
        elif 0 <= blocks <= n:
            chosen = frozenset(range(blocks))
        else:
            raise ValueError(f"checkpointed blocks: {blocks} is not a number of blocks in 0..{n}")
        if any(not 0 <= i < n for i in chosen):
            raise ValueError(f"checkpointed blocks {sorted(chosen)}: indices must be in 0..{n - 1}")
        self.checkpointed_blocks = chosen
        # the sequence-parallel seam's flag (`seq_parallel.recompute`): it recomputes its exchange in backward
        # unless every block is checkpointed (a checkpointed block keeps nothing inside anyway)
        if self.seq_parallel is not None and hasattr(self.seq_parallel, "recompute"):
            self.seq_parallel.recompute = not self.gradient_checkpointing
        self._set_block_recompute()

    @property
    def gradient_checkpointing(self) -> bool:
        """Every block checkpointed (`checkpointed_blocks` says which when only some are)."""
        return len(self.checkpointed_blocks) == len(self.blocks) > 0

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, on: bool) -> None:  # diffusers' attribute, for code that sets it
        self.set_checkpointed_blocks(len(self.blocks) if on else 0)

    def set_recompute_saved(self, on: bool) -> None:
        """Without block checkpointing: whether the blocks store cheap elementwise results as recipes
        recomputed in backward (on, the default) or keep them (`_set_block_recompute` applies it)."""
        self.recompute_saved = on
        self._set_block_recompute()

    def _set_block_recompute(self) -> None:
        """The class's hook: tell each block what to store (nothing to tell by default)."""

    def run_block(self, i: int, block: nn.Module, *args):
        """Block i of the forward on `args`: checkpointed (re-run in backward) when it is one of
        `checkpointed_blocks` and grad is on, its saved inputs in host memory with `offload_checkpoints`."""
        if i not in self.checkpointed_blocks or not torch.is_grad_enabled():
            return block(*args)
        # save_on_cpu moves the checkpoint's saved inputs (this block's activations in) to host memory
        pinned = next((a.is_cuda for a in args if isinstance(a, torch.Tensor)), False)
        offload = torch.autograd.graph.save_on_cpu(pin_memory=pinned) if self.offload_checkpoints else nullcontext()
        with offload:
            return checkpoint(block, *args, use_reentrant=False)

    def compile_blocks(self, example: tuple | None = None, **compile_kwargs) -> float | None:
        """torch.compile each block in place (regional compilation: the blocks share one graph per
        input shape; module names and the state dict are unchanged), with `COMPILE_OPTIONS` under any
        `options` given; `compile_kwargs` go to torch.compile as they are (its default dynamic=None
        compiles a graph with symbolic token counts once a second count appears: bucketed training
        does not recompile per bucket). `_set_block_recompute` sees `blocks_compiled` (Inductor chooses
        what to save). Compilation happens on the first call. With `example` (the forward's positional
        arguments), one step compiles now (forward + backward when a parameter requires grad; before
        DeepSpeed wraps the model, whose grad hooks would see it), every .grad is left as it was, and
        the seconds it took (the compile time) are logged and returned; else None."""
        options = {**COMPILE_OPTIONS, **compile_kwargs.pop("options", {})}
        self.blocks_compiled = True
        self._set_block_recompute()
        for block in self.blocks:
            block.compile(options=options, **compile_kwargs)
        if example is None:
            return None
        stashed = {p: p.grad for p in self.parameters()}  # backward makes new .grad tensors, these stay as they are
        for p in stashed:
            p.grad = None
        train = any(p.requires_grad for p in stashed)
        t0 = time.perf_counter()
        with torch.set_grad_enabled(train):
            out = self(*example)
            if train:
                out.float().square().mean().backward()
        seconds = time.perf_counter() - t0
        for p, g in stashed.items():
            p.grad = g
        log.info("compiled %d DiT blocks (forward + backward) in %.1f s", len(self.blocks), seconds)
        return seconds



def storage_dtypes(model: nn.Module, dtype: torch.dtype, float32_names: set[str],
                   masters: bool = False) -> dict[str, torch.dtype]:
    """The storage dtype of each floating parameter of a model that computes in `dtype`: float32 for its
    float32 islands (`float32_names`, the family's) and, with `masters`, for every parameter that requires
    grad (the optimizer then updates float32 master weights in place); `dtype` for the rest (frozen bulk
    weights, inference). Every way of building a DiT (loading, the trainer, a partitioned constructor)
    stores these."""
    keep = float32_names if dtype != torch.float32 else set()
    return {name: torch.promote_types(dtype, torch.float32) if name in keep or (masters and p.requires_grad) else dtype
            for name, p in model.named_parameters() if p.is_floating_point()}


def cast_to_storage(model: nn.Module, dtypes: dict[str, torch.dtype], dtype: torch.dtype) -> nn.Module:
    """Cast in place: each parameter to its `dtypes` entry (`storage_dtypes`) and `model.compute_dtype =
    dtype`, so the forward runs the bulk under `dtype` autocast and the float32 islands in float32.
    (`nn.Module.to(model, torch.bfloat16)` instead casts every parameter: the pure-bf16 baseline of
    `video-dit bench --suite precision`.)"""
    for name, p in model.named_parameters():
        if name in dtypes and p.dtype != dtypes[name]:
            p.data = p.data.to(dtypes[name])
    model.compute_dtype = dtype if dtype in (torch.bfloat16, torch.float16) else None
    return model

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


def te_quantization(model_config) -> str | None:
    """`load_text_encoder`'s `quantize` for a job's `model` block (ours or ai-toolkit's ModelConfig:
    `quantize_te`, `qtype_te`; ai-toolkit's "float8" is its name for qfloat8). None: not quantized."""
    if not model_config.quantize_te:
        return None
    return "qfloat8" if model_config.qtype_te == "float8" else model_config.qtype_te
