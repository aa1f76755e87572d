"""The stand-in family's DiT: a small adaLN-zero transformer written for the contract test, with its own
parameter names (no other family's checkpoint layout).

    x (B, C, F', h, w) latents -> patchify (pt, ph, pw) -> patch_embed          -> tokens (B, L, D) float32
       L = F'/pt * h/ph * w/pw                        [sequence parallel: this rank's L_local rows]
    timestep (B,) on 0..1000 -> sinusoid (freq_dim) -> time_embed (float32 island) -> temb (B, D) float32
    context: B byte embeddings (Lt_i, text_dim) -> zero-padded to text_len -> text_embed -> text (B, Lt, D)
      -> depth x StandinBlock:
           shift1, scale1, gate1, shift2, scale2, gate2 = mod(SiLU(temb))              (B, 1, D) each
           self-attention: qkv(LN(x) * (1 + scale1) + shift1), per-head RMSNorm on q, k
                           x += gate1 * proj(attention)
           cross-attention to the text: x += cross_out(attention(cross_q(LN(x)), cross_kv(text)))
           MLP:            x += gate2 * fc2(GELU(fc1(LN(x) * (1 + scale2) + shift2)))
      -> head (float32 island): LN(x) * (1 + scale) + shift -> proj                    (B, L, C * pt*ph*pw)
      -> unpatchify                                                                    (B, C, F', h, w)

Precision: the residual stream, the LayerNorms, the adaLN arithmetic, the time MLP and the head run in
float32 (`FLOAT32_MODULES` and the q/k norms stay float32 in a bf16 model); the Linears of the blocks
compute in the bulk dtype under autocast (`IslandCast.precision`). Sequence parallelism plugs in through
`seq_parallel` (split / attention / gather, `video_dit.parallel.sequence`); no distributed code here.
"""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from video_dit.models.attention import attention, set_attention_backend
from video_dit.models.common import BlockTraining, IslandCast, cast_to_storage, initialize_by_name, storage_dtypes
from video_dit.models.layers import RMSNorm, compute_dtype_of, f32, gated_add, modulate, sinusoidal_embedding


@dataclass
class StandinDiTConfig:
    """The DiT's shape; `num_heads`, `num_layers`, `patch_size`, `out_channels` are the contract's `DiTShape`."""

    in_channels: int = 4       # latent channels in and out (the VAE's z_dim)
    hidden: int = 32           # D
    heads: int = 2             # H
    depth: int = 2             # blocks
    mlp_ratio: int = 2         # the MLP's width F = mlp_ratio x D
    text_dim: int = 16         # the byte text encoder's width
    text_len: int = 16         # text tokens the DiT pads every prompt to (Lt)
    freq_dim: int = 32         # the timestep sinusoid's width
    patch_size: tuple[int, int, int] = (1, 2, 2)
    eps: float = 1e-6

    def __post_init__(self):
        self.patch_size = tuple(int(p) for p in self.patch_size)
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise ValueError(f"StandinDiTConfig.patch_size must be 3 positive ints, got {self.patch_size}")
        if self.hidden % self.heads:
            raise ValueError(f"StandinDiTConfig.hidden={self.hidden} is not divisible by heads={self.heads}")

    @property
    def num_heads(self) -> int:
        return self.heads

    @property
    def num_layers(self) -> int:
        return self.depth

    @property
    def out_channels(self) -> int:
        return self.in_channels

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn(self) -> int:
        return self.mlp_ratio * self.hidden

    @property
    def patch_channels(self) -> int:
        return self.in_channels * math.prod(self.patch_size)

    @classmethod
    def from_dict(cls, d: dict) -> "StandinDiTConfig":
        """From a config.json dict; an unknown key is a ValueError naming the nearest valid one."""
        names = [f.name for f in fields(cls)]
        for key in d:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                raise ValueError(f"unknown StandinDiTConfig key {key!r}"
                                 f"{f' (did you mean {close[0]!r}?)' if close else ''}; valid keys: {', '.join(names)}")
        return cls(**d)


# ---------------------------------------------------------------- initialisation

_ZEROED = re.compile(r"layers\.\d+\.mod\..*|head\.(mod|proj)\..*")


@torch.no_grad()
def init_parameter(config: StandinDiTConfig, name: str, t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The initial value of parameter `name`, drawn in float32 on the CPU from `generator` and copied into
    `t` (every device and dtype gets the same numbers). adaLN-zero: every modulation Linear and the output
    projection start at zero (each block the identity, the model predicting 0); norms at 1, biases at 0,
    the other Linears Xavier-uniform. A name no rule covers is an error."""
    values = torch.empty(t.shape, dtype=torch.float32)
    if _ZEROED.fullmatch(name) or name.endswith(".bias"):
        values.zero_()
    elif name.endswith("_norm.weight"):
        values.fill_(1.0)
    elif name.endswith(".weight") and t.dim() == 2:
        nn.init.xavier_uniform_(values, generator=generator)
    else:
        raise ValueError(f"init_parameter: no rule for stand-in DiT parameter {name!r} {tuple(t.shape)}")
    return t.copy_(values)


# ---------------------------------------------------------------- network


class StandinBlock(nn.Module):
    """One block: adaLN-modulated self-attention, cross-attention to the text, adaLN-modulated MLP."""

    def __init__(self, cfg: StandinDiTConfig):
        super().__init__()
        D, Dh = cfg.hidden, cfg.head_dim
        self.heads, self.eps = cfg.heads, cfg.eps
        self.mod = nn.Linear(D, 6 * D)
        self.qkv = nn.Linear(D, 3 * D)
        self.q_norm, self.k_norm = RMSNorm(Dh, cfg.eps), RMSNorm(Dh, cfg.eps)
        self.proj = nn.Linear(D, D)
        self.cross_q, self.cross_kv, self.cross_out = nn.Linear(D, D), nn.Linear(D, 2 * D), nn.Linear(D, D)
        self.fc1, self.fc2 = nn.Linear(D, cfg.ffn), nn.Linear(cfg.ffn, D)
        self.attention_backend = "native"  # set_attention_backend flips it

    def forward(self, x: torch.Tensor, temb: torch.Tensor, text: torch.Tensor, sp=None) -> torch.Tensor:
        """x (B, L, D) float32 residual stream, temb (B, D) float32, text (B, Lt, D) -> (B, L, D) float32."""
        B, L, D = x.shape
        H = self.heads
        cdt = compute_dtype_of(x)
        mod = self.mod(F.silu(temb).to(cdt)).float().unsqueeze(1)  # (B, 1, 6D) float32
        shift1, scale1, gate1, shift2, scale2, gate2 = mod.chunk(6, dim=-1)  # (B, 1, D) each
        q, k, v = self.qkv(modulate(x, shift1, scale1, self.eps, cdt)).view(B, L, 3, H, D // H).unbind(2)
        q, k = self.q_norm(q), self.k_norm(k)  # (B, L, H, Dh)
        a = sp.attention(q, k, v) if sp is not None else attention(q, k, v, backend=self.attention_backend)
        x = gated_add(x, self.proj(a.flatten(2)), gate1)  # (B, L, D) float32
        cq = self.cross_q(F.layer_norm(x, (D,), eps=self.eps).to(cdt)).view(B, L, H, D // H)
        ck, cv = self.cross_kv(text).view(B, text.shape[1], 2, H, D // H).unbind(2)  # (B, Lt, H, Dh)
        c = attention(cq, ck, cv, backend=self.attention_backend)  # (B, L, H, Dh)
        x = x + self.cross_out(c.flatten(2)).float()
        h = self.fc2(F.gelu(self.fc1(modulate(x, shift2, scale2, self.eps, cdt)), approximate="tanh"))
        return gated_add(x, h, gate2)


class StandinDiT(IslandCast, BlockTraining, nn.Module):
    """The stand-in DiT. Build on the meta device and materialise with `load_state_dict(sd, assign=True)`,
    or build on a device and `initialize_weights(seed)`.

    Sequence-parallel seam: `model.seq_parallel = sp` (None = off), where `sp` has split(t, dim),
    attention(q, k, v) over every rank's tokens and gather(t, dim) (`UlyssesSequenceParallel`): the
    video tokens are split after the patch embedding and gathered after the head; the text, the time
    vector and the cross-attention stay local."""

    def __init__(self, config: StandinDiTConfig, init_seed: int | None = None):
        super().__init__()
        cfg = self.config = config
        D = cfg.hidden
        self.patch_embed = nn.Linear(cfg.patch_channels, D)
        self.time_embed = nn.Sequential(nn.Linear(cfg.freq_dim, D), nn.SiLU(), nn.Linear(D, D))
        self.text_embed = nn.Linear(cfg.text_dim, D)
        self.layers = nn.ModuleList(StandinBlock(cfg) for _ in range(cfg.depth))
        self.head = nn.ModuleDict({"mod": nn.Linear(D, 2 * D), "proj": nn.Linear(D, cfg.patch_channels)})
        self.checkpointed_blocks: frozenset[int] = frozenset()  # BlockTraining's state
        self.offload_checkpoints = False
        self.recompute_saved = True  # nothing is stored as a recipe here: the flag changes nothing
        self.blocks_compiled = False
        self.seq_parallel = None
        self.compute_dtype: torch.dtype | None = None  # set by cast_standin
        initialize_by_name(self, init_parameter, cfg, init_seed)

    @torch.no_grad()
    def initialize_weights(self, seed: int | None = None) -> None:
        initialize_by_name(self, init_parameter, self.config, seed)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.layers

    @property
    def device(self) -> torch.device:
        return self.patch_embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The bulk weights' storage dtype (the float32 islands aside)."""
        return self.patch_embed.weight.dtype

    def cast(self, dtype: torch.dtype) -> "StandinDiT":
        return cast_standin(self, dtype)

    def set_attention_backend(self, backend: str) -> "StandinDiT":
        return set_attention_backend(self, backend)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, context) -> torch.Tensor:
        """Velocity prediction.

        x: (B, in_channels, F', h, w) latents, F', h, w divisible by patch_size; cast to the model dtype.
        timestep: (B,) on 0..1000 (1000 = pure noise), float.
        context: B text embeddings (Lt_i, text_dim), Lt_i <= text_len (zero-padded to text_len here).
        Returns (B, in_channels, F', h, w) float32.
        """
        with self.precision(x.device.type):
            return self._forward(x, timestep, context)

    def _forward(self, x, timestep, context):
        cfg = self.config
        B, C, Fr, H, W = x.shape
        pt, ph, pw = cfg.patch_size
        if C != cfg.in_channels or Fr % pt or H % ph or W % pw:
            raise ValueError(f"x has shape {tuple(x.shape)}; expected (B, {cfg.in_channels}, F', h, w) with F', h, w "
                             f"divisible by patch_size={cfg.patch_size}")
        if tuple(timestep.shape) != (B,):
            raise ValueError(f"timestep has shape {tuple(timestep.shape)}; expected ({B},)")
        if len(context) != B or any(c.dim() != 2 or c.shape[1] != cfg.text_dim or c.shape[0] > cfg.text_len
                                    for c in context):
            raise ValueError(f"context must be {B} tensors (Lt_i <= {cfg.text_len}, {cfg.text_dim}); got "
                             f"{[tuple(c.shape) for c in context]}")
        g = (Fr // pt, H // ph, W // pw)
        tokens = x.to(self.dtype).view(B, C, g[0], pt, g[1], ph, g[2], pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
        img = f32(self.patch_embed(tokens.reshape(B, math.prod(g), cfg.patch_channels)))  # (B, L, D)
        with torch.autocast(x.device.type, enabled=False):  # float32 island: the time MLP
            temb = self.time_embed(sinusoidal_embedding(timestep, cfg.freq_dim).to(self.time_embed[0].weight.dtype))
        temb = f32(temb)  # (B, D)
        padded = torch.stack([F.pad(c, (0, 0, 0, cfg.text_len - c.shape[0])) for c in context])  # (B, Lt, text_dim)
        text = self.text_embed(padded.to(self.dtype))  # (B, Lt, D)
        sp = self.seq_parallel
        if sp is not None:
            img = sp.split(img, dim=1)  # (B, L_local, D)
        for i, block in enumerate(self.layers):
            img = self.run_block(i, block, img, temb, text, sp)  # (B, L_local, D) float32
        with torch.autocast(x.device.type, enabled=False):  # float32 island: the head
            shift, scale = self.head["mod"](F.silu(temb)).unsqueeze(1).chunk(2, dim=-1)  # (B, 1, D) each
            out = self.head["proj"](modulate(img, shift, scale, cfg.eps, self.head["proj"].weight.dtype))
        if sp is not None:
            out = sp.gather(out, dim=1)  # (B, L, C * pt*ph*pw)
        out = out.float().view(B, *g, C, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)  # (B, C, F', pt, h', ph, w', pw)
        return out.reshape(B, C, Fr, H, W)


# ---------------------------------------------------------------- precision: the float32 islands

FLOAT32_MODULES = ("time_embed", "head")


def float32_param_names(model: nn.Module) -> set[str]:
    """The parameters kept float32 whatever the model computes in: the time MLP, the head, the q/k norms."""
    names = set()
    for module_name, module in model.named_modules():
        whole = any(module_name == m or module_name.startswith(m + ".") for m in FLOAT32_MODULES)
        if whole or isinstance(module, RMSNorm):
            names.update(f"{module_name}.{n}" for n, _ in module.named_parameters(recurse=False))
    return names


def param_dtypes(model: nn.Module, dtype: torch.dtype, masters: bool = False) -> dict[str, torch.dtype]:
    """Each floating parameter's storage dtype in a model computing in `dtype`: float32 for the islands and,
    with `masters`, for every parameter that requires grad; `dtype` for the rest."""
    return storage_dtypes(model, dtype, float32_param_names(model) if dtype != torch.float32 else set(), masters)


def cast_standin(model: nn.Module, dtype: torch.dtype, masters: bool = False) -> nn.Module:
    """Cast in place to `param_dtypes(model, dtype, masters)`; the forward then runs under `dtype` autocast."""
    return cast_to_storage(model, param_dtypes(model, dtype, masters), dtype)


# ---------------------------------------------------------------- LoRA targets and FLOPs

# every Linear of the blocks but the adaLN modulation (peft `target_modules`, full-match regex)
LORA_TARGETS = r"layers\.\d+\.(qkv|proj|cross_q|cross_kv|cross_out|fc1|fc2)"


def standin_flops(cfg: StandinDiTConfig, num_tokens: int, text_len: int, batch: int = 1) -> float:
    """Forward FLOPs (2 per multiply-add) of the matmuls and attentions; `text_len` is the padded length."""
    D, L, F_, Lt = cfg.hidden, num_tokens, cfg.ffn, cfg.text_len
    block = (2 * L * D * (3 * D + D)          # qkv, proj
             + 4 * L * L * D                   # self-attention scores and weighted sum
             + 2 * L * D * 2 * D + 2 * Lt * D * 2 * D  # cross_q, cross_out; cross_kv
             + 4 * L * Lt * D                  # cross-attention
             + 2 * L * D * F_ * 2              # fc1, fc2
             + 2 * D * 6 * D)                  # modulation
    outside = (2 * L * cfg.patch_channels * D * 2 + 2 * Lt * cfg.text_dim * D
               + 2 * (cfg.freq_dim * D + D * D) + 2 * D * 2 * D)
    return float(batch * (cfg.depth * block + outside))
