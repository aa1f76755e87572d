"""Activation memory of the stand-in DiT in one training step, per rank: what `dit.py` makes autograd keep,
op by op (the plan's other terms, parameters and DeepSpeed's state, are the family-blind ones of
`video_dit.train.plan`).

Notation: per sample; T = ceil(L / N) video tokens on each of the N ranks of a sequence group, Lt the
padded text, D width, F = mlp_ratio D, H heads, r LoRA rank, Cp = C pt ph pw the patch channels;
s bytes of the compute dtype, a = max(s, 4) of the float32 islands (the residual stream, the LayerNorms),
w the compute-dtype copy autocast makes of a float32 weight (s in bf16, 0 in float32).

One block keeps, for T tokens (`block`):
  full fine-tune  T (5 D a + 13 D s + 2 F s + 24 + 16 H) + 2 Lt D s + D (s + 8 a)
      a: the three LayerNorms' inputs (x, x1, x2) and the two modulated norms' normed x (kept by addcmul
      for the scale's gradient); s: the modulated inputs of qkv and fc1, the qkv output (q, k read by
      their RMSNorms, v by the attention), the normed q and k, each attention's output (which the
      projection reads as it is: SDPA's fused kernels return it in (B, L, H, Dh) memory order, so the
      flatten is a view), the gated outputs of proj and fc2, the cross-attention's normed input and its
      q; 2 F s: fc1's output (GELU's input) and GELU's output (fc2's input); 24 + 16 H: the LayerNorms'
      mean and rstd, the q / k rstd per head, the attentions' logsumexp; 2 Lt D s: the text's k / v;
      per sample SiLU(temb) D s, the modulation's six vectors 6 D a (the gates are views of it) and the
      two (1 + scale) D a
  LoRA            T (3 D a + 11 D s + 2 F s + 24 + 16 H + 6 r s) + Lt (2 D + r) s + 8 D a
      no normed copies (the scales need no gradient), no gated outputs, no SiLU(temb); each adapter's
      lora_A keeps its input (what the base Linear would have kept) and lora_B lora_A's output. The first
      block's input needs no gradient (the embedders are frozen): less T (D a + 8) + D a (its first
      LayerNorm and its (1 + scale) keep nothing)
  sequence parallel (N > 1): the self-attention runs through the seam's recomputed exchange, which keeps
      this rank's q, k, v (counted above) and an output of its own, no logsumexp: less 4 T H. (Derived,
      not traced: the test checks N = 1.)
  weight copies (bf16, once per forward): full (14 D^2 + 2 D F) w; LoRA the adapters r (15 D + 2 F) w
      but the lora_A weights whose input needs no gradient: cross_kv's (the text), the first block's qkv's
Outside the blocks: the patch embedding's input L Cp s (full; all tokens: the split comes after it); the
time MLP (float32): full (freq + 3 D) 4; the text embedding's input Lt text_dim s (full) and output
Lt D s (every block's cross_kv reads it); the head: its LayerNorm's input and stats T (D a + 8) and
(1 + scale) D 4, full + T D a (normed) + T D 4 (proj's input) + D 4 (SiLU(temb)); the loss's
(prediction - target) L Cp a.
Block checkpointing keeps each checkpointed block's input T D a (and, under LoRA, temb D 4: nothing else
keeps it) and re-runs one block at a time in backward.

The peak (traced; 0.95-1.13 of the tracker's in tests/test_family_contract.py) is the highest of:
  the head's backward          saved + T D a (the stream's gradient) + T Cp a (the prediction's)
  the last plain block's MLP   saved - the head - the loss + 2 T F s + T D a (two T F gradients around GELU, the
                               stream's gradient) + full: fc2's weight gradient D F (s, + 4 in bf16)
  a checkpointed last block    the kept inputs + outside - the head - the loss + the re-run block + the same
                               MLP terms
"""

from __future__ import annotations

from video_dit.models.activation_terms import Activations, Setting, checkpointed_count, float32_bytes, weight_copy_bytes


def activation_bytes(cfg, grid: tuple[int, int, int], setting: Setting, *, lora_rank: int | None,
                     s: int) -> Activations:
    """Activation memory of one forward + backward of the stand-in DiT `cfg` on one rank for latents of
    `grid` (F', h, w); see the module docstring for every term."""
    pt, ph, pw = cfg.patch_size
    L = (grid[0] // pt) * (grid[1] // ph) * (grid[2] // pw)
    N, B = setting.sp, setting.micro_batch
    T = -(-L // N)
    D, H, F, Lt, r = cfg.hidden, cfg.heads, cfg.ffn, cfg.text_len, lora_rank or 0
    Cp = cfg.patch_channels
    a, w = float32_bytes(s), weight_copy_bytes(s)
    full = not lora_rank
    layers = cfg.depth
    n_ckpt = checkpointed_count(setting, layers)

    def block(first: bool) -> int:
        if full:
            per_token = 5 * D * a + 13 * D * s + 2 * F * s + 24 + 16 * H
            out = T * per_token + 2 * Lt * D * s + D * (s + 8 * a)
        else:
            per_token = 3 * D * a + 11 * D * s + 2 * F * s + 24 + 16 * H + 6 * r * s
            out = T * per_token + Lt * (2 * D + r) * s + 8 * D * a
            if first:
                out -= T * (D * a + 8) + D * a
        if N > 1:
            out -= T * 4 * H
        return out

    def block_weights(first: bool) -> int:
        """The compute-dtype copies of the block's float32 weights that its matmuls keep (bf16 only)."""
        if full:
            return (14 * D * D + 2 * D * F) * w
        # lora_A (r x in) and lora_B (out x r) of qkv, proj, cross_q, cross_kv, cross_out, fc1, fc2, but the
        # lora_A of an input that needs no gradient: cross_kv's (the text), and in the first block qkv's
        return r * ((6 * D + F) + (9 * D + F) - D - (D if first else 0)) * w

    head = T * (D * a + 8) + D * 4 + ((T * D * a + T * D * 4 + D * 4) if full else 0)
    loss = L * Cp * a
    embed = Lt * D * s
    if full:
        # (the patch embedding runs on every token: the split comes after it)
        embed += L * Cp * s + (cfg.freq_dim + 3 * D) * 4 + Lt * cfg.text_dim * s
    outside = head + loss + embed

    kept = (n_ckpt * T * D * a + (0 if full else D * 4)) if n_ckpt else 0
    plain = range(n_ckpt, layers)
    saved = sum(block(i == 0) for i in plain) + kept + outside
    weights = sum(block_weights(i == 0) for i in plain)
    grad_bytes = s + (4 if s < 4 else 0)
    mlp_backward = 2 * T * F * s + T * D * a
    fc2_grad = D * F * grad_bytes if full else 0
    peaks = [(saved + T * D * a + L * Cp * a) * B + weights]
    if len(plain):
        peaks.append((saved - head - loss + mlp_backward) * B + weights + fc2_grad)
    if n_ckpt:
        rerun = block(n_ckpt == 1)  # the last checkpointed block, re-run in backward
        peaks.append((kept + outside - head - loss + rerun + mlp_backward) * B + block_weights(n_ckpt == 1) + fc2_grad)
    parts = {"per_block": block(False), "outside": outside, "weights": weights, "checkpointed_blocks": n_ckpt}
    return Activations(saved=saved * B + weights, peak=max(peaks), parts=parts)
