"""Build the DiT a job trains: `build_dit`, the one function every trainer path calls per DiT.

    build_dit(source, preset=, zero_stage=, dtype=, device=, seed=, ds_config=) -> VideoDiT

ZeRO 0-2: `load_dit` (every rank holds the whole model; its tensors read one module at a time).
ZeRO-3: no rank ever holds the whole model. In order:
  1. the weights are opened, not read (`open_dit`): names converted from the diffusers / ComfyUI
     layouts to native names and checked against the model (and the job's preset) on shapes alone;
  2. the DiT is built on the meta device (no memory, no init);
  3. one module group (one DiT block, or one top-level module) at a time, rank 0 reads its tensors
     (a preset's: Wan's init of each parameter by name, `init_parameter`), every other rank makes
     an empty tensor of the same shape, and DeepSpeed converts the module's parameters to ZeRO-3
     parameters: a broadcast from rank 0, then each rank keeps its 1/N flat partition
     (`deepspeed.zero.Init(module=...)`, DeepSpeed's own conversion, the one `deepspeed.initialize`
     would run on a whole model); the group's full tensors are freed before the next is read.
A rank's set-up peak is thus its partitions (1/N of the model) + one module group in full + on rank
0 the file pages of that group (the `LazyWeights` file is closed after each group); freed heap pages
are handed back after each group (`release_freed_memory`).
`deepspeed.initialize` later finds the parameters already partitioned and only converts what was
added since (the LoRA adapters, which peft injects into the partitioned Linears: peft reads only
`in_features` / `out_features` and the base weight's dtype and device, all unchanged by ZeRO-3).

Per-parameter dtypes are those of the unpartitioned path (`video_dit.models.dit.param_dtypes`: at
bf16 the float32 islands stay float32), so a partitioned build and `load_dit` give the same model,
parameter for parameter; `cast_dit` then sets the compute dtype (the casts it would do are none).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from video_dit.models.loading import check_state_dict, module_groups, open_dit, stored_dtype
from video_dit.parallel.memory import release_freed_memory


def build_dit(source: str | os.PathLike, preset=None, *, zero_stage: int = 0, dtype: torch.dtype | None = None,
              device=None, seed: int = 0, ds_config: dict | None = None, config=None):
    """The `VideoDiT` of `source` (`preset:NAME`, a diffusers / original Wan / ComfyUI folder or file,
    as `load_dit` reads), checked against `preset` (a `Preset`: the job's `model.preset`) when given.

    zero_stage 3 builds it partitioned (see the module docstring): every rank must call, with
    torch.distributed initialised and `ds_config` the job's DeepSpeed JSON (the dict that
    `deepspeed.initialize` will get: it carries the parameter offload and persistence settings).
    dtype None keeps the stored dtype (uniform), as `load_dit`. Raises `WeightsError` naming the
    source and the first mismatching keys before any tensor is read.
    """
    from video_dit.models.loading import load_dit

    if zero_stage != 3:
        dit = load_dit(source, dtype=dtype, device=device, config=config, seed=seed)
        if preset is not None:
            check_matches_preset(dit, preset, str(source))
        return dit
    if ds_config is None:
        raise ValueError("build_dit(zero_stage=3) needs ds_config, the job's DeepSpeed JSON")
    return _build_partitioned(str(source), preset, dtype, seed, ds_config, config)


def make_trainable(dit, process, dtype: torch.dtype, sp_info=None):
    """The trainer's fixed order after the build (at `engine.build_dtype(dtype, lora)`), in place: the
    attention backend; LoRA adapters (peft, `network`) or the whole DiT trainable; the storage for
    training in `dtype` (`engine.cast_for_training`: trainable parameters float32, the frozen bulk in
    `dtype`, the float32 islands float32); block checkpointing; then sequence parallelism (after
    checkpointing: the seam recomputes attention in backward only without it)."""
    from video_dit.parallel.sequence import attach
    from video_dit.train.engine import cast_for_training

    dit.set_attention_backend(process.model.attention_backend)
    if process.network is not None:
        from video_dit.lora import add_lora, lora_targets

        add_lora(dit, process.network.linear, process.network.alpha, dropout=process.network.dropout,
                 targets=lora_targets(process.network.include_img_emb))
    else:
        dit.requires_grad_(True)
    cast_for_training(dit, dtype)
    dit.set_recompute_saved(process.train.recompute_saved)
    if process.train.gradient_checkpointing:
        dit.enable_gradient_checkpointing()
    if sp_info is not None:
        attach(dit, sp_info)  # dit.seq_parallel: Ulysses attention when sequence_parallel_size > 1
    return dit


def check_matches_preset(dit, preset, source: str) -> None:
    """`WeightsError` naming `source` and the first mismatching keys when `dit` (a model or a
    {name: tensor} mapping, meta tensors included) is not shaped like `preset`'s DiT (weights of
    another preset would otherwise meet the wrong VAE / text encoder)."""
    from video_dit.models.dit import VideoDiT

    shapes = dit if isinstance(dit, dict) else {n: _full_shape(p) for n, p in dit.state_dict(keep_vars=True).items()}
    with torch.device("meta"):
        expected = VideoDiT(preset.dit)
    check_state_dict(expected, shapes, f"{source} (model.preset: {preset.name})")


class _Shape:
    """Something with a `.shape`, for shape checks of ZeRO-3 parameters (whose `.shape` is empty)."""

    def __init__(self, shape):
        self.shape = tuple(shape)


def _full_shape(p: torch.Tensor):
    return _Shape(p.ds_shape) if hasattr(p, "ds_shape") else p


def _build_partitioned(source: str, preset, dtype, seed: int, ds_config: dict, config):
    import torch.distributed as dist

    from video_dit.models.dit import VideoDiT, cast_dit, init_parameter, param_dtypes, parameter_generator
    from video_dit.models.presets import get_preset

    if not dist.is_initialized():
        raise RuntimeError("build_dit(zero_stage=3) needs torch.distributed initialised (every rank calls it)")
    rank0 = dist.get_rank() == 0
    weights = None
    if source.startswith("preset:"):
        config = config or get_preset(source[len("preset:"):]).dit
        description = source
    else:
        weights, config, description = open_dit(source, config)
    with torch.device("meta"):
        model = VideoDiT(config)
    if next(model.buffers(), None) is not None:
        raise RuntimeError("build_dit(zero_stage=3): VideoDiT has buffers; they need materialising here too")
    if weights is not None:  # 1. names and shapes, before any tensor is read
        shapes = weights.meta()
        check_state_dict(model, shapes, description)
        if dtype is None:
            dtype = stored_dtype(shapes, description)
    dtype = dtype or torch.float32
    if preset is not None:
        check_matches_preset(dict(model.state_dict(keep_vars=True)), preset, source)

    dtypes = param_dtypes(model, dtype)  # as load_dit(dtype=) stores them
    owners = {}  # parameter name -> (module, attribute)
    for mname, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            owners[f"{mname}.{pname}" if mname else pname] = (module, pname)
    convert = None
    for group in module_groups(owners):  # 3. one block (or top-level module) at a time
        if rank0:
            tensors = weights.read(group) if weights is not None else None
        for name in group:
            module, attr = owners[name]
            meta = getattr(module, attr)
            target = dtypes[name]
            if not rank0:  # filled by DeepSpeed's broadcast from rank 0
                full = torch.empty(meta.shape, dtype=target)
            elif weights is not None:
                full = tensors.pop(name).to(dtype=target, copy=True)
            else:  # a preset: Wan's init of this parameter, by name (as `VideoDiT.initialize_weights`)
                full = init_parameter(config, name, torch.empty(meta.shape, dtype=target),
                                      parameter_generator(seed, name))
            param = nn.Parameter(full, requires_grad=meta.requires_grad)
            setattr(module, attr, param)
            if convert is None:  # the first parameter sets up DeepSpeed's converter (the job's config)
                import deepspeed

                deepspeed.zero.Init(module=nn.ParameterList([param]), config_dict_or_path=ds_config, dtype=target)
                convert = param.convert_to_zero_parameters
            else:
                convert(param_list=[param])
            del full, param
        if rank0:
            del tensors
        release_freed_memory()
    return cast_dit(model, dtype)  # the compute dtype; every parameter already has its dtype


def partition_numel(model: nn.Module) -> dict[str, int]:
    """{parameter name: elements this rank holds} (ZeRO-3: its partition; otherwise the whole tensor)."""
    return {n: (p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()) for n, p in model.named_parameters()}
