"""The HunyuanVideo 1.5 DiT (Tencent-Hunyuan/HunyuanVideo-1.5), written from the math.

    x (B, C_in, F', h, w), C_in = 2 * in_channels + 1: [noisy latents | condition latents | mask]
      -> img_in Conv3d(patch_size)                                  -> img (B, L, D), L = F'/pt * h/ph * w/pw
         RoPE tables (1, L, 1, Dh/2), bands (t, h, w) = rope_dim_list, theta 256
    timestep (B,) on 0..1000 -> time_in (+ time_r_in(timestep_r), step-distilled)  -> vec (B, D) fp32
    context (B, Lt, text_dim) Qwen2.5-VL + context_mask -> txt_in (token refiner, c = t + pooled text)
                                                                     -> (B, Lt, D) + cond_type_embedding[0]
    glyph (B, Lg, byt5_dim) ByT5 + glyph_mask                        -> byt5_in   -> (B, Lg, D) + cond_type_embedding[1]
    image_embeds (B, Li, vision_dim) SigLIP, i2v only                -> vision_in -> (B, Li, D) + cond_type_embedding[2]
      -> txt = [image | glyph | text] (B, Lt', D), key mask (B, Lt')
      -> mm_double_blocks_depth x DoubleStreamBlock:
           per stream s in (img, txt): shift1, scale1, gate1, shift2, scale2, gate2 = s_mod(vec)
           q/k/v of LN(s) * (1 + scale1) + shift1; per-head q/k RMSNorm; RoPE on the video q/k only
           one attention over [img | txt] (padded text keys masked)
           s += gate1 * s_attn_proj(attn_s);  s += gate2 * s_mlp(LN(s) * (1 + scale2) + shift2)
      -> final_layer: LN(img) * (1 + scale) + shift -> Linear(D, C_out * pt*ph*pw)    (B, L, C_out*pt*ph*pw)
      -> unpatchify                                                                   (B, C_out, F', h, w)

The public checkpoints (480p / 720p, t2v / i2v, cfg-distilled, step-distilled) have only double-stream
blocks (mm_single_blocks_depth 0) and share one architecture; the 480p i2v step-distilled model adds
`time_r_in` (use_meanflow). t2v and i2v differ in the inputs only: i2v puts the first frame's latent in
the condition channels with mask 1 on that frame and passes SigLIP tokens; t2v passes zeros and mask 0
there and no image tokens (`image_embeds=None`; Tencent and diffusers pass zeros and mask them out when
they are all zero, the same math).

Text token order: Tencent and diffusers sort each sample's text tokens valid-first ([image | glyph |
text] valid tokens, then the padding, zeroed). The text tokens carry no position (no RoPE) and padded
ones are masked keys, so attention is the same in any order: this model keeps [image | glyph | text]
and masks the padding. Padded text tokens' own outputs differ (never read).

Precision. Tencent holds every weight in bf16 and runs the model under bf16 autocast, which keeps in
float32: the sinusoid, every LayerNorm, the RMSNorm statistics, the adaLN arithmetic (LN(x) * (1 +
scale) + shift) and the RoPE rotation. Here those are float32 too, and also (more than Tencent, as our
Wan DiT does): the residual streams with their gated adds, the time embedders, `cond_type_embedding` and
the final layer, stored in float32 (`FLOAT32_MODULES`). The per-block modulation Linears (a third of the
weights) compute in the bulk dtype, as Tencent's. `param_dtypes` / `cast_hy15_dit` state it once.

Parameter names are Tencent's original checkpoint names (`double_blocks.N.img_attn_q`, ...), so the
weights Tencent publishes load unchanged and a LoRA on these modules has Tencent's / musubi-tuner's
module paths; `convert.py` maps diffusers' and ComfyUI's layouts. Sequence parallelism plugs
in through `HunyuanVideo15DiT.seq_parallel`; this file holds no distributed code.
"""

from __future__ import annotations

import math
import re

import torch
from torch import nn

from video_dit.families.hunyuan15.config import HY15DiTConfig
from video_dit.families.hunyuan15.layers import (
    ByT5Mapper,
    DoubleStreamBlock,
    FinalLayer,
    SingleTokenRefiner,
    TimestepEmbedder,
    VisionProjection,
    hy15_rope_tables,
)
from video_dit.models.attention import set_attention_backend
from video_dit.models.common import (BlockTraining, IslandCast, cast_to_storage, initialize_by_name,
                                     storage_dtypes)
from video_dit.models.layers import RMSNorm, compute_dtype_of, f32

# ---------------------------------------------------------------- initialisation

_TIME_MLP = re.compile(r"(time_in|time_r_in|txt_in\.t_embedder)\.mlp\.[02]\.weight")
_ZEROED = re.compile(r"double_blocks\.\d+\.(img|txt)_mod\.linear\..*|.*adaLN_modulation\.1\..*|final_layer\.linear\..*"
                     r"|cond_type_embedding\.weight")


@torch.no_grad()
def init_parameter(config: HY15DiTConfig, name: str, t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Tencent's initial value of the parameter `name` (native names), written into `t` in place. Drawn in
    float32 on the CPU from `generator` and then copied, so every dtype and device gets the same numbers.
    A name no rule covers is an error: a new parameter needs its rule here."""
    values = torch.empty(t.shape, dtype=torch.float32, device="cpu")
    if _ZEROED.fullmatch(name):
        # adaLN Linears (blocks, refiner, final layer), the output Linear and the condition-type table
        # start at zero (Tencent): every gate is 0, each block starts as the identity, the model predicts 0
        values.zero_()
    elif name == "img_in.proj.weight":
        # Xavier over the latent channels; the condition latents and mask channels start at zero (Tencent)
        out, _, *kernel = t.shape
        latent = torch.empty(out, config.in_channels * math.prod(kernel), device="cpu")  # fans: a Linear's
        nn.init.xavier_uniform_(latent, generator=generator)
        values[:, :config.in_channels] = latent.view(out, config.in_channels, *kernel)
        values[:, config.in_channels:] = 0
    elif _TIME_MLP.fullmatch(name):  # time MLPs: N(0, 0.02) (Tencent's TimestepEmbedder)
        values.normal_(std=0.02, generator=generator)
    elif name.endswith(".bias"):  # every Linear / conv / norm bias
        values.zero_()
    elif name.endswith(".weight") and t.dim() == 1:  # LayerNorm / RMSNorm scales
        values.fill_(1.0)
    elif name.endswith(".weight") and t.dim() == 2:  # every other Linear: Xavier-uniform (Tencent: torch's default)
        nn.init.xavier_uniform_(values, generator=generator)
    else:
        raise ValueError(f"init_parameter: no initialisation rule for HunyuanVideo 1.5 parameter {name!r} "
                         f"{tuple(t.shape)}")
    return t.copy_(values)


# ---------------------------------------------------------------- network


class HunyuanVideo15DiT(IslandCast, BlockTraining, nn.Module):
    """The HunyuanVideo 1.5 DiT. Build on the meta device and materialise with `load_state_dict(sd,
    assign=True)`, or with `to_empty(device=...)` and `initialize_weights(seed)`.

    Sequence-parallel seam: `model.seq_parallel = sp` (None = off), where `sp` has
      split(t, dim) -> this rank's slice of t along dim; gather(t, dim) -> the whole t from every rank's slice;
      joint_attention(q, k, v, txt_q, txt_k, txt_v, txt_key_mask) -> (out, txt_out):
        q, k, v (B, L_local, H, Dh) this rank's video tokens (q/k normed, rotated);
        txt_q, txt_k, txt_v (B, Lt, H, Dh) the text tokens, replicated: the same on every rank;
        txt_key_mask (B, Lt) bool or None; out (B, L_local, H, Dh), txt_out (B, Lt, H, Dh), the same on every rank.
    forward splits the video tokens (B, L, D) and the RoPE rows (1, L, 1, Dh/2) along dim 1 after the
    patch embedding and gathers the final layer's output along dim 1; the text stream, the time vector
    and everything per-token (modulation, MLPs) stay local. What the parallel layer must do (Ulysses, as
    Tencent's sequence_parallel_attention): all-to-all q/k/v (scatter heads, gather tokens; padded video
    keys masked), take this rank's H/N heads of the text q/k/v, attend over [all video | text] with
    the text key mask, all-to-all the video output back and all-gather the text output's heads. Every
    collective's backward is its forward's exact adjoint (the head slice's: zero-padding to all heads;
    the all-gather's: sum over ranks, then this rank's slice), so the ranks' gradients of every
    parameter, text ones included, add up to N x the unsplit model's, as Wan's do, and the data-parallel
    average equals the unsplit gradient (tests/test_hunyuan15_sequence_parallel.py).
    """

    def __init__(self, config: HY15DiTConfig, init_seed: int | None = None):
        super().__init__()
        cfg = self.config = config
        D = cfg.hidden_size
        self.img_in = nn.Module()
        self.img_in.proj = nn.Conv3d(cfg.patch_in_channels, D, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.txt_in = SingleTokenRefiner(cfg.text_states_dim, D, cfg.heads_num, cfg.refiner_depth)
        self.byt5_in = ByT5Mapper(cfg.byt5_states_dim, cfg.byt5_hidden_dim, D) if cfg.glyph_byT5_v2 else None
        self.vision_in = VisionProjection(cfg.vision_states_dim, D) if cfg.vision_projection == "linear" else None
        self.time_in = TimestepEmbedder(D)
        self.time_r_in = TimestepEmbedder(D) if cfg.use_meanflow else None
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(cfg) for _ in range(cfg.mm_double_blocks_depth))
        self.final_layer = FinalLayer(cfg)
        # 0: the MLLM text, 1: the ByT5 glyph text, 2: the SigLIP image tokens
        self.cond_type_embedding = nn.Embedding(3, D) if cfg.use_cond_type_embedding else None
        self.checkpointed_blocks: frozenset[int] = frozenset()  # set_checkpointed_blocks (BlockTraining)
        self.offload_checkpoints = False
        self.recompute_saved = True  # nothing to recompute: the double blocks keep what autograd saves
        self.blocks_compiled = False  # compile_blocks
        self.seq_parallel = None  # set from outside (video_dit/parallel); see the class docstring
        self.compute_dtype: torch.dtype | None = None  # None: the bulk weights' dtype; set by cast_hy15_dit
        self._rope_cache: dict = {}
        self.initialize_weights(init_seed)

    # -------------------------------------------------------------- set-up

    @torch.no_grad()
    def initialize_weights(self, seed: int | None = None) -> None:
        """Tencent's initialisation, one parameter at a time by name (`init_parameter`), each from its own
        CPU generator seeded by (`seed`, name): the same values whatever order or device the parameters are
        made in. `seed=None` draws the seed from torch's global RNG. A no-op on the meta device."""
        initialize_by_name(self, init_parameter, self.config, seed)

    @property
    def device(self) -> torch.device:
        return self.img_in.proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The bulk weights' storage dtype (the float32 islands aside; see `cast_hy15_dit`)."""
        return self.img_in.proj.weight.dtype

    def cast(self, dtype: torch.dtype) -> HunyuanVideo15DiT:
        """`to(dtype)` (`IslandCast`): `cast_hy15_dit`."""
        return cast_hy15_dit(self, dtype)

    @property
    def blocks(self) -> nn.ModuleList:
        """The blocks that checkpointing, compilation and the memory plan count (`BlockTraining`)."""
        return self.double_blocks

    def set_attention_backend(self, backend: str) -> "HunyuanVideo15DiT":
        """"native" (torch SDPA) or "flash" (flash-attn; attention with padded text keys always uses SDPA)."""
        return set_attention_backend(self, backend)

    # -------------------------------------------------------------- forward

    def _rope(self, grid: tuple[int, int, int], device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (grid, str(device))
        if key not in self._rope_cache:
            self._rope_cache[key] = hy15_rope_tables(grid, self.config.rope_dim_list, self.config.rope_theta, device)
        return self._rope_cache[key]

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor,
                context_mask: torch.Tensor | None = None, glyph: torch.Tensor | None = None,
                glyph_mask: torch.Tensor | None = None, image_embeds: torch.Tensor | None = None,
                image_mask: torch.Tensor | None = None, timestep_r: torch.Tensor | None = None) -> torch.Tensor:
        """Velocity prediction of the HunyuanVideo 1.5 models.

        x: (B, C_in, F', h, w) latents, C_in = 2 * in_channels + 1 with concat_condition: [noisy latents |
            condition latents | mask]; i2v: condition = the first frame's latent in frame 0 (zeros after),
            mask 1 on frame 0; t2v: zeros and mask 0. F', h, w divisible by patch_size; cast to the model dtype.
        timestep: (B,) on the 0..1000 scale (1000 = pure noise).
        context: (B, Lt, text_states_dim) Qwen2.5-VL hidden states (Tencent's crop of the template).
        context_mask: (B, Lt) bool / 0-1 (True = a real token) or None (all real).
        glyph, glyph_mask: (B, Lg, byt5_states_dim) ByT5 states of the quoted text and (B, Lg) mask; None = no
            glyph tokens (the same as an all-False mask). Only for glyph_byT5_v2 models.
        image_embeds, image_mask: (B, Li, vision_states_dim) SigLIP last hidden states of the reference image
            (i2v; Li = 729 at 384 px) and an optional (B, Li) mask (False rows: t2v samples in an i2v batch);
            None = t2v (Tencent / diffusers pass zeros and mask them out; the same math).
        timestep_r: (B,) on 0..1000, the step-distilled (use_meanflow) models' next timestep; required by them.
        Returns (B, out_channels, F', h, w) in the final layer's weight dtype (float32 unless cast whole).
        """
        with self.precision(x.device.type):
            return self._forward(x, timestep, context, context_mask, glyph, glyph_mask, image_embeds, image_mask,
                                 timestep_r)

    def _text_tokens(self, context, context_mask, glyph, glyph_mask, image_embeds, image_mask, timestep, cdt):
        """[image | glyph | text] tokens (B, Lt', D) float32 and their key mask (B, Lt') bool, or None if all real."""
        cfg, B = self.config, context.shape[0]

        def check(name, t, dim, mask):
            if t.dim() != 3 or t.shape[0] != B or t.shape[2] != dim:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; expected ({B}, tokens, {dim})")
            if mask is not None and tuple(mask.shape) != tuple(t.shape[:2]):
                raise ValueError(f"{name}'s mask has shape {tuple(mask.shape)}; expected {tuple(t.shape[:2])}")
            return None if mask is None else mask.bool()

        context_mask = check("context", context, cfg.text_states_dim, context_mask)
        type_emb = f32(self.cond_type_embedding.weight) if self.cond_type_embedding is not None else None  # (3, D)
        txt = f32(self.txt_in(context, timestep, context_mask, cdt))  # (B, Lt, D)
        parts, masks = [txt + type_emb[0] if type_emb is not None else txt], [context_mask]
        if glyph is not None:
            if self.byt5_in is None:
                raise ValueError("glyph was given, but this model has no ByT5 glyph branch (glyph_byT5_v2=False)")
            glyph_mask = check("glyph", glyph, cfg.byt5_states_dim, glyph_mask)
            g = f32(self.byt5_in(glyph, cdt))  # (B, Lg, D)
            parts.insert(0, g + type_emb[1] if type_emb is not None else g)
            masks.insert(0, glyph_mask)
        if image_embeds is not None:
            if self.vision_in is None:
                raise ValueError("image_embeds was given, but this model has no SigLIP branch "
                                 "(vision_projection='none')")
            image_mask = check("image_embeds", image_embeds, cfg.vision_states_dim, image_mask)
            v = f32(self.vision_in(image_embeds, cdt))  # (B, Li, D)
            parts.insert(0, v + type_emb[2] if type_emb is not None else v)
            masks.insert(0, image_mask)
        txt = torch.cat(parts, dim=1)  # (B, Lt', D)
        if all(m is None for m in masks):
            return txt, None
        mask = torch.cat([torch.ones(p.shape[:2], dtype=torch.bool, device=p.device) if m is None else m
                          for p, m in zip(parts, masks)], dim=1)  # (B, Lt')
        return txt, mask

    def _forward(self, x, timestep, context, context_mask, glyph, glyph_mask, image_embeds, image_mask, timestep_r):
        cfg = self.config
        B, C, Fr, H, W = x.shape
        pt, ph, pw = cfg.patch_size
        if C != cfg.patch_in_channels or Fr % pt or H % ph or W % pw:
            what = "2 * in_channels + 1: latents, condition latents, mask" if cfg.concat_condition else "in_channels"
            raise ValueError(f"x has shape {tuple(x.shape)}; expected (B, {cfg.patch_in_channels}, F', h, w) ({what}) "
                             f"with F', h, w divisible by patch_size={cfg.patch_size}")
        if tuple(timestep.shape) != (B,):
            raise ValueError(f"timestep has shape {tuple(timestep.shape)}; expected ({B},)")
        if (timestep_r is not None) != cfg.use_meanflow or (timestep_r is not None and tuple(timestep_r.shape) != (B,)):
            got = None if timestep_r is None else tuple(timestep_r.shape)
            raise ValueError(f"timestep_r must be a ({B},) tensor exactly for step-distilled (use_meanflow) models; "
                             f"use_meanflow={cfg.use_meanflow}, got {got}")
        grid = (Fr // pt, H // ph, W // pw)

        # contiguous: a compiled block given the transposed (strided) tokens returned gradients off by ~5% on
        # CPU Inductor (torch 2.13; tests/test_compile.py); Wan's DiT makes its patch tokens contiguous too
        img = self.img_in.proj(x.to(self.dtype)).flatten(2).transpose(1, 2).contiguous()  # (B, L, D)
        cdt = compute_dtype_of(img)  # the Linears' dtype: bf16 under a bf16 model's autocast
        rope = self._rope(grid, img.device)  # (cos, sin), each (1, L, 1, Dh/2)
        vec = f32(self.time_in(timestep))  # (B, D)
        if self.time_r_in is not None:
            vec = vec + f32(self.time_r_in(timestep_r))
        txt, txt_mask = self._text_tokens(context, context_mask, glyph, glyph_mask, image_embeds, image_mask,
                                          timestep, cdt)  # (B, Lt', D), (B, Lt') or None

        sp = self.seq_parallel
        if sp is not None:  # the video tokens and their RoPE rows go to their rank; the text stays whole
            img = sp.split(img, dim=1)  # (B, L_local, D)
            rope = tuple(sp.split(r, dim=1) for r in rope)

        for i, block in enumerate(self.double_blocks):
            img, txt = self.run_block(i, block, img, txt, vec, rope, txt_mask, cdt, sp)  # (B, L_local, D), (B, Lt', D)

        out = self.final_layer(img, vec)  # (B, L_local, C_out * pt*ph*pw)
        if sp is not None:
            out = sp.gather(out, dim=1)  # (B, L, C_out * pt*ph*pw)
        out = out.view(B, *grid, cfg.out_channels, pt, ph, pw)  # unpatchify, channels outermost (Tencent)
        out = out.permute(0, 4, 1, 5, 2, 6, 3, 7)  # (B, C, F', pt, h', ph, w', pw)
        return out.reshape(B, cfg.out_channels, Fr, H, W)


# ---------------------------------------------------------------- precision: the float32 islands

# Sub-modules kept whole in float32 in a bf16 model (see the module docstring): the time embedders,
# the condition-type table and the final layer (modulation, norm, output Linear). Small, once per step.
FLOAT32_MODULES = ("time_in", "time_r_in", "txt_in.t_embedder", "cond_type_embedding", "final_layer")
# ... and every parameter of a norm (the refiner / ByT5 / SigLIP LayerNorms, the q/k RMSNorms).
FLOAT32_NORMS = (nn.LayerNorm, RMSNorm)


def float32_param_names(model: nn.Module) -> set[str]:
    """Names of the parameters a HunyuanVideo 1.5 DiT stores in float32 whatever dtype it computes in."""
    names = set()
    for module_name, module in model.named_modules():
        whole = any(module_name == m or module_name.startswith(m + ".") for m in FLOAT32_MODULES)
        if whole or isinstance(module, FLOAT32_NORMS):
            names.update(f"{module_name}.{n}" for n, _ in module.named_parameters(recurse=False))
    return names


def param_dtypes(model: nn.Module, dtype: torch.dtype, masters: bool = False) -> dict[str, torch.dtype]:
    """The storage dtype of each floating parameter of a model that computes in `dtype`: float32 for the
    float32 islands and, with `masters`, for every parameter that requires grad; `dtype` for the rest
    (as `dit.param_dtypes`)."""
    return storage_dtypes(model, dtype, float32_param_names(model) if dtype != torch.float32 else set(), masters)


def cast_hy15_dit(model: nn.Module, dtype: torch.dtype, masters: bool = False) -> nn.Module:
    """Cast in place: each parameter to `param_dtypes(model, dtype, masters)` and `model.compute_dtype =
    dtype`, so the forward runs the bulk under `dtype` autocast and the islands in float32."""
    return cast_to_storage(model, param_dtypes(model, dtype, masters), dtype)


# ---------------------------------------------------------------- LoRA targets and FLOPs

# The double blocks' attention and MLP Linears of both streams (peft `target_modules`, a full-match regex).
# Not the per-block modulation Linears (img_mod / txt_mod: 12 D^2 each, as large as the rest of a block).
LORA_TARGETS = r"double_blocks\.\d+\.(img|txt)_(attn_(q|k|v|proj)|mlp\.fc[12])"


def hy15_dit_flops(config: HY15DiTConfig, num_tokens: int, text_len: int, batch: int = 1, glyph_len: int = 0,
                   image_len: int = 0) -> float:
    """Analytic forward FLOPs (2 per multiply-add) of the matmuls and attention; backward is ~2x this.
    num_tokens: video tokens L; text_len: MLLM tokens (refined); glyph_len / image_len: ByT5 / SigLIP tokens."""
    D, L = config.hidden_size, num_tokens
    M = int(D * config.mlp_width_ratio)
    Lt = text_len + glyph_len + image_len  # the text stream of the double blocks
    per_block = (2 * (L + Lt) * D * 4 * D  # q, k, v, proj of both streams
                 + 4 * (L + Lt) ** 2 * D  # joint attention scores and weighted sum
                 + 2 * (L + Lt) * D * M * 2  # both MLPs
                 + 2 * D * 6 * D * 2)  # both modulation Linears (one time vector)
    Mr = int(D * 4.0)
    refiner = config.refiner_depth * (2 * text_len * D * 4 * D + 4 * text_len ** 2 * D + 2 * text_len * D * Mr * 2
                                      + 2 * D * 2 * D)
    Bh = config.byt5_hidden_dim
    embed = (2 * L * D * config.patch_in_channels * math.prod(config.patch_size)  # patch embedding
             + 2 * text_len * config.text_states_dim * D + 2 * config.text_states_dim * D + 2 * D * D  # txt_in
             + 2 * glyph_len * (config.byt5_states_dim * Bh + Bh * Bh + Bh * D)  # byt5_in
             + 2 * image_len * (config.vision_states_dim ** 2 + config.vision_states_dim * D)  # vision_in
             + 2 * (1 + config.use_meanflow + 1) * (256 * D + D * D)  # time MLPs (+ the refiner's)
             + 2 * D * 2 * D + 2 * L * D * config.out_channels * math.prod(config.patch_size))  # final layer
    return float(batch * (config.mm_double_blocks_depth * per_block + refiner + embed))
