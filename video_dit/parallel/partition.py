"""The ZeRO-3 build of a DiT: no rank ever holds the whole model. In order:

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

Per-parameter dtypes are those of the unpartitioned path (the family's `DiTArch.param_dtypes`: at
bf16 the float32 islands stay float32), so a partitioned build and `load_dit` give the same model,
parameter for parameter; `cast_dit` then sets the compute dtype (the casts it would do are none).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from video_dit.models.common import parameter_generator
from video_dit.models.layouts import preset_name
from video_dit.models.weights import check_matches_preset, check_state_dict, module_groups, stored_dtype
from video_dit.parallel.memory import release_freed_memory


def build_partitioned(source: str, preset, dtype, seed: int, ds_config: dict, config, arch):
    """The DiT of `source` (as its family's loader reads it) built straight into ZeRO-3 partitions
    (module docstring); every rank calls, with torch.distributed initialised and `ds_config` the
    job's DeepSpeed JSON (it carries the parameter offload and persistence settings). `arch`: the
    family's DiT class and build functions (`families.DiTArch`); `config`: the DiT config, required for a
    `preset:NAME` source (its preset's)."""
    import deepspeed

    if not dist.is_initialized():
        raise RuntimeError("build_dit(zero_stage=3) needs torch.distributed initialised (every rank calls it)")
    rank0 = dist.get_rank() == 0
    weights = None
    name = preset_name(source)
    if name is not None:
        if config is None:
            raise ValueError(f"build_partitioned({source!r}): a preset source needs its DiT config (config=)")
    else:
        weights, config, description = arch.open(source, config)
    with torch.device("meta"):
        model = arch.cls(config)
    if next(model.buffers(), None) is not None:
        raise RuntimeError(f"build_dit(zero_stage=3): {arch.cls.__name__} has buffers; they need materialising here too")
    if weights is not None:  # 1. names and shapes, before any tensor is read
        shapes = weights.meta()
        check_state_dict(model, shapes, description)
        if dtype is None:
            dtype = stored_dtype(shapes, description)
    dtype = dtype or torch.float32
    if preset is not None:
        check_matches_preset(dict(model.state_dict(keep_vars=True)), preset, source, arch.cls)

    dtypes = arch.param_dtypes(model, dtype)  # as load_dit(dtype=) stores them
    owners = {}  # parameter name -> (module, attribute)
    for mname, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            owners[f"{mname}.{pname}" if mname else pname] = (module, pname)
    convert = None
    for group in module_groups(owners, arch.block_list):  # 3. one block (or top-level module) at a time
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
            else:  # a preset: the family's init of this parameter, by name (as the DiT's `initialize_weights`)
                full = arch.init_parameter(config, name, torch.empty(meta.shape, dtype=target),
                                           parameter_generator(seed, name))
            param = nn.Parameter(full, requires_grad=meta.requires_grad)
            setattr(module, attr, param)
            if convert is None:  # the first parameter sets up DeepSpeed's converter (the job's config)
                deepspeed.zero.Init(module=nn.ParameterList([param]), config_dict_or_path=ds_config, dtype=target)
                convert = param.convert_to_zero_parameters
            else:
                convert(param_list=[param])
            del full, param
        if rank0:
            del tensors
        release_freed_memory()
    return arch.cast(model, dtype)  # the compute dtype; every parameter already has its dtype
