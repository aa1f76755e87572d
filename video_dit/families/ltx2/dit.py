"""The LTX-2 audio-video DiT (Lightricks/LTX-2 ltx-core `LTXModel`), written from the math.

    video (B, C, F', h, w) -> patchify (c pt ph pw) -> patchify_proj             -> vx (B, L, D), L = F'/pt h/ph w/pw
      [+ keyframes_abs_pos_embedding on marked tokens (2.5)]
    audio (B, Ca, T, M) audio-VAE latents -> (B, T, Ca*M) -> audio_patchify_proj -> ax (B, T, Da)
    video_timestep (B,) or (B, L), audio_timestep (B,), on 0..1000:
      adaln_single(t_v) -> (B, 1|L, 6|9 D), emb (B, 1|L, D);  audio_adaln_single(t_a) -> (B, 1, 6|9 Da), emb
      av_ca_video_scale_shift(t_v), av_ca_audio_scale_shift(t_a)            -> a2v / v2a scale, shift (4 rows)
      av_ca_a2v_gate(sigma_a), av_ca_v2a_gate(sigma_v)                      -> a2v / v2a gates (the other stream's)
      prompt_adaln_single(sigma_v), audio_prompt_adaln_single(sigma_a)      -> text k / v modulation (2.3+)
    video_context (B, Lt, 3840 | D), audio_context (B, Lt, 3840 | Da): the text connectors' outputs
      [-> caption_projection, audio_caption_projection (2.0)]               -> (B, Lt, D), (B, Lt, Da)
    RoPE on real coordinates: video (seconds = frame / fps, pixel row, pixel column), audio (seconds);
      a2v / v2a attention: both streams' seconds only
      -> num_layers x LTX2Block (layers.py): per stream self-attention, text cross-attention, then
         audio->video and video->audio attention, then the FFN, each adaLN-modulated and gated
         [guidance passes: a stream's self-attention passed through (its value projection) in the STG
          blocks; no audio<->video attention at all (isolate_modalities)]
      -> LayerNorm * (1 + scale) + shift (scale_shift_table + emb) -> proj_out, audio_proj_out
      -> unpatchify: video velocity (B, C_out, F', h, w), audio velocity (B, Ca, T, M)

Variants (LTX2DiTConfig): 2.0 has the caption projections here; 2.3 gates every attention per head
(apply_gated_attention) and modulates the text cross-attention (cross_attention_adaln, 9 adaLN rows,
prompt tables); 2.5 drops the video FFN biases and adds the keyframe embedding.

Where ltx-core (Lightricks) and diffusers 0.42.1 disagree, this follows ltx-core (mirror commit 400fd31):
  * the a2v / v2a modulation: ltx-core takes the scale / shift from the stream's own (per-token)
    timesteps and the gate from the OTHER stream's sigma x av_ca_timestep_scale_multiplier
    (transformer_args.py `_prepare_cross_attention_timestep`, since 2026-05-28); diffusers takes both from
    the own timestep (use_cross_timestep=False) or both from the other's sigma (True, its pipelines'
    default). They agree when both streams share one timestep (t2v); with per-token video timesteps
    (i2v) the a2v scale / shift of conditioned tokens and the gates differ (tests/test_ltx2_dit.py).
  * ltx-core has one flag each for gated attention and text adaLN (both streams); diffusers one per stream.
  * the keyframe embedding: ltx-core's pipelines mark the first latent frame of every video
    (tools.py `_first_frame_keyframes_mask`); diffusers' regular pipelines pass no mask. Here the caller
    passes `keyframes_mask` (None: no token marked, as both models' forward).
  * padded text keys: ltx-core adds -finfo.max, diffusers -10000; here a bool key mask (SDPA). The same
    unless a sample has no valid text token at all.
Timesteps are on 0..1000 here (the house scale; ltx-core takes sigma in 0..1 and multiplies by
timestep_scale_multiplier; diffusers takes them multiplied).

Precision. ltx-core computes in the checkpoint dtype (bf16) throughout but for the timestep sinusoid
and the RoPE frequencies (float32 / float64), casting the RoPE tables to bf16. Here, as our other DiTs:
the residual streams, every RMSNorm / LayerNorm, the adaLN arithmetic, the RoPE rotation and the
attention gates in float32, and stored in float32 (`FLOAT32_MODULES`, `float32_param_names`): every
adaLN-single (timestep MLP and modulation Linear: small, once per step), every modulation table, the
q / k norm scales, the keyframe embedding and the output Linears. The rest computes in the bulk dtype.

Parameter names are Lightricks' single-file checkpoint names (`transformer_blocks.N.attn1.to_q`,
`adaln_single.linear`, ...; the file prefixes them with `model.diffusion_model.`); `convert.py` maps
diffusers'. Sequence parallelism plugs in through `LTX2DiT.seq_parallel`; no distributed code here.
"""

from __future__ import annotations

import math
import re
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from video_dit.families.ltx2.dit_config import LTX2DiTConfig
from video_dit.families.ltx2.layers import (AdaLayerNormSingle, CaptionProjection, LTX2Block, Stream, audio_positions,
                                            rope_tables, video_positions)
from video_dit.models.attention import set_attention_backend
from video_dit.models.common import (BlockTraining, IslandCast, cast_to_storage, initialize_by_name,
                                     storage_dtypes)
from video_dit.models.layers import RecomputeSaved, RMSNorm, compute_dtype_of, f32

# ---------------------------------------------------------------- initialisation

_ADALN = r"(audio_)?(prompt_adaln_single|adaln_single)|av_ca_(video|audio)_scale_shift_adaln_single" \
         r"|av_ca_(a2v|v2a)_gate_adaln_single"
_TIME_MLP = re.compile(rf"({_ADALN})\.emb\.timestep_embedder\.linear_[12]\.weight")
_ADALN_LINEAR = re.compile(rf"({_ADALN})\.linear\.weight")
_TABLE_SCALED = re.compile(r"(transformer_blocks\.\d+\.)?(audio_)?scale_shift_table")
_TABLE_UNIT = re.compile(r"transformer_blocks\.\d+\.((audio_)?prompt_scale_shift_table"
                         r"|scale_shift_table_a2v_ca_(audio|video))")
_ZEROED = re.compile(r"keyframes_abs_pos_embedding|.*\.to_gate_logits\.(weight|bias)|(audio_)?proj_out\.weight")


@torch.no_grad()
def init_parameter(config: LTX2DiTConfig, name: str, t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The initial value of parameter `name` (Lightricks' names), written into `t` in place; drawn in
    float32 on the CPU from `generator`, so every dtype and device gets the same numbers. Lightricks
    publishes no initialisation (its tables are `torch.empty`); these rules are PixArt-alpha's (LTX-2's
    adaLN-single and caption projection are PixArt-alpha's) and diffusers' for the tables. A name no
    rule covers is an error: a new parameter needs its rule here."""
    values = torch.empty(t.shape, dtype=torch.float32, device="cpu")
    if _ZEROED.fullmatch(name):
        # the keyframe embedding (Lightricks: zero, a no-op until trained), the gate logits (gates
        # 2 * sigmoid(0) = 1, ltx-core's comment) and the output Linears (PixArt-alpha: the model predicts 0)
        values.zero_()
    elif _TABLE_SCALED.fullmatch(name):  # block and output modulation tables: N(0, 1) / sqrt(width) (diffusers)
        values.normal_(generator=generator).div_(t.shape[-1] ** 0.5)
    elif _TABLE_UNIT.fullmatch(name):  # prompt and a2v / v2a tables: N(0, 1) (diffusers)
        values.normal_(generator=generator)
    elif _TIME_MLP.fullmatch(name) or _ADALN_LINEAR.fullmatch(name):  # PixArt-alpha: t_embedder, t_block N(0, 0.02)
        values.normal_(std=0.02, generator=generator)
    elif name.endswith(".bias"):
        values.zero_()
    elif name.endswith(".weight") and t.dim() == 1:  # RMSNorm scales
        values.fill_(1.0)
    elif name.endswith(".weight") and t.dim() == 2:  # every other Linear: Xavier-uniform (PixArt-alpha _basic_init)
        nn.init.xavier_uniform_(values, generator=generator)
    else:
        raise ValueError(f"init_parameter: no initialisation rule for LTX-2 parameter {name!r} {tuple(t.shape)}")
    return t.copy_(values)


# ---------------------------------------------------------------- network


class LTX2DiT(IslandCast, BlockTraining, nn.Module):
    """The LTX-2 audio-video DiT. Build on the meta device and materialise with `load_state_dict(sd,
    assign=True)`, or with `to_empty(device=...)` and `initialize_weights(seed)`.

    Sequence-parallel seam: `model.seq_parallel = sp` (None = off). Both streams' tokens are split over
    the N ranks of a sequence group after the patch embeddings; the text is replicated (the same on every
    rank). `stream` is "video" or "audio". `sp` has
      split(t, dim, stream) -> this rank's slice of t (one of the stream's whole-sequence tensors) along dim;
      gather(t, dim, stream) -> the whole-sequence tensor from every rank's slice (split's inverse);
      self_attention(q, k, v, stream) -> out: q, k, v (B, L_local, H, Dh) this rank's tokens of `stream`
          (q / k normed and rotated); out (B, L_local, H, Dh): each query attends over ALL tokens of `stream`;
      cross_modal_attention(q, k, v, q_stream, kv_stream) -> out: q (B, Lq_local, H, Dh) this rank's tokens
          of q_stream, k, v (B, Lk_local, H, Dh) this rank's tokens of the other stream; out (B, Lq_local, H,
          Dh): each query attends over ALL tokens of kv_stream (audio->video: q video, k / v audio);
      text_attention(q, k, v, key_mask) -> out: q (B, L_local, H, Dh) this rank's tokens of a stream, k, v
          (B, Lt, H, Dh) the replicated text, key_mask (B, Lt) bool (False = padding) or None; out (B, L_local,
          H, Dh). Every key is on every rank, so a local (masked) attention is exact.
    forward splits along dim 1: the tokens, their RoPE rows (1, L, H, Dh/2) and, with per-token video
    timesteps, the per-token modulation (B, L, k D); it gathers the output layers' results along dim 1.
    Everything per token (modulation, FFN, norms) stays local. These five methods are the only attention
    path of a forward with `seq_parallel` set (tests/test_ltx2_dit.py). What a Ulysses layer must do: an
    all-to-all that scatters heads and gathers tokens for q / k / v of a stream (padded keys masked),
    local attention, the reverse all-to-all (cross-modal: q from one stream, k / v from the other, each
    exchanged the same way); the text attention may stay local. With every collective's backward its exact
    adjoint, the ranks' gradients of every parameter add up to N x the unsplit model's, as HunyuanVideo's.
    """

    def __init__(self, config: LTX2DiTConfig, init_seed: int | None = None):
        super().__init__()
        cfg = self.config = config
        D, Da = cfg.hidden_size, cfg.audio_hidden_size
        self.patchify_proj = nn.Linear(cfg.patch_in_channels, D)
        if not cfg.caption_proj_before_connector:
            self.caption_projection = CaptionProjection(cfg.caption_channels, D)
        if cfg.use_keyframes_abs_pos_embedding:
            self.keyframes_abs_pos_embedding = nn.Parameter(torch.empty(1, D))
        self.adaln_single = AdaLayerNormSingle(D, cfg.modulation_rows)
        if cfg.has_prompt_adaln:
            self.prompt_adaln_single = AdaLayerNormSingle(D, 2)
        self.scale_shift_table = nn.Parameter(torch.empty(2, D))
        self.proj_out = nn.Linear(D, cfg.out_channels * math.prod(cfg.patch_size))
        self.audio_patchify_proj = nn.Linear(cfg.audio_in_channels, Da)
        if not cfg.caption_proj_before_connector:
            self.audio_caption_projection = CaptionProjection(cfg.caption_channels, Da)
        self.audio_adaln_single = AdaLayerNormSingle(Da, cfg.modulation_rows)
        if cfg.has_prompt_adaln:
            self.audio_prompt_adaln_single = AdaLayerNormSingle(Da, 2)
        self.audio_scale_shift_table = nn.Parameter(torch.empty(2, Da))
        self.audio_proj_out = nn.Linear(Da, cfg.audio_out_channels)
        self.av_ca_video_scale_shift_adaln_single = AdaLayerNormSingle(D, 4)
        self.av_ca_audio_scale_shift_adaln_single = AdaLayerNormSingle(Da, 4)
        self.av_ca_a2v_gate_adaln_single = AdaLayerNormSingle(D, 1)
        self.av_ca_v2a_gate_adaln_single = AdaLayerNormSingle(Da, 1)
        self.transformer_blocks = nn.ModuleList(LTX2Block(cfg) for _ in range(cfg.num_layers))
        self.checkpointed_blocks: frozenset[int] = frozenset()  # set_checkpointed_blocks (BlockTraining)
        self.offload_checkpoints = False
        self.recompute_saved = True  # the blocks keep cheap elementwise results as recipes (`_set_block_recompute`)
        self.blocks_compiled = False  # compile_blocks
        self.seq_parallel = None  # set from outside (video_dit/parallel); see the class docstring
        self.compute_dtype: torch.dtype | None = None  # None: the bulk weights' dtype; set by cast_ltx2_dit
        self._rope_cache: dict = {}
        self.initialize_weights(init_seed)

    # -------------------------------------------------------------- set-up

    @torch.no_grad()
    def initialize_weights(self, seed: int | None = None) -> None:
        """`init_parameter` for every parameter, each from its own CPU generator seeded by (`seed`, name):
        the same values whatever order or device. `seed=None` draws it from torch's global RNG. Meta: no-op."""
        initialize_by_name(self, init_parameter, self.config, seed)

    @property
    def device(self) -> torch.device:
        return self.patchify_proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The bulk weights' storage dtype (the float32 islands aside; see `cast_ltx2_dit`)."""
        return self.patchify_proj.weight.dtype

    def cast(self, dtype: torch.dtype) -> "LTX2DiT":
        """`to(dtype)` (`IslandCast`): `cast_ltx2_dit`."""
        return cast_ltx2_dit(self, dtype)

    @property
    def blocks(self) -> nn.ModuleList:
        """The blocks that checkpointing, compilation and the memory plan count (`BlockTraining`)."""
        return self.transformer_blocks

    def set_attention_backend(self, backend: str) -> "LTX2DiT":
        """"native" (torch SDPA) or an optional kernel; the masked text attention always uses SDPA."""
        return set_attention_backend(self, backend)

    # -------------------------------------------------------------- forward

    def forward(self, video: torch.Tensor, video_timestep: torch.Tensor, video_context: torch.Tensor, *,
                audio: torch.Tensor, audio_timestep: torch.Tensor, audio_context: torch.Tensor,
                video_context_mask: torch.Tensor | None = None, audio_context_mask: torch.Tensor | None = None,
                fps: float = 24.0, video_sigma: torch.Tensor | None = None,
                keyframes_mask: torch.Tensor | None = None, video_stg_blocks: tuple[int, ...] = (),
                audio_stg_blocks: tuple[int, ...] = (), isolate_modalities: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Velocity prediction of both streams. The house's DiT call (`dit(x, timestep, context, ...)`) with
        the audio stream as keywords.

        video: (B, in_channels, F', h, w) video-VAE latents, F', h, w divisible by patch_size.
        video_timestep: (B,) or (B, L) per video token (L = F'/pt * h/ph * w/pw, row-major (F', h, w)), on
            0..1000 (1000 = pure noise); image-to-video gives the conditioning tokens 0.
        video_context, audio_context: (B, Lt, W) the text connectors' outputs; W = caption_channels when the
            model has caption projections (2.0), else hidden_size / audio_hidden_size.
        audio: (B, Ca, T, M) audio-VAE latents (channels, latent frames, mel bins), Ca * M = audio_in_channels.
        audio_timestep: (B,) on 0..1000.
        video_context_mask, audio_context_mask: (B, Lt) bool / 0-1 (True = a real token) or None (all real).
        fps: the video's frame rate (positions are seconds: frame / fps).
        video_sigma: (B,) on 0..1000, the video's noise level (read by the text k / v modulation and the
            audio's v2a gate); None: video_timestep itself, or with per-token timesteps their per-sample
            maximum, which is exact for first-frame conditioning (ltx-trainer's and the pipelines': every
            unconditioned token carries the sample's t, the conditioned ones 0).
        keyframes_mask: (B, L) bool / 0-1: tokens whose latent frame is one pixel frame (ltx-core marks
            the first latent frame); only for use_keyframes_abs_pos_embedding models; None: none marked.
        video_stg_blocks, audio_stg_blocks: blocks whose video / audio self-attention is skipped (its value
            projection passed through, gated and projected: the perturbed pass of spatio-temporal guidance,
            ltx-core `SKIP_VIDEO_SELF_ATTN` / `SKIP_AUDIO_SELF_ATTN`; indices past the last block skip nothing).
        isolate_modalities: no audio->video and video->audio attention in any block (the modality
            guidance's pass, ltx-core `SKIP_A2V_CROSS_ATTN` + `SKIP_V2A_CROSS_ATTN`).
        Returns (video velocity (B, out_channels, F', h, w), audio velocity (B, Ca, T, M)), float32 unless
        the model is cast whole to another dtype.
        """
        with self.precision(video.device.type):
            return self._forward(video, video_timestep, audio, audio_timestep, video_context, audio_context,
                                 video_context_mask, audio_context_mask, fps, video_sigma, keyframes_mask,
                                 (frozenset(video_stg_blocks), frozenset(audio_stg_blocks)), isolate_modalities)

    def _check(self, video, video_timestep, audio, audio_timestep, video_context, audio_context, masks,
               video_sigma, keyframes_mask) -> int:
        """The input contract (see `forward`); returns the number of video tokens L."""
        cfg = self.config
        B, C, Fr, H, W = video.shape
        pt, ph, pw = cfg.patch_size
        if C != cfg.in_channels or Fr % pt or H % ph or W % pw:
            raise ValueError(f"video has shape {tuple(video.shape)}; expected (B, {cfg.in_channels}, F', h, w) with "
                             f"F', h, w divisible by patch_size={cfg.patch_size}")
        L = (Fr // pt) * (H // ph) * (W // pw)
        if audio.dim() != 4 or audio.shape[0] != B or audio.shape[1] * audio.shape[3] != cfg.audio_in_channels:
            raise ValueError(f"audio has shape {tuple(audio.shape)}; expected ({B}, channels, frames, mel_bins) with "
                             f"channels * mel_bins = audio_in_channels={cfg.audio_in_channels}")
        if tuple(video_timestep.shape) not in ((B,), (B, L)):
            raise ValueError(f"video_timestep has shape {tuple(video_timestep.shape)}; expected ({B},) or ({B}, {L})")
        if tuple(audio_timestep.shape) != (B,):
            raise ValueError(f"audio_timestep has shape {tuple(audio_timestep.shape)}; expected ({B},)")
        if video_sigma is not None and tuple(video_sigma.shape) != (B,):
            raise ValueError(f"video_sigma has shape {tuple(video_sigma.shape)}; expected ({B},), the video's noise "
                             "level per sample (or None)")
        widths = (cfg.caption_channels,) * 2 if not cfg.caption_proj_before_connector \
            else (cfg.hidden_size, cfg.audio_hidden_size)
        for name, ctx, width, mask in (("video_context", video_context, widths[0], masks[0]),
                                       ("audio_context", audio_context, widths[1], masks[1])):
            if ctx.dim() != 3 or ctx.shape[0] != B or ctx.shape[2] != width:
                raise ValueError(f"{name} has shape {tuple(ctx.shape)}; expected ({B}, tokens, {width})")
            if mask is not None and tuple(mask.shape) != tuple(ctx.shape[:2]):
                raise ValueError(f"{name}_mask has shape {tuple(mask.shape)}; expected {tuple(ctx.shape[:2])}")
        if keyframes_mask is not None and (not cfg.use_keyframes_abs_pos_embedding
                                           or tuple(keyframes_mask.shape) != (B, L)):
            raise ValueError(f"keyframes_mask {tuple(keyframes_mask.shape)}: accepted only ({B}, {L}) and only by a "
                             "model with use_keyframes_abs_pos_embedding")
        return L

    def _ropes(self, grid: tuple[int, int, int], frames: int, fps: float, device):
        """(video, audio, video cross, audio cross) RoPE tables for a (F', h', w') video and `frames` audio latents."""
        key = (grid, frames, float(fps), str(device))
        if key not in self._rope_cache:
            cfg = self.config
            vpos, apos = video_positions(grid, cfg, fps, device), audio_positions(frames, cfg, device)
            cross_max = (max(cfg.positional_embedding_max_pos[0], cfg.audio_positional_embedding_max_pos[0]),)
            H, dim = cfg.num_attention_heads, cfg.audio_cross_attention_dim
            self._rope_cache[key] = (
                rope_tables(vpos, cfg.positional_embedding_max_pos, cfg.hidden_size, H, cfg),
                rope_tables(apos, cfg.audio_positional_embedding_max_pos, cfg.audio_hidden_size, H, cfg),
                rope_tables(vpos[:, :1], cross_max, dim, H, cfg),  # seconds only
                rope_tables(apos, cross_max, dim, H, cfg))
        return self._rope_cache[key]

    @staticmethod
    def _adaln(module: AdaLayerNormSingle, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """module on timesteps t (B,) or (B, L) -> (B, 1|L, k D), (B, 1|L, D). Run once per distinct value:
        per-token timesteps take a few values (0 and sigma), and the modulation Linear is k D x D."""
        values, index = torch.unique(t.flatten(), return_inverse=True)
        mod, emb = module(values)
        return mod[index].view(t.shape[0], -1, mod.shape[-1]), emb[index].view(t.shape[0], -1, emb.shape[-1])

    def _forward(self, video, video_timestep, audio, audio_timestep, video_context, audio_context,
                 video_context_mask, audio_context_mask, fps, video_sigma, keyframes_mask, stg_blocks, isolate):
        cfg = self.config
        L = self._check(video, video_timestep, audio, audio_timestep, video_context, audio_context,
                        (video_context_mask, audio_context_mask), video_sigma, keyframes_mask)
        B, _, Fr, H, W = video.shape
        _, Ca, T, M = audio.shape
        pt, ph, pw = cfg.patch_size
        grid = (Fr // pt, H // ph, W // pw)
        per_token = video_timestep.dim() == 2
        if video_sigma is None:  # per-token: the per-sample maximum, exact for first-frame conditioning (forward)
            video_sigma = video_timestep.amax(dim=1) if per_token else video_timestep
        unit = cfg.timestep_scale_multiplier / 1000  # the adaLN's timestep per unit of ours (0..1000)
        gate_unit = cfg.av_ca_timestep_scale_multiplier / 1000  # ltx-core: sigma (0..1) x av_ca multiplier

        patches = video.reshape(B, -1, grid[0], pt, grid[1], ph, grid[2], pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
        vx = self.patchify_proj(patches.reshape(B, L, -1).to(self.dtype))  # (B, L, D)
        cdt = compute_dtype_of(vx)  # the Linears' dtype: bf16 under a bf16 model's autocast
        vx = f32(vx)
        if keyframes_mask is not None:
            marked = (keyframes_mask > 0).to(vx.dtype).unsqueeze(-1)  # (B, L, 1), as ltx-core / diffusers
            vx = vx + marked * f32(self.keyframes_abs_pos_embedding)
        ax = f32(self.audio_patchify_proj(audio.transpose(1, 2).flatten(2).to(self.dtype)))  # (B, T, Da)

        v_temb, v_emb = self._adaln(self.adaln_single, video_timestep * unit)  # (B, 1|L, k D), (B, 1|L, D)
        a_temb, a_emb = self._adaln(self.audio_adaln_single, audio_timestep * unit)  # (B, 1, k Da), (B, 1, Da)
        v_ctx, a_ctx = video_context.to(cdt), audio_context.to(cdt)
        if not cfg.caption_proj_before_connector:
            v_ctx, a_ctx = self.caption_projection(v_ctx), self.audio_caption_projection(a_ctx)  # (B, Lt, D | Da)
        rope_v, rope_a, cross_v, cross_a = self._ropes(grid, T, fps, video.device)
        # a2v / v2a: scale and shift from the stream's own timesteps, the gate from the other stream's sigma
        # (ltx-core; see the module docstring); the text k / v modulation from the stream's sigma
        v = Stream(name="video", temb=v_temb, context=v_ctx, context_mask=_bool(video_context_mask), rope=rope_v,
                   cross_rope=cross_v,
                   cross_ss=self._adaln(self.av_ca_video_scale_shift_adaln_single, video_timestep * unit)[0],
                   cross_gate=self._adaln(self.av_ca_a2v_gate_adaln_single, audio_timestep * gate_unit)[0],
                   prompt_temb=self._adaln(self.prompt_adaln_single, video_sigma * unit)[0]
                   if cfg.has_prompt_adaln else None)
        a = Stream(name="audio", temb=a_temb, context=a_ctx, context_mask=_bool(audio_context_mask), rope=rope_a,
                   cross_rope=cross_a,
                   cross_ss=self._adaln(self.av_ca_audio_scale_shift_adaln_single, audio_timestep * unit)[0],
                   cross_gate=self._adaln(self.av_ca_v2a_gate_adaln_single, video_sigma * gate_unit)[0],
                   prompt_temb=self._adaln(self.audio_prompt_adaln_single, audio_timestep * unit)[0]
                   if cfg.has_prompt_adaln else None)

        sp = self.seq_parallel
        if sp is not None:  # each stream's tokens and per-token rows go to their rank; the text stays whole
            vx, ax = sp.split(vx, 1, "video"), sp.split(ax, 1, "audio")  # (B, L_local, D), (B, T_local, Da)
            v.rope, v.cross_rope = (tuple(sp.split(t, 1, "video") for t in r) for r in (v.rope, v.cross_rope))
            a.rope, a.cross_rope = (tuple(sp.split(t, 1, "audio") for t in r) for r in (a.rope, a.cross_rope))
            if per_token:
                v.temb, v.cross_ss, v_emb = (sp.split(t, 1, "video") for t in (v.temb, v.cross_ss, v_emb))

        for i, block in enumerate(self.transformer_blocks):
            skip = (i in stg_blocks[0], i in stg_blocks[1])  # (video, audio) self-attention passed through
            vx, ax = self.run_block(i, block, vx, ax, v, a, cdt, sp, skip, not isolate)  # (B, L_l, D), (B, T_l, Da)

        out_v = self._output(self.scale_shift_table, self.proj_out, vx, v_emb)  # (B, L_local, C_out * pt ph pw)
        out_a = self._output(self.audio_scale_shift_table, self.audio_proj_out, ax, a_emb)  # (B, T_local, Ca * M)
        if sp is not None:
            out_v, out_a = sp.gather(out_v, 1, "video"), sp.gather(out_a, 1, "audio")
        out_v = out_v.view(B, *grid, cfg.out_channels, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)  # unpatchify
        out_v = out_v.reshape(B, cfg.out_channels, Fr, H, W)  # (B, C_out, F', h, w)
        return out_v, out_a.unflatten(2, (Ca, M)).transpose(1, 2)  # (B, Ca, T, M)

    def _set_block_recompute(self) -> None:
        """`BlockTraining`'s hook: a block keeps recipes (`LTX2Block.recompute`) unless it is checkpointed
        (it keeps nothing inside) or compiled (Inductor chooses what to keep), or `recompute_saved` is off."""
        for i, block in enumerate(self.transformer_blocks):
            block.recompute = self.recompute_saved and i not in self.checkpointed_blocks and not self.blocks_compiled

    def _output(self, table: torch.Tensor, proj: nn.Linear, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """ltx-core `_process_output`: LayerNorm(x) * (1 + scale) + shift, (shift, scale) = table + emb, then
        the output Linear; float32 region (the Linear in its float32 weights). With `recompute_saved`, the
        normed and modulated x are recipes of x (`RecomputeSaved`)."""
        rc = RecomputeSaved()
        with torch.autocast(x.device.type, enabled=False), \
                rc.hooks() if self.recompute_saved and torch.is_grad_enabled() else nullcontext():
            shift, scale = (f32(table)[None, None] + emb[:, :, None]).unbind(2)  # (B, 1|L, D) each
            x, eps = f32(x), self.config.norm_eps
            normed = rc.add(_layer_norm(x, eps), _layer_norm, x, eps)
            h = rc.add(_modulated(normed, shift, scale, proj.weight.dtype), _head_input, x, eps, shift, scale,
                       proj.weight.dtype)
            return proj(h)


def _layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=eps)


def _modulated(normed: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.addcmul(shift, normed, 1 + scale).to(dtype)


def _head_input(x: torch.Tensor, eps: float, shift: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """LayerNorm(x) * (1 + scale) + shift in `dtype`: the output Linear's input (`_output`'s recipe)."""
    return _modulated(_layer_norm(x, eps), shift, scale, dtype)


def _bool(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else mask.bool()


# ---------------------------------------------------------------- precision: the float32 islands

# Sub-modules kept whole in float32 in a bf16 model (see the module docstring): every adaLN-single and the
# output Linears. Small, once per step.
FLOAT32_MODULES = ("adaln_single", "audio_adaln_single", "prompt_adaln_single", "audio_prompt_adaln_single",
                   "av_ca_video_scale_shift_adaln_single", "av_ca_audio_scale_shift_adaln_single",
                   "av_ca_a2v_gate_adaln_single", "av_ca_v2a_gate_adaln_single", "proj_out", "audio_proj_out")
# ... every modulation table and the keyframe embedding (parameters of their own), and the q / k norm scales.
_FLOAT32_PARAMS = re.compile(r"(.*\.)?((audio_)?(prompt_)?scale_shift_table(_a2v_ca_(audio|video))?)"
                             r"|keyframes_abs_pos_embedding")


def float32_param_names(model: nn.Module) -> set[str]:
    """Names of the parameters an LTX-2 DiT stores in float32 whatever dtype it computes in."""
    names = {n for n, _ in model.named_parameters() if _FLOAT32_PARAMS.fullmatch(n)}
    for module_name, module in model.named_modules():
        whole = any(module_name == m or module_name.startswith(m + ".") for m in FLOAT32_MODULES)
        if whole or isinstance(module, RMSNorm):
            names.update(f"{module_name}.{n}" for n, _ in module.named_parameters(recurse=False))
    return names


def param_dtypes(model: nn.Module, dtype: torch.dtype, masters: bool = False) -> dict[str, torch.dtype]:
    """The storage dtype of each floating parameter of a model that computes in `dtype`: float32 for the
    float32 islands and, with `masters`, for every parameter that requires grad; `dtype` for the rest."""
    return storage_dtypes(model, dtype, float32_param_names(model) if dtype != torch.float32 else set(), masters)


def cast_ltx2_dit(model: nn.Module, dtype: torch.dtype, masters: bool = False) -> nn.Module:
    """Cast in place: each parameter to `param_dtypes(model, dtype, masters)` and `model.compute_dtype =
    dtype`, so the forward runs the bulk under `dtype` autocast and the islands in float32."""
    return cast_to_storage(model, param_dtypes(model, dtype, masters), dtype)


# ---------------------------------------------------------------- LoRA targets and FLOPs

# The attention Linears of all six attentions and both FFNs of every block (peft `target_modules`, a
# full-match regex): ltx-trainer's default targets (to_q / to_k / to_v / to_out.0) plus the FFNs.
LORA_TARGETS = (r"transformer_blocks\.\d+\.(attn1|attn2|audio_attn1|audio_attn2|audio_to_video_attn"
                r"|video_to_audio_attn)\.(to_q|to_k|to_v|to_out\.0)"
                r"|transformer_blocks\.\d+\.(ff|audio_ff)\.net\.(0\.proj|2)")

# Each stream's modules (`AudioPath.lora_streams`, `network.streams`): every module whose output is added to that
# stream's tokens. The cross-modal attentions go with the stream they write: audio_to_video_attn (queries from the
# video, keys / values from the audio, `vx = vx + audio_to_video_attn(...) * gate`: ltx-core transformer.py
# `BasicAVTransformerBlock`; layers.py here) is the video's, video_to_audio_attn the audio's. So an audio LoRA can
# learn how the sound reads the picture, and its adapters write into the audio tokens only: the video reads them
# through audio_to_video_attn alone, which it leaves as it is (tests/test_lora_streams.py). (ltx-trainer's docs list
# the two as a third group that its audio-only configs, which train no video at all, leave out:
# docs/configuration-reference.md, its section on target modules.)
LORA_STREAMS = {
    "video": r"transformer_blocks\.\d+\.(attn1|attn2|audio_to_video_attn|ff)\..+",
    "audio": r"transformer_blocks\.\d+\.(audio_attn1|audio_attn2|video_to_audio_attn|audio_ff)\..+",
}


def ltx2_dit_flops(config: LTX2DiTConfig, video_tokens: int, audio_tokens: int, text_len: int, batch: int = 1) -> float:
    """Analytic forward FLOPs (2 per multiply-add) of the matmuls and attention; backward is ~2x this.
    L, La: video / audio tokens; Lt: text tokens (each stream's connector gives Lt); D, Da: widths.
      per block: video 8 L D^2 + 4 L^2 D (self) + 4 (L + Lt) D^2 + 4 L Lt D (text) + 16 L D^2 (FFN),
                 audio the same with (La, Da); a2v + v2a 8 L D Da + 8 La Da^2 + 8 L La Da;
                 gate logits (gated models) 6 (L D + La Da) H
      once: patch embeddings, output Linears, caption projections (2.0), and the adaLN-singles on one
      timestep per sample (per-token timesteps take a few distinct values, each embedded once)."""
    D, Da, H = config.hidden_size, config.audio_hidden_size, config.num_attention_heads
    L, La, Lt = video_tokens, audio_tokens, text_len
    video = 8 * L * D * D + 4 * L * L * D + 4 * (L + Lt) * D * D + 4 * L * Lt * D + 16 * L * D * D
    audio = 8 * La * Da * Da + 4 * La * La * Da + 4 * (La + Lt) * Da * Da + 4 * La * Lt * Da + 16 * La * Da * Da
    cross = 8 * L * D * Da + 8 * La * Da * Da + 8 * L * La * Da
    gates = 6 * (L * D + La * Da) * H if config.apply_gated_attention else 0
    # per stream: the adaLN-singles (block rows, a2v / v2a scale-shift, gate, prompt), each its own timestep MLP
    singles, rows = 3 + config.has_prompt_adaln, config.modulation_rows + 4 + 1 + 2 * config.has_prompt_adaln
    embed = (2 * L * config.patch_in_channels * D + 2 * La * config.audio_in_channels * Da
             + 2 * L * D * config.out_channels * math.prod(config.patch_size) + 2 * La * Da * config.audio_out_channels
             + (0 if config.caption_proj_before_connector
                else 2 * Lt * (config.caption_channels * D + D * D + config.caption_channels * Da + Da * Da))
             + 2 * (singles * (256 * D + D * D) + rows * D * D) + 2 * (singles * (256 * Da + Da * Da) + rows * Da * Da))
    return float(batch * (config.num_layers * (video + audio + cross + gates) + embed))
