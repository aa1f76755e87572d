"""Activation memory of the Wan DiT in one training step, per rank: what `families/wan/dit.py` and
`layers.py` make autograd keep, op by op (the plan's other terms, parameters and DeepSpeed's state, are
the family-blind ones of `train/plan.py`). `WAN_MEMORY` is what the plan asks (`Family.memory`).

Notation: s = bytes per element of the compute dtype (2 in bf16, 4 in fp32); a = bytes of the float32
islands, max(s, 4): the residual stream, the LayerNorms' float32 copies, the head (a bf16 DiT keeps
them float32, `models.layers.gated_add` / `norm_to`, `Head`); w = bytes of the compute-dtype copy autocast
makes of a float32 trainable weight at each call (`VideoDiT.precision`: `cache_enabled=False`) and its
matmul keeps for the input's gradient: s in a bf16 job (trainable parameters are float32 masters), 0 in
fp32; statistics are fp32 (4 bytes); B micro-batch; L tokens of one sample (F' * h/2 * w/2) and Ll =
ceil(L / N) on each of the N ranks of a sequence group; Lt = text_len (contexts are zero-padded to it);
D width, F ffn width, H heads, C = out_dim * 4 (the head's output channels), r LoRA rank, T = Ll with
per-token timesteps (Wan 2.2 TI2V), else 1. "Fused": the DiT's fused kernels (`video_dit.kernels`,
CUDA with triton: `predict(cuda=True)` assumes them), else the torch path.

Saved by one block (RecomputeSaved on, the block not checkpointed), per sample:
  video side, Ll * (
      4 D s      self-attention: q and k (kept by the q/k RMSNorms; the normed, rotated q/k that the
                 attention kernel would keep are recipes recomputed from them), v, the attention output
                 (kept by `o`)
    + 1 D s      y, the self-attention output: an input of the recipe of x1 = gated_add(x, y, gate)
    + 2 D s      cross-attention: q (kept by its RMSNorm) and the attention output (kept by `o`)
    + 1 D s      (full fine-tune only) the FFN output, kept by addcmul for the gate's gradient
    + 3 D a      the residual stream, float32: x1 = gated_add(x, y, gate1) (referenced by the recipe of
                 norm3's output), x2 = x1 + cross-attention (kept by the second LayerNorm), the block
                 output (kept by the next block's, or the head's, LayerNorm)
    + 1 F s      the FFN hidden before GELU (GELU keeps its input; GELU's output is a recipe)
    + (9 + 2H) * 4   fp32 statistics: 3 LayerNorms x (mean, rstd), 3 RMSNorm rstd, 2 H logsumexp
                 rows of the attention kernel (the self-attention's H is not kept under sequence
                 parallelism: its exchange is recomputed in backward)
    + 8 r s      LoRA: each of the 8 adapted Linears on video tokens keeps lora_A's output)
  text side, Lt * (3 D s + 4 + 2 r s): cross-attention k (kept by its RMSNorm), normed k and v (kept
      by the attention kernel), k's rstd, LoRA on k and v
  modulation, T * D * 24: the six fp32 adaLN vectors (B, T, 6, D); the torch path adds the two fp32
      (1 + scale) factors its addcmul keeps (T * D * 8); the fused op keeps `scale` itself, a view
  weight copies, once per forward (not per sample), w * (full: 8 D^2 + 2 D F, + 2 D^2 for k_img /
      v_img; LoRA: r (16 D + 2 F), each adapter's lora_B and the lora_A of those whose input needs a
      gradient: not the text side's k / v, nor in the first block q / k / v, whose patch tokens need
      none; + 2 D r for k_img / v_img, + 2 D r more with include_img_emb)
  image branch (Wan 2.1 I2V / FLF2V, Li = 257 or 514 CLIP tokens): the image side Li * (3 D s + 4 +
      2 r s) as the text side (k_img, v_img); on the video side Ll * (2 D s + H * 4): the text and
      image attention outputs, which the kernels keep apart from their sum (kept by `o`), and the
      image attention's logsumexp
Checked exactly against `CPUAllocationTracker`, in fp32 and in bf16 through both kernel paths
(`tests/test_plan.py`; CPU autocast casts the same ops to bf16 as CUDA's for the ops the DiT runs under
it: linear, conv3d, SDPA), and on the real 1.3B made of fake tensors (`video-dit bench --suite plan
--fake`, within 0.1%).

Outside the blocks: the first block's input Ll D s (the patch tokens, in the compute dtype), and in
the torch path of a bf16 job the float32 copy of it that its first LayerNorm reads (Ll D a), which
RecomputeSaved's recipe keeps; the time MLP (full fine-tune: its sinusoid input freq_dim * 4 and four D a
per timestep: it runs in float32); the text MLP's saved tensors (full fine-tune: its padded input Lt
text_dim s and two Lt D s; always the context Lt D s); the head (float32: its stats and, torch path, the
(1 + scale) T D 4 or, fused, the (B, T, 2, D) table T D 8; full fine-tune: its normed and modulated inputs,
2 Ll D a, fused only the modulated one); the loss's (prediction - target), Ll C a (+ L C a gathered
under sequence parallelism); per-token timesteps add L * 7 D * 4 (e, e0); a full fine-tune's bf16
copies of the patch embedding's input (L * in_dim * pt*ph*pw * w) and, once, of text_embedding.2's and
the patch conv's weights; the image MLP `img_emb` (c = image_dim) its output Li D s and, when it trains
(full fine-tune: Li * (3 c s + D a + 16), + Li c a FLF2V's clip_fea + emb_pos, + its weight copies; LoRA
with include_img_emb: Li * (3 c s + D a + 8 + 2 r s)) its Linears' and GELU's inputs and its LayerNorms'
(`image_embedding_bytes`).

Block checkpointing (`train.gradient_checkpointing`: every block, or the first n,
`VideoDiT.set_checkpointed_blocks`) keeps only a checkpointed block's input: the previous block's
output, float32 (Ll D a; the first block's patch tokens are counted outside), and e0 (T * 6D * 4) once.
In backward one block at a time is re-run without RecomputeSaved, so it holds the recompute-off set R:
  Ll * (12 D s + 2 D a (+ full: 2 D s, + 2 D a torch path) + 2 F s + stats + 8 r s) + text side +
  modulation + the block's weight copies, where the 12 are six recipes made concrete (the modulated
  inputs of the self-attention and the FFN, c = norm3(x1), the normed cross q, the rotated q and k) and
  q, k, v, cross q and the two attention outputs; the 2 D a the float32 x1 and x2;
  in full fine-tuning y and the FFN output kept for the parameters' gradients and, in the torch path,
  the two float32 normed LayerNorm outputs (the fused op keeps its input and statistics instead); the
  GELU output is kept (2 F); when every block is checkpointed and under sequence parallelism the
  self-attention keeps its exchanged q/k/v/output rather than the rotated q/k (+1 D s: with some blocks
  plain the seam recomputes its exchange, `seq_parallel.recompute`); the image branch adds its video
  and image sides as above.

Without RecomputeSaved (`train.recompute_saved: false`, SP 1) every plain block keeps R and its output
(Ll D a), and with LoRA and no block checkpointed nothing keeps the first block's input any more (only
norm1's recipe did; the patch embedding is frozen); the peak adds the checkpointing case's backward
term (the GELU output is in R).

The peak of a step is reached in the backward of the last plain block's FFN (traced op by op), after
the head's saved tensors were freed, or in that of the last checkpointed block (the first n are
checkpointed, so block n - 1, once the plain blocks after it are freed), or in the head's backward,
whichever is highest:
  last plain block:  saved - head + (full: 2 Ll F s + D F s   LoRA: 3 Ll F s)
      the GELU output recomputed from its recipe (Ll F) and its gradient (Ll F); full fine-tuning adds
      ffn.2's new weight gradient (D F, in the compute dtype as the matmul makes it); with LoRA the
      adapter's gradient w.r.t. the GELU output, the base Linear's and their sum (3 Ll F), the recomputed
      GELU output already dropped; without RecomputeSaved the GELU output is in R (one Ll F less)
  checkpointed:      n Ll D a + e0 + outside - head + R + (full: Ll F s + D F s   LoRA: 2 Ll F s)
      the GELU output is now part of R, so it is not recomputed again
  the head's:        saved + (full: 3 Ll D a torch path, Ll D a fused; LoRA: 2 Ll D a) - Ll C a
      its float32 input gradient and the modulation's (and in full fine-tuning the scale's) over the
      tokens, the loss's (prediction - target) freed (and in full fine-tuning the head Linear's input)
Attention needs no L x L memory: the SDPA flash kernels (CPU and CUDA) keep only a logsumexp row.

"""

from __future__ import annotations

from video_dit.models.activation_terms import Activations, Setting, checkpointed_count, float32_bytes, weight_copy_bytes


def image_embedding_bytes(cfg, s: int, lora_rank: int | None, lora_img_emb: bool) -> int:
    """What the CLIP image branch's `img_emb` MLP (LayerNorm, Linear, GELU, Linear, LayerNorm over
    Li = image_context_len tokens of width c = image_dim) leaves for backward, with its output (the
    image context, kept by every block's k_img / v_img); 0 without the branch (module docstring).
    The LayerNorms run in float32 (`norm_to`): the last one keeps a float32 copy of its input; in a
    bf16 job the trainable Linears' weights are used through compute-dtype copies (`weight_copies`)."""
    Li, c, D, r = cfg.image_context_len, cfg.image_dim or 0, cfg.dim, lora_rank or 0
    if not Li:
        return 0
    a, w = float32_bytes(s), weight_copy_bytes(s)
    out = Li * D * s
    if not lora_rank:  # LayerNorm inputs and stats, the Linears' inputs, GELU's input; FLF2V's clip_fea + emb_pos
        flf2v = Li * c * a if cfg.num_images > 1 else 0
        return out + Li * (3 * c * s + D * a + 16) + flf2v + (c * c + c * D) * w
    if lora_img_emb:  # the adapters' inputs and lora_A outputs, GELU's input, the last LayerNorm's
        return out + Li * (3 * c * s + D * a + 8 + 2 * r * s) + r * (2 * c + D) * w
    return out  # frozen: nothing inside needs a gradient


def activation_bytes(cfg, grid: tuple[int, int, int], setting: Setting, *, lora_rank: int | None, s: int,
                     per_token: bool = False, lora_img_emb: bool = False, fused: bool = False) -> Activations:
    """Activation memory of one forward + backward on one rank, for latents of `grid` = (F', h, w)
    (see the module docstring for the derivation of every term). `s`: bytes per element of the
    compute dtype; `lora_img_emb`: LoRA adapters on the image MLP too (`network.include_img_emb`);
    `fused`: the DiT runs its fused kernels (`video_dit.kernels`: CUDA with triton) rather than the
    torch path, which saves a little less. `setting.checkpoint_blocks` of the blocks (the first
    ones) are checkpointed, the others keep what a block keeps."""
    pt, ph, pw = cfg.patch_size
    L = (grid[0] // pt) * (grid[1] // ph) * (grid[2] // pw)
    N, B = setting.sp, setting.micro_batch
    Ll = -(-L // N)
    D, F, H, Lt, r = cfg.dim, cfg.ffn_dim, cfg.num_heads, cfg.text_len, lora_rank or 0
    C = cfg.out_dim * pt * ph * pw
    a, w = float32_bytes(s), weight_copy_bytes(s)
    torch_path = not fused
    full = not lora_rank
    T = Ll if per_token else 1
    T_time = L if per_token else 1  # the time MLP runs before the tokens are split
    Li = cfg.image_context_len
    layers = cfg.num_layers
    n_ckpt = checkpointed_count(setting, layers)
    n_plain = layers - n_ckpt
    stats = (9 + H + (H if N == 1 else 0) + (H if Li else 0)) * 4
    text = Lt * (3 * D * s + 4 + 2 * r * s) + Li * (3 * D * s + 4 + 2 * r * s)  # + the image side (k_img, v_img)
    image = 2 * D * s if Li else 0  # the text and image attention outputs, apart from their sum (kept by `o`)
    modulation = T * D * (24 + (8 if torch_path else 0))  # e0 + modulation; the torch path's two (1 + scale)
    # the compute-dtype weight copies one block's matmuls keep (bf16 / fp16 jobs; once per forward, not per sample)
    if full:
        block_weights = (8 * D * D + 2 * D * F + (2 * D * D if Li else 0)) * w
    else:
        block_weights = r * (16 * D + 2 * F + (2 * D if Li else 0) + (2 * D if Li and lora_img_emb else 0)) * w
    block = Ll * ((7 + full) * D * s + 3 * D * a + image + F * s + stats + 8 * r * s) + text + modulation
    # R, what one block keeps without RecomputeSaved; with sequence parallelism (all blocks checkpointed:
    # the seam then keeps its exchanged tensors) one D s more
    sp_extra = D * s if N > 1 and n_plain == 0 else 0
    recompute = (Ll * (12 * D * s + 2 * D * a + ((2 * D * s + (2 * D * a if torch_path else 0)) if full else 0)
                       + sp_extra + image + 2 * F * s + stats + 8 * r * s) + text + modulation)
    head = (((2 if torch_path else 1) * Ll * D * a if full else 0) + 2 * Ll * 4
            + T * D * (4 if torch_path else 8))  # normed, modulated input; stats; (1 + scale) or the op's scale
    first = Ll * D * s  # the first block's input (the patch tokens, in the compute dtype)
    if torch_path and s < a and n_ckpt == 0:
        # the torch path's LayerNorm reads a float32 copy of it; RecomputeSaved's recipe keeps that copy, and
        # without it the LayerNorm does when the input needs a gradient (full fine-tune) instead of the tokens
        first = first + Ll * D * a if setting.recompute else (Ll * D * a if full else first)
    patch = pt * ph * pw * cfg.in_dim
    outside = (first
               + (T_time * (cfg.freq_dim * 4 + 4 * D * a) if full else 0)    # time MLP (float32)
               + (L * patch * w if full else 0)                              # the patch embedding's input copy
               + Lt * D * s + (Lt * (cfg.text_dim + 2 * D) * s if full else 0)  # text MLP
               + head + Ll * C * a + (L * C * a if N > 1 else 0)             # head, output (+ gathered)
               + (L * 7 * D * 4 if per_token else 0)
               + image_embedding_bytes(cfg, s, lora_rank, lora_img_emb))     # img_emb and its output
    outside_weights = ((D * D + D * patch) * w if full else 0)  # text_embedding.2's and the patch conv's copies
    if not setting.recompute and n_plain:
        # no RecomputeSaved: every plain block keeps R and its output (the next block's or the head's LayerNorm
        # input); with LoRA and no checkpointed block nothing keeps the first block's input (only norm1's recipe
        # did; the patch embedding is frozen)
        plain = recompute + Ll * D * a
        if not full and n_ckpt == 0:
            outside -= first
        plain_backward = Ll * F * s if full else 2 * Ll * F * s
    else:
        plain = block
        plain_backward = 2 * Ll * F * s if full else 3 * Ll * F * s
    ckpt_backward = Ll * F * s if full else 2 * Ll * F * s
    ffn_grad = D * F * s if full else 0  # ffn.2's new weight gradient, in the compute dtype as the matmul makes it
    # a checkpointed block keeps its input (the previous block's output: counted once, as each block's output);
    # e0 is kept once, by the checkpoints' inputs
    kept = n_ckpt * Ll * D * a + (T * 6 * D * 4 if n_ckpt else 0)
    saved = n_plain * plain + kept + outside
    weights = n_plain * block_weights + outside_weights
    if not full and n_ckpt == 0:  # block 0's q, k, v adapters read patch tokens that need no gradient
        weights -= 3 * r * D * w
    # the peak is in the backward of the last plain block (its FFN), or of the last checkpointed one (block
    # n_ckpt - 1, once the plain blocks after it are freed), whichever is higher
    # or in the head's backward, before any block's tensors are freed: its float32 input gradient and, in the
    # torch path, the modulation's (and in full fine-tuning the scale's) gradients over the tokens, while the
    # loss's (prediction - target) is freed (and in full fine-tuning the head Linear's input)
    head_backward = ((3 if torch_path else 1) if full else 2) * Ll * D * a - Ll * C * a
    peaks = [(saved + head_backward) * B + weights]
    if n_plain:
        peaks.append((saved - head + plain_backward) * B + weights + ffn_grad)
    if n_ckpt:
        peaks.append((kept + outside - head + recompute + ckpt_backward) * B + outside_weights + block_weights
                     + ffn_grad)
    parts = {"per_block": plain if n_plain else Ll * D * a, "outside": outside, "weights": weights,
             "checkpointed_blocks": n_ckpt}
    if n_ckpt:
        parts["recomputed_block"] = recompute
    parts["backward"] = (plain_backward if n_plain else ckpt_backward) * B + ffn_grad
    return Activations(saved=saved * B + weights, peak=max(peaks), parts=parts)
