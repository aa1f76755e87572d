"""Activation memory of the MiniMax H3 DiT in one training step, per rank: a first model, an UPPER BOUND, not yet
checked to the byte against an allocation tracker (HunyuanVideo's `memory.py` is; a later step makes this one
exact). Parameters and DeepSpeed's state are the plan's own terms.

The bound: every tensor a block's forward creates is counted as kept (what autograd saves is a subset of them).
Notation as `plan.py`'s: s bytes of the compute dtype, a = max(s, 4) (the float32 islands: the residual stream,
norms, AdaLN arithmetic, RoPE), w the compute-dtype copy of a float32 trainable weight (s in bf16, 0 in float32);
B micro-batch. The packed sequence has N = Lt + K h'w' + S T + F' h'w' rows (text, keyframes, audio, video:
packing.py), N_r = ceil(N / sp) per rank under sequence parallelism (every rank holds rows of every modality),
D hidden, I = heads x head_dim (wider than D), R the rotated channels, Fd the SwiGLU width, H heads.
Per row per block, counted op by op in `layers.py` `Block`:
  AdaLN in  norm1 a, modulate per run (addcmul + cat) 2a, cast s                                     D (3a + s)
  attention qkv 3s, q / k RMSNorm 2a, RoPE (the rotated halves, cat, products, cat) 2a + 6R/I a,
            cast of q, k 2s, attention output s (+ 4 H bytes of logsumexp), out_proj D s             I (4a + 6s)
  residual  gated per run 2a; norm2 a, modulate 2a, cast s                                           D (7a + 2s)
  MLP       fc1 2 Fd s, SiLU Fd s, product Fd s, fc2 D s, gated residual 2a                     4 Fd s + D (2a + s)
  -> per row: D (12a + 4s) + I (4a + 6s) + 6 R a + 4 Fd s + 4 H; per sample and block the AdaLN table
     (G timestep groups x 18 D, and its 4 entries x 6 D) in a.
A checkpointed block keeps its input (N_r D a) and re-runs once in backward. Outside the blocks: the projections'
inputs and outputs (video / keyframe rows patch_dim s -> D a, audio rows C_a s -> D a, text rows text_dim s -> D),
the packed rows (N D a, this rank's N_r after the split), the RoPE tables (2 N_r R a), the final layer (norm,
modulate, both heads: N_r (3 D + patch_dim + C_a) a, the gathered output N (patch_dim + C_a) a), the loss's
difference (the video and audio predictions, a). The text refiner runs before the split on the Lt text rows of
every rank: in a full fine-tune its blocks' tensors, Lt (D (4a + 4s) + I (2a + 6s) + 4 Fd s) each, are kept; a
LoRA job leaves them frozen and their inputs need no gradient, so autograd keeps none. Weight copies: a full
fine-tune's every block Linear once per forward (w each: q k v, out, fc1, fc2 and the AdaLN projection, Te x 18 D
= 96768 x 2688 released: the largest); LoRA r (in + out) w per adapter. The peak adds one block's creations twice
to what is saved (its gradients, and under checkpointing its recomputed forward).
"""

from __future__ import annotations

import math

from video_dit.families.minimax_h3.dit_config import MODALITIES
from video_dit.models.activation_terms import Activations, Setting, checkpointed_count, float32_bytes, weight_copy_bytes

# The caption length the plan assumes: MiniMax's prompts are paragraphs (its Context-IR prompts, hundreds to a
# few thousand tokens); ai-toolkit's H3 trainer caps a caption at 512 tokens (`max_text_length`), the figure here.
PLAN_TEXT_TOKENS = 512


def block_row_bytes(cfg, a: int, s: int) -> int:
    """Bytes one block's forward creates per packed row (module docstring)."""
    D, I, Fd, H = cfg.hidden_size, cfg.inner_dim, cfg.ffn_dim, cfg.num_heads
    return D * (12 * a + 4 * s) + I * (4 * a + 6 * s) + 6 * cfg.rotary_dim * a + 4 * Fd * s + 4 * H


def h3_rows(cfg, grid: tuple[int, int, int], text_len: int, audio_frames: int, keyframes: int = 0) -> dict[str, int]:
    """The packed sequence's rows of a clip of latent grid (F', h, w): text, keyframe, audio, video, all."""
    pt, ph, pw = cfg.patch_size
    frame = (grid[1] // ph) * (grid[2] // pw)
    rows = {"text": text_len, "keyframe": keyframes * frame, "audio": cfg.audio_channels * audio_frames,
            "video": (grid[0] // pt) * frame}
    rows["all"] = sum(rows.values())
    return rows


def h3_activation_bytes(cfg, grid: tuple[int, int, int], setting: Setting, *, lora_rank: int | None, s: int,
                        text_len: int, audio_frames: int, keyframes: int = 0) -> Activations:
    """The upper bound of one forward + backward of the H3 DiT `cfg` on one rank for video latents of `grid`
    (F', h, w) with `audio_frames` audio latents per channel, `text_len` text rows and `keyframes` keyframe
    latent frames (see the module docstring for every term)."""
    rows = h3_rows(cfg, grid, text_len, audio_frames, keyframes)
    N, B = rows["all"], setting.micro_batch
    Nr = math.ceil(N / setting.sp)
    D, I, Fd, Te = cfg.hidden_size, cfg.inner_dim, cfg.ffn_dim, cfg.time_embed_dim
    a, w = float32_bytes(s), weight_copy_bytes(s)
    G = 3 if keyframes else 2
    block = Nr * block_row_bytes(cfg, a, s) + (G * 3 * MODALITIES * 2 * D + 4 * 6 * D) * a
    if setting.sp > 1:  # the all-to-all's exchanged q, k, v and output (all rows, this rank's heads)
        block += 4 * s * N * I // setting.sp
    layers = cfg.num_layers
    n_ckpt = checkpointed_count(setting, layers)
    C, Ca = cfg.patch_dim, cfg.audio_in_channels
    media = rows["keyframe"] + rows["video"]
    outside = (media * (C * s + D * a) + rows["audio"] * (Ca * s + D * a) + text_len * (cfg.text_dim * s + D * s)
               + Nr * D * a + 2 * Nr * cfg.rotary_dim * a + Nr * (3 * D + C + Ca) * a + N * (C + Ca) * a
               + (rows["video"] * C + rows["audio"] * Ca) * a)
    refiner = 0
    if not lora_rank:  # a full fine-tune keeps the text refiner's tensors (LoRA: frozen, no gradient reaches it)
        refiner = cfg.num_refiner_layers * text_len * (D * (4 * a + 4 * s) + I * (2 * a + 6 * s) + 4 * Fd * s)
    kept = n_ckpt * Nr * D * a
    per_block_weights = 3 * I * D + I * D + 3 * D * Fd + Te * 6 * MODALITIES * D
    if lora_rank:
        r = lora_rank
        per_block_weights = r * ((D + 3 * I) + (I + D) + (D + 2 * Fd) + (Fd + D))
    weights = (layers - n_ckpt) * per_block_weights * w
    saved = (layers - n_ckpt) * block + kept + outside + refiner
    peak = saved + 2 * block
    parts = {"per_block": block, "outside": outside, "refiner": refiner, "weights": weights,
             "checkpointed_blocks": n_ckpt, "rows": rows, "rows_per_rank": Nr, "upper_bound": True}
    return Activations(saved=saved * B + weights, peak=peak * B + weights + per_block_weights * w, parts=parts)
