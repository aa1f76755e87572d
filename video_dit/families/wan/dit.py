"""The 3D-latent video DiT: the Wan 2.1 / 2.2 transformer, written from the math.

    x (B, in_dim, F', h, w) latents        timestep (B,) or (B, L) on 0..1000     context (B, Lt, text_dim)
      -> patch_embedding Conv3d (1,2,2)     -> sinusoid(freq_dim) -> time_embedding  -> text_embedding MLP
      -> tokens (B, L, D), L = F'*h/2*w/2      e (B, T, D), T = 1 or L (fp32)          -> (B, Lt, D)
         RoPE tables (1, L, 1, Dh/2)        -> time_projection -> e0 (B, T, 6, D)
                                            clip_fea (B, Li, image_dim), Wan 2.1 I2V / FLF2V only
                                              (+ emb_pos for FLF2V) -> img_emb MLP  -> (B, Li, D)
      -> num_layers x Block:
           x += gate1 * self_attn(LN(x) * (1 + scale1) + shift1)   q/k RMSNorm across heads, 3D RoPE
           x += cross_attn(LN_affine(x), context)                   q/k RMSNorm, no RoPE
                [image branch: + attention(q, k_img, v_img) over the image tokens, before `o`]
           x += gate2 * ffn(LN(x) * (1 + scale2) + shift2)          Linear -> GELU(tanh) -> Linear
      -> head: LN(x) * (1 + scale) + shift -> Linear(D, out_dim * 1*2*2)      (B, L, out_dim*4)
      -> unpatchify                                                             (B, out_dim, F', h, w)

Precision, as Wan's own code runs it (float32 weights under bf16 autocast): the Linears, the patch
Conv3d and attention compute in the model's compute dtype (bf16: `cast_dit`, torch autocast), while
the float32 islands stay float32 in storage and arithmetic: the sinusoid, `time_embedding`,
`time_projection`, every `modulation` table, the norms, the adaLN arithmetic, the residual stream
with its gated updates (`x + y * gate`), and the head. `FLOAT32_MODULES` / `param_dtypes` /
`cast_dit` (end of this file) are the one statement of which parameters stay float32.

Parameter names are the original Wan checkpoint names, so a LoRA on these modules maps 1:1 to the
ComfyUI `diffusion_model.` convention. Sequence parallelism plugs in through `VideoDiT.seq_parallel`
(see `VideoDiT.forward`); this file holds no distributed code.

The layers (embeddings and RoPE, the adaLN arithmetic, `RecomputeSaved`, attention, `Block`, `Head`) are
in `layers.py` (and the family-neutral `video_dit/models/layers.py`); this file holds the configuration, the
initialisation, `VideoDiT` (the network whole, with the shapes of its forward), the float32 islands and
`dit_flops`.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from video_dit.families.wan.config import DiTConfig
from video_dit.families.wan.layers import Block, Head, ImageEmbedding, rope_tables
from video_dit.kernels import set_kernels
from video_dit.models.attention import set_attention_backend
from video_dit.models.common import (BlockTraining, IslandCast, cast_to_storage, initialize_by_name,
                                     storage_dtypes)
from video_dit.models.layers import RMSNorm, f32, sinusoidal_embedding

log = logging.getLogger(__name__)



# ---------------------------------------------------------------- initialisation


@torch.no_grad()
def init_parameter(config: DiTConfig, name: str, t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Wan's initial value of the parameter called `name` (native names), written into `t` in place.
    Drawn in float32 on the CPU from `generator` and then copied, so every dtype and device gets the
    same numbers. A name no rule covers is an error: a new parameter needs its rule here."""
    values = torch.empty(t.shape, dtype=torch.float32, device="cpu")  # the CPU whatever device context encloses it
    if name == "head.head.weight":  # output layer zeroed: a fresh model predicts 0
        values.zero_()
    elif name.endswith("modulation"):  # adaLN tables: random unit-scale per channel (added to the time projection)
        values.normal_(std=config.dim ** -0.5, generator=generator)
    elif name.startswith(("text_embedding.", "time_embedding.")) and name.endswith(".weight"):
        values.normal_(std=0.02, generator=generator)  # text and time MLPs: small normal weights
    elif name == "img_emb.emb_pos":  # FLF2V's image position embedding starts at zero (Wan)
        values.zero_()
    elif name == "patch_embedding.weight":  # Xavier over the flattened (in_dim * patch) fan-in, like a Linear
        nn.init.xavier_uniform_(values.flatten(1), generator=generator)
    elif name.endswith(".bias"):  # every Linear / conv / norm bias
        values.zero_()
    elif name.endswith(".weight") and t.dim() == 1:  # RMSNorm / LayerNorm scales
        values.fill_(1.0)
    elif name.endswith(".weight") and t.dim() == 2:  # every other Linear: Xavier-uniform
        nn.init.xavier_uniform_(values, generator=generator)
    else:
        raise ValueError(f"init_parameter: no initialisation rule for DiT parameter {name!r} {tuple(t.shape)}")
    return t.copy_(values)


# ---------------------------------------------------------------- network


class VideoDiT(IslandCast, BlockTraining, nn.Module):
    """The Wan 2.x DiT. Build on the meta device and materialise with
    `load_state_dict(sd, assign=True)` (see `video_dit.families.wan.loading.load_dit`).

    Sequence-parallel seam: `model.seq_parallel = sp` (None = off), where `sp` has
      split(t, dim) -> this rank's slice of t along dim,
      attention(q, k, v) -> out, all (B, L_local, H, Dh), q/k already RMS-normed and rotated,
      gather(t, dim) -> the full tensor from every rank's slice.
    forward splits the tokens (B, L, D), the RoPE tables (1, L, 1, Dh/2) and per-token time
    vectors (B, L, ...) along dim 1 right after the embeddings (broadcast (B, 1, ...) ones stay
    whole), every self-attention calls `sp.attention` instead of the local kernel, and the head
    output is gathered along dim 1 before unpatchify. Cross-attention, FFN and modulation stay
    local; padding to a multiple of the ranks is the sp object's business.
    """

    def __init__(self, config: DiTConfig, init_seed: int | None = None):
        super().__init__()
        cfg = self.config = config
        self.patch_embedding = nn.Conv3d(cfg.in_dim, cfg.dim, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(cfg.text_dim, cfg.dim), nn.GELU(approximate="tanh"),
                                            nn.Linear(cfg.dim, cfg.dim))
        self.time_embedding = nn.Sequential(nn.Linear(cfg.freq_dim, cfg.dim), nn.SiLU(), nn.Linear(cfg.dim, cfg.dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(cfg.dim, 6 * cfg.dim))
        self.img_emb = ImageEmbedding(cfg) if cfg.image_dim is not None else None  # Wan 2.1 I2V / FLF2V
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.head = Head(cfg)
        self.checkpointed_blocks: frozenset[int] = frozenset()  # set_checkpointed_blocks
        self.offload_checkpoints = False
        self.recompute_saved = True  # set_recompute_saved
        self.blocks_compiled = False  # compile_blocks
        self.seq_parallel = None  # set from outside (video_dit/parallel); see forward()
        self.compute_dtype: torch.dtype | None = None  # None: the bulk weights' dtype; set by cast_dit
        self._rope_cache: dict = {}
        self.initialize_weights(init_seed)

    # -------------------------------------------------------------- set-up

    @torch.no_grad()
    def initialize_weights(self, seed: int | None = None) -> None:
        """Wan's initialisation, one parameter at a time by name (`init_parameter`), each from its own
        generator seeded by (`seed`, name): the same values whatever order or device the parameters
        are made in (a ZeRO-3 build materialises them one module at a time). `seed=None` draws the
        seed from torch's global RNG, so `torch.manual_seed(s); VideoDiT(cfg)` stays reproducible.
        A no-op on the meta device."""
        initialize_by_name(self, init_parameter, self.config, seed)

    @property
    def device(self) -> torch.device:
        return self.patch_embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The bulk weights' storage dtype (the float32 islands aside; see `cast_dit`)."""
        return self.patch_embedding.weight.dtype

    def cast(self, dtype: torch.dtype) -> VideoDiT:
        """`to(dtype)` (`IslandCast`): `cast_dit`."""
        return cast_dit(self, dtype)

    def _set_block_recompute(self) -> None:
        # a checkpointed block stores nothing inside, so nothing to recompute; a compiled block leaves
        # the choice of what to save to Inductor's partitioner (the hooks would break its graph)
        for i, block in enumerate(self.blocks):
            block.recompute = self.recompute_saved and i not in self.checkpointed_blocks and not self.blocks_compiled

    def set_attention_backend(self, backend: str) -> "VideoDiT":
        """"native" (torch SDPA), "flash" (flash-attn 2), "flash3" (FlashAttention 3) or "sage"
        (SageAttention); a clear error naming the package when it is not installed."""
        return set_attention_backend(self, backend)

    def set_kernels(self, kernels: str) -> "VideoDiT":
        """The q/k RMSNorm + RoPE and LayerNorm + adaLN modulation: "auto" (default: the fused Triton
        ops on CUDA when triton imports, else the torch path), "triton" (the fused ops, always) or
        "torch" (the torch path). See `video_dit.kernels`."""
        return set_kernels(self, kernels)

    # -------------------------------------------------------------- forward

    def _rope(self, grid: tuple[int, int, int], device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (grid, str(device))
        if key not in self._rope_cache:
            self._rope_cache[key] = rope_tables(grid, self.config.head_dim, device=device)
        return self._rope_cache[key]

    def _pad_context(self, context) -> torch.Tensor:
        cfg = self.config
        if isinstance(context, (list, tuple)):
            for i, u in enumerate(context):
                if u.dim() != 2 or u.shape[1] != cfg.text_dim or u.shape[0] > cfg.text_len:
                    raise ValueError(f"context[{i}] has shape {tuple(u.shape)}; expected (L_i <= text_len="
                                     f"{cfg.text_len}, text_dim={cfg.text_dim})")
            # Zero-pad each prompt to text_len, as the pretrained Wan models were trained.
            context = torch.stack([F.pad(u, (0, 0, 0, cfg.text_len - u.shape[0])) for u in context])
        if context.dim() != 3 or context.shape[-1] != cfg.text_dim:
            raise ValueError(f"context has shape {tuple(context.shape)}; expected (B, Lt, text_dim={cfg.text_dim}) "
                             "or a list of (L_i, text_dim) tensors")
        return context.to(self.dtype)

    def _image_context(self, clip_fea: torch.Tensor | None, B: int) -> torch.Tensor | None:
        cfg = self.config
        if cfg.image_dim is None:
            if clip_fea is not None:
                raise ValueError("clip_fea was given, but this DiT has no image branch (config.image_dim is None)")
            return None
        want = (B, cfg.image_context_len, cfg.image_dim)
        if clip_fea is None or tuple(clip_fea.shape) != want:
            got = None if clip_fea is None else tuple(clip_fea.shape)
            raise ValueError(f"this DiT has the CLIP image branch: clip_fea must be {want} (B, num_images="
                             f"{cfg.num_images} x {cfg.image_tokens} tokens, image_dim), got {got}")
        return self.img_emb(clip_fea)  # (B, Li, D)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, context, context_mask: torch.Tensor | None = None,
                clip_fea: torch.Tensor | None = None):
        """Velocity prediction of the Wan models.

        x: (B, in_dim, F', h, w) latents, h and w divisible by the spatial patch; cast to the model dtype.
        timestep: (B,) or per-token (B, L) on the 0..1000 scale (1000 = pure noise); L = F' * h/2 * w/2.
        context: (B, Lt, text_dim) or a list of B (L_i, text_dim) tensors, zero-padded to text_len.
        context_mask: optional (B, Lt) bool, True = attend (for models trained with it; pretrained Wan
            models were trained without a mask).
        clip_fea: (B, Li, image_dim) CLIP features (penultimate block), required exactly when the config
            has an image branch: Li = 257 (I2V, the first frame) or 514 (FLF2V, [first | last] per sample;
            Wan passes FLF2V features as (2B, 257, .) and views them as (B, 514, .)).
        Returns (B, out_dim, F', h, w) in the head's weight dtype (float32 unless the whole model was cast).
        """
        with self.precision(x.device.type):
            return self._forward(x, timestep, context, context_mask, clip_fea)

    def _forward(self, x, timestep, context, context_mask, clip_fea):
        cfg = self.config
        B, C, Fr, H, W = x.shape
        pt, ph, pw = cfg.patch_size
        if C != cfg.in_dim or Fr % pt or H % ph or W % pw:
            raise ValueError(f"x has shape {tuple(x.shape)}; expected (B, in_dim={cfg.in_dim}, F', h, w) with "
                             f"F', h, w divisible by patch_size={cfg.patch_size}")
        grid = (Fr // pt, H // ph, W // pw)
        L = math.prod(grid)

        x = self.patch_embedding(x.to(self.dtype)).flatten(2).transpose(1, 2).contiguous()  # (B, L, D) compute dtype
        rope = self._rope(grid, x.device)  # (cos, sin), each (1, L, 1, Dh/2)

        if timestep.numel() not in (B, B * L):
            raise ValueError(f"timestep has shape {tuple(timestep.shape)}; expected ({B},) or per-token ({B}, {L})")
        t = timestep.reshape(B, -1)  # (B, T), T = 1 or L
        T = t.shape[1]
        # float32 region: the sinusoid and the time MLPs, in their float32 weights (Wan: autocast(float32));
        # they run in their weights' dtype, so a wholly cast model computes them in that dtype.
        with torch.autocast(x.device.type, enabled=False):
            sinusoid = sinusoidal_embedding(t.flatten(), cfg.freq_dim)  # (B*T, freq_dim) fp32
            e = self.time_embedding(sinusoid.to(self.time_embedding[0].weight.dtype))  # (B*T, D)
            e0 = self.time_projection(e.to(self.time_projection[1].weight.dtype))  # (B*T, 6D)
            e0 = f32(e0).view(B, T, 6, cfg.dim)  # (B, T, 6, D) fp32
            e = f32(e).view(B, T, cfg.dim)  # (B, T, D) fp32

        context = self.text_embedding(self._pad_context(context))  # (B, Lt, D)
        image_context = self._image_context(clip_fea, B)  # (B, Li, D) or None

        sp = self.seq_parallel
        if sp is not None:  # tokens, their RoPE rows and per-token time vectors go to their rank
            x = sp.split(x, dim=1)  # (B, L_local, D)
            rope = tuple(sp.split(r, dim=1) for r in rope)
            if T > 1:
                e, e0 = sp.split(e, dim=1), sp.split(e0, dim=1)

        for i, block in enumerate(self.blocks):
            args = (x, e0, context, rope, context_mask, sp, image_context)
            x = self.run_block(i, block, *args)  # (B, L_local, D), checkpointed or not

        x = self.head(x, e)  # (B, L_local, out_dim * pt*ph*pw)
        if sp is not None:
            x = sp.gather(x, dim=1)  # (B, L, out_dim * pt*ph*pw)

        x = x.view(B, *grid, pt, ph, pw, cfg.out_dim)  # unpatchify
        x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)  # (B, C, F', pt, h', ph, w', pw)
        return x.reshape(B, cfg.out_dim, Fr, H, W)


# ---------------------------------------------------------------- precision: the float32 islands

# Sub-modules kept whole in float32 in a bf16 DiT. Wan's own code holds every weight in float32 and
# runs these under `autocast(dtype=float32)` (wan/modules/model.py: the time embedding and projection
# in WanModel.forward, the head in Head.forward); diffusers keeps `time_embedder` (its time_proj is
# bf16: we follow Wan) in float32 through `_keep_in_fp32_modules` (transformer_wan.py).
FLOAT32_MODULES = ("time_embedding", "time_projection", "head")
# Parameters kept in float32 wherever they sit, by name: every block's and the head's adaLN table
# (diffusers' `scale_shift_table`).
FLOAT32_PARAMS = ("modulation",)
# ... and every parameter of a norm (diffusers keeps norm1-3; Wan's are float32 like all its weights).
FLOAT32_NORMS = (nn.LayerNorm, RMSNorm)


def float32_param_names(model: nn.Module) -> set[str]:
    """Names of the parameters a DiT stores in float32 whatever dtype it computes in."""
    names = set()
    for module_name, module in model.named_modules():
        whole = module_name.split(".")[0] in FLOAT32_MODULES or isinstance(module, FLOAT32_NORMS)
        for name, _ in module.named_parameters(recurse=False):
            if whole or name in FLOAT32_PARAMS:
                names.add(f"{module_name}.{name}" if module_name else name)
    return names


def param_dtypes(model: nn.Module, dtype: torch.dtype, masters: bool = False) -> dict[str, torch.dtype]:
    """The storage dtype of each floating parameter of a DiT that computes in `dtype`: float32 for
    the float32 islands (`float32_param_names`), and with `masters` for every parameter that
    requires grad (the optimizer then updates float32 master weights in place, as Wan-style fp32
    weights under bf16 autocast train); `dtype` for the rest (frozen bulk weights, inference).
    Every way of building a DiT (loading, the trainer, a partitioned constructor) stores these."""
    return storage_dtypes(model, dtype, float32_param_names(model) if dtype != torch.float32 else set(), masters)


def cast_dit(model: nn.Module, dtype: torch.dtype, masters: bool = False) -> nn.Module:
    """Cast a DiT for computing in `dtype`, in place: each parameter to `param_dtypes(model, dtype,
    masters)`, and `model.compute_dtype = dtype`, so its forward runs the bulk under `dtype` autocast
    and the float32 islands in float32. `cast_dit(m, torch.float32)` is a plain float32 model.
    (`model.to(dtype)` does this too; `nn.Module.to(model, torch.bfloat16)` instead casts every
    parameter: the pure-bf16 baseline of `video-dit bench --suite precision`.)"""
    return cast_to_storage(model, param_dtypes(model, dtype, masters), dtype)


def dit_flops(config: DiTConfig, num_tokens: int, text_len: int, batch: int = 1) -> float:
    """Analytic forward FLOPs (2 per multiply-add) of matmuls and attention; backward is ~2x this."""
    D, Fd, L, Lt, Li = config.dim, config.ffn_dim, num_tokens, text_len, config.image_context_len
    patch = math.prod(config.patch_size)
    per_block = (
        2 * L * D * 4 * D  # self-attn q, k, v, o
        + 4 * L * L * D  # self-attn scores and weighted sum
        + 2 * L * D * 2 * D + 2 * Lt * D * 2 * D  # cross-attn q, o on video; k, v on text
        + 4 * L * Lt * D  # cross-attn scores and weighted sum
        + 2 * Li * D * 2 * D + 4 * L * Li * D  # image branch: k_img, v_img; its scores and weighted sum
        + 2 * L * D * Fd * 2  # FFN
    )
    embed = (2 * L * D * config.in_dim * patch  # patch embedding
             + 2 * Lt * D * (config.text_dim + D)  # text MLP
             + 2 * Li * (config.image_dim or 0) * ((config.image_dim or 0) + D)  # image MLP (img_emb)
             + 2 * D * (config.freq_dim + D + 6 * D)  # time MLP + projection (one timestep)
             + 2 * L * D * config.out_dim * patch)  # head
    return float(batch * (config.num_layers * per_block + embed))


# LoRA: the blocks' attention and FFN Linears, with the image branch's k_img / v_img of Wan 2.1 I2V / FLF2V
# (absent, so never matched, in other models).
LORA_TARGETS = r"blocks\.\d+\.((self_attn|cross_attn)\.(q|k|v|o)|cross_attn\.(k_img|v_img)|ffn\.(0|2))"
# Opt-in (`network.include_img_emb`): also the image-embedding MLP's two Linears, img_emb.proj.1 / .3.
IMG_EMB_TARGETS = r"img_emb\.proj\.(1|3)"


def lora_targets(include_img_emb: bool = False) -> str:
    """The peft `target_modules` regex: LORA_TARGETS, plus IMG_EMB_TARGETS when asked."""
    return f"({LORA_TARGETS})|({IMG_EMB_TARGETS})" if include_img_emb else LORA_TARGETS
