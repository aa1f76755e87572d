"""The MiniMax H3 audio-video DiT (MiniMaxAI/MiniMax-H3, ~33B), written from the math: one stack of
full-self-attention blocks over ONE packed sequence of text, keyframe, audio and video rows.

    text (B, Lt, text_dim) -> condition_proj -> token_refiner (2 plain blocks, padded rows masked) -> (B, Lt, D)
    keyframes (B, C, K, h, w), video (B, C, F', h, w) -> patchify (c pt ph pw) -> video_patch_proj -> (B, K h'w' | L, D)
    audio (B, S, C_a, T) per stereo channel -> rows channel-major (B, S T, C_a) -> audio_patch_proj -> (B, S T, D)
      -> x = [text | keyframes | audio | video] (B, N, D) float32; row order, tags, clock: packing.py
    timesteps (B,) per group (video, audio, keyframes) on 0..1000 -> H3 time t = 1 - timestep / 1000
      -> time_embedder (sinusoid of t in 0..1, MLP)  -> temb (B G, 2688); SiLU once, shared by every AdaLN
    rotary coordinates (B|1, N, 3) (t, h, w) -> cos, sin (B|1, N, 1, 96): rotate-half on 96 of 128 channels
      -> num_layers x Block: per block adaln_proj(temb) -> (B, G, 3 tags, 6 D) -> per AdaLN entry (B, 4, 6 D);
         norm1 * (1 + scale) + shift per run of rows -> full attention over all N rows (qkv 3 x 56 x 128,
         q / k RMSNorm per head, RoPE) -> x += gate * out_proj; norm2, scale / shift, SwiGLU MLP, gated
      -> final_layer: norm * (1 + scale) + shift per timestep group -> video_out, audio_out over every row
      -> video rows -> unpatchify (B, C, F', h, w); audio rows -> (B, S, C_a, T); negated (see below)

Conventions at the boundary. MiniMax's time is t = 1 - sigma in 0..1 (1 = clean) and its velocity points to
the data (x0 = x_t + sigma v); the house speaks 0..1000 (1000 = noise) and velocity noise - x0
(`video_dit.diffusion.flow`), so forward takes house timesteps and returns -v: the same interpolation
x_t = (1 - sigma) x0 + sigma noise, the same network.

References: diffusers 0.42.1 `MiniMaxH3Transformer3DModel` and its modular pipeline (the packing) and SGLang's
`MiniMaxH3DiTModel` (python/sglang/multimodal_gen/runtime/models/dits/minimax_h3.py, the implementation the
original checkpoint's names and config are written for; MiniMax's GitHub repository holds the VAEs' code and
the checkpoints' configs, not the DiT's). They agree on the math. Where this file differs from both:
  * a batch: diffusers' batch axis replicates one layout and one timestep table; here each sample has its own
    timesteps (AdaLN rows per sample) and its own number of real text rows (`text_mask`, right-padded; padded
    rows are masked keys and the media clock of a sample starts at its own real length, as its unpadded
    request would have it). One layout (shapes, text tags, keyframe anchors) per batch.
  * no padding of the packed sequence: SGLang pads it to a multiple of 64 as a second attention document
    (cu_seqlens [0, used, N]); diffusers and this file do not (the same outputs for the real rows).
  * keyframe rows' outputs: SGLang zeroes them (update_mask), diffusers returns them; here they are not
    returned at all (forward returns the target video and audio only).
  * precision: the reference runs the residual stream, norms and modulation in bf16; here they are float32.

Parameter names are MiniMax's original checkpoint names (`blocks.N.attn.qkv_proj`, `blocks.N.adaln_proj.linear`,
`final_layer.video_out`, ...; `rope.inv_freq` is computed, not stored); `convert.py` reads diffusers' layout and
the original shards (whose fused q / k / v rows are interleaved per head). The model serves both released
partitions (t2va / fl2va and ref2va); forward builds the t2va / fl2va layout (no reference blocks).
Sequence parallelism plugs in through `H3DiT.seq_parallel`; no distributed code here.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from video_dit.families.minimax_h3.dit_config import MODALITIES, H3DiTConfig
from video_dit.families.minimax_h3.layers import Block, FinalLayer, TimeEmbedder, TokenRefiner
from video_dit.families.minimax_h3.packing import (ANCHORS, TEXT_TAG, VIDEO_TAG, Layout, pack_audio, patchify,
                                                   rank_order, rope_tables, row_runs, unpack_audio, unpatchify)
from video_dit.families.minimax_h3.vae_config import FPS
from video_dit.models.attention import set_attention_backend
from video_dit.models.common import (BlockTraining, IslandCast, cast_to_storage, initialize_by_name,
                                     storage_dtypes)
from video_dit.models.layers import RMSNorm, compute_dtype_of, f32

# ---------------------------------------------------------------- initialisation

_ZEROED = re.compile(r"(blocks\.\d+|final_layer)\.adaln_proj\.linear\.(weight|bias)"
                     r"|final_layer\.(video|audio)_out\.weight")
_TIME_MLP = re.compile(r"time_embedder\.proj_(in|out)\.weight")


@torch.no_grad()
def init_parameter(config: H3DiTConfig, name: str, t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The initial value of parameter `name` (native names), written into `t` in place; drawn in float32 on the
    CPU from `generator`, so every dtype and device gets the same numbers. MiniMax publishes no
    initialisation; these are DiT's rules (facebookresearch/DiT `initialize_weights`), with every AdaLN
    projection zero as SGLang's `MiniMaxH3AdalnProj` ("SiLU + zero-init linear") says. A name no rule covers
    is an error: a new parameter needs its rule here."""
    values = torch.empty(t.shape, dtype=torch.float32, device="cpu")
    if _ZEROED.fullmatch(name):
        # every AdaLN projection (all gates 0: each block starts as the identity) and the output heads (the
        # model predicts 0)
        values.zero_()
    elif _TIME_MLP.fullmatch(name):  # the timestep MLP: N(0, 0.02) (DiT's t_embedder)
        values.normal_(std=0.02, generator=generator)
    elif name.endswith(".bias"):
        values.zero_()
    elif name.endswith(".weight") and t.dim() == 1:  # RMSNorm scales
        values.fill_(1.0)
    elif name.endswith(".weight") and t.dim() == 2:  # every other Linear: Xavier-uniform (DiT _basic_init)
        nn.init.xavier_uniform_(values, generator=generator)
    else:
        raise ValueError(f"init_parameter: no initialisation rule for MiniMax H3 parameter {name!r} {tuple(t.shape)}")
    return t.copy_(values)


# ---------------------------------------------------------------- network


class H3DiT(IslandCast, BlockTraining, nn.Module):
    """The MiniMax H3 DiT. Build on the meta device and materialise with `load_state_dict(sd, assign=True)`, or
    with `to_empty(device=...)` and `initialize_weights(seed)`.

    Sequence-parallel seam: `model.seq_parallel = sp` (None = off). After the embeddings, the packed rows of
    every modality (text, keyframes, audio, video: the whole sequence of N rows) are split over the n ranks of a
    sequence group so that every rank holds an equal slice of each of them: the rows are first reordered
    (`packing.rank_order`: each segment cut into n chunks, zero-padded to equal ones, rank r's chunks of all
    segments side by side; Np rows, a multiple of n), the padded rows masked as keys; then split contiguously.
    The refiner runs before the split, on the whole text, the same on every rank. `sp` has
      size -> n, the ranks of the sequence group;
      split(t, dim) -> this rank's slice of t along dim (t: one of forward's reordered tensors: the rows
          (B, Np, D), the RoPE tables (B|1, Np, 1, R), the key mask (B, Np) bool, the rows' AdaLN entries (Np,)
          int64; Np divides by n, so the layer pads nothing);
      gather(t, dim) -> the whole tensor from every rank's slice (split's inverse);
      attention(q, k, v, key_mask) -> out: q, k, v (B, Np/n, H, Dh) this rank's rows (q / k normed and
          rotated), key_mask (B, Np/n) bool (False: a padded text row or a padded row of the reordering, never
          attended to) or None; out (B, Np/n, H, Dh): each query attends over ALL Np rows but the masked ones
          (the layer all-gathers the key masks).
    forward splits along the reordered rows and gathers the final layer's output (B, Np, patch_dim + C_a),
    restores the packed order (B, N, ...) and takes the video and audio rows. Everything per row (AdaLN, MLP,
    norms, the output heads) stays local; the only attention of the blocks is `sp.attention`
    (tests/test_h3_dit.py). A Ulysses layer: an all-to-all that scatters heads and gathers rows for q / k / v,
    one attention over the Np rows with the gathered key mask,
    the reverse all-to-all; with every collective's backward its exact adjoint, the ranks' gradients add up
    to N x the unsplit model's, as the other families'.
    """

    def __init__(self, config: H3DiTConfig, init_seed: int | None = None):
        super().__init__()
        cfg = self.config = config
        D = cfg.hidden_size
        self.video_patch_proj = nn.Linear(cfg.patch_dim, D)
        self.audio_patch_proj = nn.Linear(cfg.audio_in_channels, D)
        self.condition_proj = nn.Linear(cfg.text_dim, D)
        self.time_embedder = TimeEmbedder(cfg)
        self.token_refiner = TokenRefiner(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_layer = FinalLayer(cfg)
        self.checkpointed_blocks: frozenset[int] = frozenset()  # set_checkpointed_blocks (BlockTraining)
        self.offload_checkpoints = False
        self.recompute_saved = True  # nothing to recompute: the blocks keep what autograd saves
        self.blocks_compiled = False  # compile_blocks
        self.seq_parallel = None  # set from outside (video_dit/parallel); see the class docstring
        self.compute_dtype: torch.dtype | None = None  # None: the bulk weights' dtype; set by cast_h3_dit
        self.initialize_weights(init_seed)

    # -------------------------------------------------------------- set-up

    @torch.no_grad()
    def initialize_weights(self, seed: int | None = None) -> None:
        """`init_parameter` for every parameter, each from its own CPU generator seeded by (`seed`, name): the
        same values whatever order or device. `seed=None` draws it from torch's global RNG. Meta: no-op."""
        initialize_by_name(self, init_parameter, self.config, seed)

    @property
    def device(self) -> torch.device:
        return self.condition_proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The bulk weights' storage dtype (the float32 islands aside; see `cast_h3_dit`)."""
        return self.condition_proj.weight.dtype

    def cast(self, dtype: torch.dtype) -> "H3DiT":
        """`to(dtype)` (`IslandCast`): `cast_h3_dit`."""
        return cast_h3_dit(self, dtype)

    # `blocks` (the ModuleList) is what checkpointing, compilation and the memory plan count (`BlockTraining`).

    def set_attention_backend(self, backend: str) -> "H3DiT":
        """"native" (torch SDPA) or an optional kernel; calls with padded text rows always use SDPA."""
        return set_attention_backend(self, backend)

    def rope_inv_freq(self, device) -> torch.Tensor:
        """(rope_freq_dim,) float32 1 / theta^(2i / 2F): the checkpoint's `rope.inv_freq`, computed as diffusers
        `MiniMaxH3RotaryPosEmbed` does (bitwise the shipped buffer, its conversion script says)."""
        F_ = self.config.rope_freq_dim
        return 1.0 / (self.config.rope_theta ** (torch.arange(0, 2 * F_, 2, dtype=torch.float32, device=device)
                                                 / (2 * F_)))

    # -------------------------------------------------------------- forward

    def forward(self, video: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor, *, audio: torch.Tensor,
                audio_timestep: torch.Tensor, text_mask: torch.Tensor | None = None,
                text_tags: torch.Tensor | None = None, keyframes: torch.Tensor | None = None,
                keyframe_anchors: tuple[str, ...] = (), keyframe_timestep: torch.Tensor | None = None,
                fps: float = FPS) -> tuple[torch.Tensor, torch.Tensor]:
        """Velocity prediction of the target video and audio. The house's DiT call (`dit(x, timestep, context,
        ...)`, as the trainer's objective and the pipelines make it) with the audio stream and the packing's
        extras as keywords.

        video: (B, in_channels, F', h, w) video-VAE latents (noised), h, w divisible by patch_size.
        timestep, audio_timestep: (B,) on 0..1000 (1000 = pure noise) of the video (and text) rows and of the
            audio rows (the pipeline steps two schedules: shift 12 video, 3 audio).
        text: (B, Lt, text_dim) the conditioner's rows (Qwen3-VL hidden_states[50] of the presentation).
        audio: (B, audio_channels, audio_in_channels, T) audio-VAE latents, one (C_a, T) per stereo channel
            (the mono audio VAE's layout, its batch of channels behind the sample axis).
        text_mask: (B, Lt) bool / 0-1 (True = a real row), each row's real rows first; None: all real.
        text_tags: (Lt,) int, the modality tag of each text row (1 text, 0 a keyframe's vision-block row, as
            the presentation tags them); None: all 1.
        keyframes: (B, in_channels, K, h, w) the keyframes' latents (one latent frame each, at their conditioning
            noise: the pipeline holds them at t = 0.999), K = len(keyframe_anchors); None: t2va (K = 0).
        keyframe_anchors: "first" / "last" per keyframe, in packed order.
        keyframe_timestep: (B,) on 0..1000 of the keyframe rows (the pipeline: min(timestep, 1), i.e. its
            max(t, 0.999)); required with keyframes.
        fps: the clip's frame rate; MiniMax H3's rotary clock is built for 24 fps only (5/3 units a pixel frame,
            40 a second, the audio latents' rate), so anything else is refused rather than mis-positioned.
        Returns (video velocity (B, in_channels, F', h, w), audio velocity (B, audio_channels, audio_in_channels,
        T)): noise - x0, float32 unless the model is cast whole to another dtype.
        """
        if fps != FPS:
            raise ValueError(f"fps={fps:g}: MiniMax H3's rotary clock is built for {FPS} fps clips only (its video "
                             f"and audio rows share one 40 Hz clock); resample the clips to {FPS} fps (a dataset's "
                             "`fps`, the sampler's --fps)")
        with self.precision(video.device.type):
            return self._forward(video, audio, text, timestep, audio_timestep, text_mask, text_tags, keyframes,
                                 tuple(keyframe_anchors), keyframe_timestep)

    def _layout(self, video, audio, text, timestep, audio_timestep, text_mask, text_tags, keyframes, anchors,
                keyframe_timestep) -> tuple[Layout, list[int] | None]:
        """The input contract (see `forward`) checked; the batch's layout and its samples' real text lengths."""
        cfg = self.config
        if video.dim() != 5 or video.shape[1] != cfg.in_channels or video.shape[3] % cfg.patch_size[1] \
                or video.shape[4] % cfg.patch_size[2]:
            raise ValueError(f"video has shape {tuple(video.shape)}; expected (B, {cfg.in_channels}, F', h, w) with h, "
                             f"w divisible by patch_size={cfg.patch_size}")
        B, _, Fr, H, W = video.shape
        if audio.dim() != 4 or tuple(audio.shape[:3]) != (B, cfg.audio_channels, cfg.audio_in_channels):
            raise ValueError(f"audio has shape {tuple(audio.shape)}; expected ({B}, {cfg.audio_channels}, "
                             f"{cfg.audio_in_channels}, T): (B, stereo channels, audio_in_channels, latent frames)")
        if text.dim() != 3 or text.shape[0] != B or text.shape[2] != cfg.text_dim or text.shape[1] < 1:
            raise ValueError(f"text has shape {tuple(text.shape)}; expected ({B}, rows >= 1, {cfg.text_dim})")
        Lt = text.shape[1]
        for name, t in (("timestep", timestep), ("audio_timestep", audio_timestep),
                        ("keyframe_timestep", keyframe_timestep)):
            if t is not None and (tuple(t.shape) != (B,) or bool(((t < 0) | (t > 1000)).any())):
                raise ValueError(f"{name} has shape {tuple(t.shape)} (or values outside 0..1000); expected ({B},) "
                                 "on 0..1000")
        bad = [a for a in anchors if a not in ANCHORS]
        if bad:
            raise ValueError(f"keyframe_anchors {anchors}: {bad[0]!r} is not accepted; accepted: {', '.join(ANCHORS)}")
        if keyframes is None:
            if anchors or keyframe_timestep is not None:
                raise ValueError("keyframe_anchors / keyframe_timestep given without keyframes")
        elif tuple(keyframes.shape) != (B, cfg.in_channels, len(anchors), H, W) or keyframe_timestep is None:
            raise ValueError(f"keyframes {tuple(keyframes.shape)}: expected ({B}, {cfg.in_channels}, "
                             f"len(keyframe_anchors)={len(anchors)}, {H}, {W}), with keyframe_timestep ({B},)")
        if text_tags is None:
            tags = (TEXT_TAG,) * Lt
        else:
            tags = tuple(int(v) for v in text_tags.flatten().tolist())
            if tuple(text_tags.shape) != (Lt,) or not set(tags) <= {VIDEO_TAG, TEXT_TAG}:
                raise ValueError(f"text_tags {tuple(text_tags.shape)}: expected ({Lt},) of {TEXT_TAG} (text) / "
                                 f"{VIDEO_TAG} (a vision-block row)")
        lengths = None
        if text_mask is not None:
            mask = text_mask.bool()
            count = mask.sum(-1, keepdim=True)  # real rows per sample
            right_padded = torch.arange(Lt, device=mask.device) < count
            if tuple(mask.shape) != (B, Lt) or not torch.equal(mask, right_padded) or bool((count < 1).any()):
                raise ValueError(f"text_mask {tuple(text_mask.shape)}: expected ({B}, {Lt}), each row's real rows "
                                 "first (right-padded) and at least one")
            lengths = count.flatten().tolist()
            if min(lengths) == Lt:
                lengths = None  # no padding: no key mask (the optional attention kernels stay usable)
        pt, ph, pw = cfg.patch_size
        layout = Layout(text_len=Lt, text_tags=tags, anchors=anchors, grid=(Fr // pt, H // ph, W // pw),
                        latent_hw=(H, W), audio_channels=cfg.audio_channels, audio_frames=audio.shape[3])
        return layout, lengths

    def _forward(self, video, audio, text, timestep, audio_timestep, text_mask, text_tags, keyframes, anchors,
                 keyframe_timestep):
        cfg = self.config
        layout, lengths = self._layout(video, audio, text, timestep, audio_timestep, text_mask, text_tags,
                                       keyframes, anchors, keyframe_timestep)
        B, device = video.shape[0], video.device
        key_text = None if lengths is None else text_mask.bool()

        txt = self.condition_proj(text.to(self.dtype))  # (B, Lt, D)
        cdt = compute_dtype_of(txt)  # the Linears' dtype: bf16 under a bf16 model's autocast
        txt = self.token_refiner(txt, key_text, cdt)  # (B, Lt, D) float32
        with torch.autocast(device.type, enabled=False):  # float32 islands: the patch projections
            rows = patchify(video, cfg.patch_size)  # (B, L, C pt ph pw)
            if keyframes is not None:
                rows = torch.cat([patchify(keyframes, cfg.patch_size), rows], dim=1)  # (B, K h'w' + L, ...)
            vid = f32(self.video_patch_proj(rows.to(self.video_patch_proj.weight.dtype)))
            aud = f32(self.audio_patch_proj(pack_audio(audio).to(self.audio_patch_proj.weight.dtype)))  # (B, S T, D)
        K = layout.audio_start - layout.keyframe_start
        x = torch.cat([txt, vid[:, :K], aud, vid[:, K:]], dim=1)  # (B, N, D) float32, packing.py's order

        groups = [timestep, audio_timestep] + ([keyframe_timestep] if keyframes is not None else [])
        t = 1.0 - torch.stack(groups, dim=1).to(device=device, dtype=torch.float32) / 1000.0  # (B, G) H3 time
        temb = F.silu(f32(self.time_embedder(t.flatten())))  # (B G, time_embed_dim), sample-major

        positions = (layout.positions(layout.text_len)[None] if lengths is None
                     else torch.stack([layout.positions(n) for n in lengths]))  # (B|1, N, 3) float64
        cos, sin = (r.unsqueeze(2) for r in rope_tables(positions.to(device), self.rope_inv_freq(device)))
        key_mask = None if key_text is None else torch.cat(
            [key_text, key_text.new_ones(B, layout.length - layout.text_len)], dim=1)  # (B, N)
        entries = layout.entries().to(device)  # (N,)

        sp = self.seq_parallel
        if sp is not None:  # every rank: an equal slice of the rows of every modality (see the class docstring)
            order = rank_order(layout.segments, sp.size)
            x, cos, sin = (order.reorder(t, 1) for t in (x, cos, sin))  # (B, Np, D), (B|1, Np, 1, R)
            entries = order.reorder(entries, 0)  # (Np,); a padded row's entry 0 (its output is dropped)
            if key_mask is not None or not bool(order.real.all()):  # padded rows are never keys
                real = order.real.to(device)[None]  # (1, Np)
                key_mask = real.expand(B, -1) if key_mask is None else order.reorder(key_mask, 1) & real  # (B, Np)
            x, cos, sin = sp.split(x, 1), sp.split(cos, 1), sp.split(sin, 1)  # (B, Np/n, D), (B|1, Np/n, 1, R)
            entries = sp.split(entries, 0)
            key_mask = None if key_mask is None else sp.split(key_mask, 1)  # (B, Np/n)
        runs = row_runs(entries)

        for i, block in enumerate(self.blocks):
            x = self.run_block(i, block, x, temb, runs, (cos, sin), key_mask, cdt, sp)  # (B, N_local, D)
        out = self.final_layer(x, temb, runs)  # (B, N_local, patch_dim + C_a)
        if sp is not None:
            out = order.restore(sp.gather(out, 1), 1)  # (B, Np, ...) -> (B, N, patch_dim + C_a), packed order
        video_v = unpatchify(out[:, layout.video_start:, :cfg.patch_dim], layout.grid, cfg.in_channels, cfg.patch_size)
        audio_v = unpack_audio(out[:, layout.audio_start:layout.video_start, cfg.patch_dim:], cfg.audio_channels)
        return -video_v, -audio_v  # the house velocity noise - x0 (MiniMax's points to the data)


# ---------------------------------------------------------------- precision: the float32 islands

# Sub-modules kept whole in float32 in a bf16 model: the checkpoint's float32 ones (the patch projections, the
# timestep MLP, the output heads) and the final layer's norm and AdaLN projection (small, once per step).
FLOAT32_MODULES = ("video_patch_proj", "audio_patch_proj", "time_embedder", "final_layer")


def float32_param_names(model: nn.Module) -> set[str]:
    """Names of the parameters an H3 DiT stores in float32 whatever dtype it computes in: `FLOAT32_MODULES` and
    every RMSNorm scale (the block AdaLN projections, ~13B parameters, stay in the bulk dtype)."""
    names = set()
    for module_name, module in model.named_modules():
        whole = any(module_name == m or module_name.startswith(m + ".") for m in FLOAT32_MODULES)
        if whole or isinstance(module, RMSNorm):
            names.update(f"{module_name}.{n}" for n, _ in module.named_parameters(recurse=False))
    return names


def param_dtypes(model: nn.Module, dtype: torch.dtype, masters: bool = False) -> dict[str, torch.dtype]:
    """The storage dtype of each floating parameter of a model that computes in `dtype`: float32 for the
    float32 islands and, with `masters`, for every parameter that requires grad; `dtype` for the rest."""
    return storage_dtypes(model, dtype, float32_param_names(model) if dtype != torch.float32 else set(), masters)


def cast_h3_dit(model: nn.Module, dtype: torch.dtype, masters: bool = False) -> nn.Module:
    """Cast in place: each parameter to `param_dtypes(model, dtype, masters)` and `model.compute_dtype = dtype`,
    so the forward runs the bulk under `dtype` autocast and the islands in float32."""
    return cast_to_storage(model, param_dtypes(model, dtype, masters), dtype)


# ---------------------------------------------------------------- LoRA targets and FLOPs

# The attention and MLP Linears of every block (peft `target_modules`, a full-match regex). Not the per-block
# AdaLN projections (blocks.N.adaln_proj.linear, 2688 x 96768 each: ~13B of the ~33B parameters, which a LoRA
# on every block would multiply into the largest adapters) nor the text refiner's blocks. The published H3
# LoRAs also adapt the AdaLN projections at rank 16 beside rank 64 on attention and MLP (diffusers
# `MiniMaxH3LoraLoaderMixin`'s note); `ADALN_LORA_TARGETS` names them for a job that wants the same.
LORA_TARGETS = r"blocks\.\d+\.(attn\.(qkv_proj|out_proj)|mlp\.fc[12])"
ADALN_LORA_TARGETS = r"blocks\.\d+\.adaln_proj\.linear"


def h3_dit_flops(config: H3DiTConfig, video_tokens: int, text_tokens: int, audio_tokens: int, batch: int = 1,
                 keyframe_tokens: int = 0) -> float:
    """Analytic forward FLOPs (2 per multiply-add) of the matmuls and attention; backward is ~2x this.
    Rows N = video + keyframe + text + audio tokens (audio: stereo channels x latent frames); D hidden, I =
    heads x head_dim, Fd ffn_dim, Te time_embed_dim, G timestep groups (3 with keyframes, else 2).
      per block: 2 N D 3I (qkv) + 4 N^2 I (attention) + 2 N I D (out) + 2 N D 2Fd + 2 N Fd D (SwiGLU)
                 + 2 G Te 18D (its AdaLN projection, once per timestep group and sample)
      refiner blocks: the same on the Lt text rows without AdaLN
      once: patch / condition projections, the timestep MLP, the final AdaLN (2D) and both heads over all N rows."""
    c = config
    D, I, Fd, Te = c.hidden_size, c.inner_dim, c.ffn_dim, c.time_embed_dim
    N = video_tokens + keyframe_tokens + text_tokens + audio_tokens
    G = 3 if keyframe_tokens else 2

    def block(rows: int) -> int:
        return 2 * rows * D * 3 * I + 4 * rows * rows * I + 2 * rows * I * D + 2 * rows * D * 2 * Fd + 2 * rows * Fd * D

    adaln = 2 * G * Te * 6 * MODALITIES * D
    once = (2 * (video_tokens + keyframe_tokens) * c.patch_dim * D + 2 * audio_tokens * c.audio_in_channels * D
            + 2 * text_tokens * c.text_dim * D + 2 * G * (c.freq_dim * c.time_embed_hidden_dim
                                                         + c.time_embed_hidden_dim * Te)
            + 2 * G * Te * 2 * D + 2 * N * D * (c.patch_dim + c.audio_in_channels))
    return float(batch * (c.num_layers * (block(N) + adaln) + c.num_refiner_layers * block(text_tokens) + once))
