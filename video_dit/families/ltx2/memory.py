"""Activation memory of the LTX-2 DiT in one training step, per rank: a first model, an UPPER BOUND, not yet
checked to the byte against an allocation tracker (HunyuanVideo's `memory.py` is; another step makes this one
exact). Parameters and DeepSpeed's state are the plan's own terms.

The bound: every tensor a block's forward creates is counted as kept (what autograd saves is a subset of
them, the block's input and the weight copies: nothing else exists to save). Notation as `plan.py`'s: s bytes
of the compute dtype, a = max(s, 4) (the float32 islands: residual streams, norms, modulation, RoPE, gates), w
the compute-dtype copy of a float32 trainable weight (s in bf16, 0 in float32); B micro-batch; per rank under
sequence parallelism N: Lv = ceil(L / N) video and La = ceil(Ta / N) audio tokens; Lt text tokens (the
connectors' length, every row context), D / Da the stream widths, Dx = Da the a2v / v2a inner width, H heads.
Per block, counted op by op in `layers.py` (per token of a stream of width W):
  self-attention   rms_modulate 2a + s; q, k, v 3s; q / k RMSNorm (float32 copy and output) 4a; RoPE
                   (split halves, products, cat) 6a; cast 2s; attention output s (+ 4 H bytes of logsumexp);
                   gates a + s (+ 3 H a); to_out s; gated residual 2a                   -> 15a + 9s
  text attention   as above with q alone from the stream (7a + 6s) and k, v, the modulated text and its norm
                   on the Lt text tokens (4a + 4s per text token, W wide)
  audio <-> video  per stream its two rms_modulates (4a + 2s), its query's Linear and gated residual (s + 2a)
                   at W, and at the cross width Dx: q, k, v, their norms, RoPE, casts, output, gates (11a + 7s)
  FFN              rms_modulate 2a + s, 4W up 4s, GELU 4s, down s, gated residual 2a      -> 4a + 10s
  (per-token timesteps, image-to-video: the modulation rows per token, (6 + 3 + 5) W a more per token, and
  once outside the blocks the per-token adaLN outputs, (rows + 4 + 1) D a per video token)
A checkpointed block keeps its two inputs (Lv D a + La Da a) and re-runs once in backward. Outside the blocks:
the patch embeddings' inputs and outputs, the output layers (LayerNorm, modulate, Linear: 4 W a + C s per
token), the loss's difference (L C a, the whole prediction on every rank). Weight copies: full fine-tuning
every block's Linears once per forward (w each); LoRA r (in + out) w per adapter. The peak adds one block's
creations twice to what is saved (its gradients, and under checkpointing its recomputed forward).
"""

from __future__ import annotations

import math

from video_dit.models.activation_terms import Activations, Setting, checkpointed_count, float32_bytes, weight_copy_bytes


def stream_bytes(T: int, W: int, Dx: int, H: int, Lt: int, a: int, s: int, per_token: bool) -> int:
    """One stream's tensors in one block (module docstring): T tokens of width W, Dx the a2v / v2a width."""
    per = T * W * ((15 * a + 9 * s) + (7 * a + 6 * s) + (6 * a + 3 * s) + (4 * a + 10 * s))
    per += T * Dx * (11 * a + 7 * s) + Lt * W * (4 * a + 4 * s)
    per += T * H * (3 * 4 + 3 * 3 * a)  # three attentions' logsumexp, their gates
    if per_token:
        per += T * W * 14 * a
    return per


def ltx2_activation_bytes(cfg, grid: tuple[int, int, int], setting: Setting, *, lora_rank: int | None, s: int,
                          text_len: int, audio_tokens: int, per_token: bool = False) -> Activations:
    """The upper bound of one forward + backward of the LTX-2 DiT `cfg` on one rank for video latents of
    `grid` (F', h, w) with `audio_tokens` audio latent frames and `text_len` text tokens (see the module
    docstring for every term)."""
    pt, ph, pw = cfg.patch_size
    L = (grid[0] // pt) * (grid[1] // ph) * (grid[2] // pw)
    N, B = setting.sp, setting.micro_batch
    Lv, La = math.ceil(L / N), math.ceil(audio_tokens / N)
    D, Da, H, Lt = cfg.hidden_size, cfg.audio_hidden_size, cfg.num_heads, text_len
    a, w = float32_bytes(s), weight_copy_bytes(s)
    C = cfg.out_channels * pt * ph * pw
    block = stream_bytes(Lv, D, Da, H, Lt, a, s, per_token) + stream_bytes(La, Da, Da, H, Lt, a, s, False)
    if N > 1:  # the exchanged q, k, v and outputs of the six attentions (all tokens, this rank's heads)
        block += 4 * s * ((L * D + audio_tokens * Da) * 2 + (L + audio_tokens) * Da) // N
    layers = cfg.num_layers
    n_ckpt = checkpointed_count(setting, layers)
    kept = n_ckpt * (Lv * D + La * Da) * a
    outside = (Lv * (cfg.patch_in_channels * s + D * a + 4 * D * a + C * s) + L * C * a
               + La * (cfg.audio_in_channels * s + Da * a + 4 * Da * a + cfg.audio_out_channels * s))
    if per_token:  # the per-token adaLN outputs, made once: block rows, a2v / v2a scale-shift, the output's
        outside += L * (cfg.modulation_rows + 4 + 1) * D * a
    # the Linears of one block: video / audio self and text attention 4 W^2 each (+ the text's k, v of width W),
    # the two cross attentions (D + Da) Da x 2 each way, the FFNs 8 W^2
    per_block_weights = 16 * D * D + 16 * Da * Da + 4 * (D + Da) * Da
    if lora_rank:
        r = lora_rank
        per_block_weights = r * (2 * 4 * (D + D) + 2 * 4 * (Da + Da) + 2 * 4 * (D + Da) + 2 * (5 * D + 5 * Da))
    weights = (layers - n_ckpt) * per_block_weights * w
    saved = (layers - n_ckpt) * block + kept + outside
    peak = saved + 2 * block
    parts = {"per_block": block, "outside": outside, "weights": weights, "checkpointed_blocks": n_ckpt,
             "video_tokens": L, "audio_tokens": audio_tokens, "text_tokens": Lt, "upper_bound": True}
    return Activations(saved=saved * B + weights, peak=peak * B + weights + per_block_weights * w, parts=parts)


def audio_tokens_of(grid: tuple[int, int, int], fps: float, temporal: int = 8, per_second: float = 25.0) -> int:
    """Audio latent frames of a clip of `grid[0]` latent frames: (F' - 1) x 8 + 1 pixel frames at `fps`, 25
    audio latents a second (16 kHz, hop 160, 4x: the release's), rounded as the references round."""
    frames = (grid[0] - 1) * temporal + 1
    return max(1, round(frames / fps * per_second))
