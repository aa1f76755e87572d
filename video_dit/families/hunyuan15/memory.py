"""Activation memory of the HunyuanVideo 1.5 DiT in one training step, per rank: what
`dit.py` and `layers.py` make autograd keep, op by op (the plan's other terms,
parameters and DeepSpeed's state, are the family-blind ones of `plan.py`).

Notation as in `plan.py`: s bytes per element of the compute dtype, a = max(s, 4) the float32 islands
(the residual streams, the LayerNorms' inputs and outputs, the modulation), w the compute-dtype copy
autocast makes of a float32 trainable weight (s in bf16, 0 in fp32); B micro-batch; L video tokens,
Ll = ceil(L / N) on each of the N ranks of a sequence group; M = Li + Lg + Lt the text-stream tokens
(SigLIP image tokens, ByT5 glyph tokens, Qwen2.5-VL tokens: upper bounds, a batch is padded to its
longest caption), replicated on every rank; D width, F the MLP width, H heads, r LoRA rank,
C = out_channels * pt*ph*pw. Every block runs the torch path (no fused kernels, no RecomputeSaved).

One double block keeps, per sample, for each stream of T tokens (video T = Ll, text T = M), before the
attention (pre) and after it (post):
  full fine-tune   pre T (2 D a + 3 D s + 8 + 8 H) + D (4 + s), post T (2 D a + 3 D s + 2 F s + 8) + 28 D
      a: the first LayerNorm's input and the normed x (kept by addcmul for the scale's gradient), after
      the attention update the stream and its normed copy; s: the modulated input of q / k / v (one
      tensor), q and k before their RMSNorms, then the attention projection's output (kept for the gate's
      gradient), the MLP's modulated input and its output; 2 F s: fc1's output (GELU's input) and GELU's
      output (fc2's input); 8 + 8 H, 8: the LayerNorms' mean and rstd, the q / k RMSNorms' rstd per head;
      per sample D (4 + s), 28 D: the two (1 + scale), the modulation Linear's input SiLU(vec), its six
      float32 vectors (kept by the gates)
  LoRA             pre T (D a + 3 D s + 8 + 8 H + 3 r s) + 4 D, post T (D a + D s + 2 F s + 8 + 3 r s) + 28 D
      no normed copies, no gated outputs, no modulation input (the adaLN is frozen); each of the six
      adapters keeps lora_A's output. In the first block neither stream's input needs a gradient (the
      embedders are frozen): pre less T (D a + 8) + 4 D (its first LayerNorm keeps nothing, nor addcmul
      its (1 + scale))
  The last block's text stream keeps its pre part only: nothing reads its output, so autograd drops the rest.
  joint attention (one per block; SDPA over [video | text], the key mask as an additive float)
      4 (L' + M) D' s + H' (L' + M) 4 + (L' + M) s, with L' = Ll, D' = D, H' = H without sequence
      parallelism, else L' = L, D' = D / N, H' = H / N (this rank's heads of every token) plus the
      exchanged outputs the projections read, (Ll + M) D s (the last block: Ll D s; without sequence
      parallelism they are views of the kernel's output)
  weight copies (bf16, once per forward): full 2 (10 D^2 + 2 D F) w (q, k, v, proj, the 6 D modulation,
      fc1, fc2 per stream); LoRA 2 r (10 D + 2 F) w, minus 6 r D w in the first block (the q / k / v
      lora_A of inputs that need no gradient); the last block's text proj, fc1, fc2 ones are dropped
Outside the blocks: the final layer (float32): LoRA Ll (D a + 8) + D 4; full + 2 Ll D a + D 4 (its normed
and modulated inputs, SiLU(vec)); vec itself D 4 (full); the loss's (prediction - target), L C a (the
whole prediction on every rank under sequence parallelism), whose rows of the RoPE tables (Ll Dh 4, once)
are split again in every forward. Full fine-tuning adds the embedders (per sample, c_in = 2 z + 1
input channels, Gh the ByT5 mapper's hidden width, g / v the ByT5 / SigLIP widths):
  the patch embedding's bf16 input copy L c_in pt ph pw w and its conv weight's; the two timestep MLPs
  (float32) 2 (256 + 2 D) 4; the token refiner's pooled-text MLP (text_dim + 2 D) s, its input's copy
  Lt text_dim w; per refiner block Lt (2 D a + 16 D s + 16 + 4 H + s) + 2 D 4 (LayerNorm inputs and
  outputs, the fused qkv, the attention and gated outputs, the 4 D SiLU MLP's input and output, stats,
  logsumexp, mask), its adaLN input D s (and c once in float32); the ByT5 mapper Lg (g s + 8 + 4 Gh s);
  the SigLIP projection Li (3 v s + D a + 16); and the weight copies of the Linears whose input needs a
  gradient (14 D^2 per refiner block, the mapper's and projection's).
Not counted: the batch itself (latents, cached text, image embeds: a float32 input is what its first
LayerNorm keeps) and the RoPE tables, cached by the model per grid.
Checked exactly against `CPUAllocationTracker` (tests/test_plan_hunyuan15.py: full and LoRA, fp32 and
the bf16 of a GPU job, no / some / every block checkpointed; test_hunyuan15_sequence_parallel.py: SP 2).

Block checkpointing keeps a checkpointed block's two inputs (Ll D a + M D a; the first block's video
input is the patch tokens, Ll D s), once the text key mask (M bytes) and, under LoRA, vec; in backward it
re-runs one block at a time. The peak, traced (within 10% of the tracker's in the tests), is the highest of:
  the final layer's backward: saved + (3 Ll D a full, 2 Ll D a LoRA) - L C a
  the last plain block's video MLP: saved - the final layer + 2 Ll F s + Ll D a (two Ll F gradients around
      GELU, the stream's gradient) + full: fc2's weight gradient D F (s + 4 in bf16: made in bf16, cast for
      its float32 master's .grad, its weight copy freed by then)
  the last checkpointed block's video MLP: the kept inputs, the outside terms and one recomputed block
      whose text MLP (created after the video one) has already run backward, + the same MLP terms
  full fine-tuning, the embedders' backward: the embedders and their copies + the largest embedder
      weight's gradient (bf16: and its float32 cast; at the released sizes the refiner's 4 D x D)
"""

from __future__ import annotations

from video_dit.models.activation_terms import Activations, Setting, checkpointed_count, float32_bytes, weight_copy_bytes

TIME_FREQ = 256  # the timestep sinusoid's width (layers.timestep_sinusoid)
REFINER_RATIO = 4  # the token refiner's MLP ratio (layers.REFINER_MLP_RATIO)


def hy15_activation_bytes(cfg, grid: tuple[int, int, int], setting: Setting, *, lora_rank: int | None, s: int,
                          text_len: int, glyph_len: int, image_len: int) -> Activations:
    """Activation memory of one forward + backward of the HunyuanVideo 1.5 DiT `cfg` on one rank for latents
    of `grid` (F', h, w): see the module docstring for every term. `text_len`, `glyph_len`, `image_len`:
    the text stream's Qwen2.5-VL, ByT5 and SigLIP tokens (the longest a batch pads to)."""
    pt, ph, pw = cfg.patch_size
    L = (grid[0] // pt) * (grid[1] // ph) * (grid[2] // pw)
    N, B = setting.sp, setting.micro_batch
    Ll = -(-L // N)
    D, H, r = cfg.hidden_size, cfg.heads_num, lora_rank or 0
    F = int(D * cfg.mlp_width_ratio)
    M = text_len + glyph_len + image_len
    C = cfg.out_channels * pt * ph * pw
    a, w = float32_bytes(s), weight_copy_bytes(s)
    full = not lora_rank
    layers = cfg.mm_double_blocks_depth
    n_ckpt = checkpointed_count(setting, layers)
    n_plain = layers - n_ckpt

    def stream(T: int, first: bool, post: bool = True) -> int:
        """One stream's tensors: before the attention (its input's norm, q / k / v), and `post` after it."""
        if full:
            pre = T * (2 * D * a + 3 * D * s + 8 + 8 * H) + D * (4 + s)
            after = T * (2 * D * a + 3 * D * s + 2 * F * s + 8) + 28 * D
        else:
            pre = T * (D * a + 3 * D * s + 8 + 8 * H + 3 * r * s) + 4 * D - (T * (D * a + 8) + 4 * D if first else 0)
            after = T * (D * a + D * s + 2 * F * s + 8 + 3 * r * s) + 28 * D
        return pre + (after if post else 0)

    def attention(last: bool) -> int:
        if N == 1:
            return 4 * (Ll + M) * D * s + H * (Ll + M) * 4 + (Ll + M) * s
        # this rank's heads of every token; the exchanged outputs the projections read (not the last text one)
        return 4 * (L + M) * (D // N) * s + (H // N) * (L + M) * 4 + (L + M) * s + (Ll + (0 if last else M)) * D * s

    def block(first: bool, last: bool = False) -> int:
        """The last block's text stream ends at the attention: nothing reads its output."""
        return stream(Ll, first) + stream(M, first, post=not last) + attention(last)

    def block_weights(first: bool, last: bool = False) -> int:
        if full:
            return (2 * (10 * D * D + 2 * D * F) - ((D * D + 2 * D * F) if last else 0)) * w
        return r * (2 * (10 * D + 2 * F) - (6 * D if first else 0) - ((4 * D + 2 * F) if last else 0)) * w

    # outside the blocks
    final = Ll * (D * a + 8) + D * 4 + ((2 * Ll * D * a + D * 4) if full else 0)
    loss = L * C * a
    embedders = embedder_weights = largest_embedder = 0
    if full:
        depth, Lt, Lg, Li = cfg.refiner_depth, text_len, glyph_len, image_len
        c_in, patch = cfg.patch_in_channels, pt * ph * pw
        refiner = Lt * (2 * D * a + (8 + 2 * REFINER_RATIO) * D * s + 16 + 4 * H + s) + 2 * D * 4
        embedders = (D * 4                                                   # vec
                     + L * patch * c_in * w                                  # the patch embedding's input copy
                     + 2 * (TIME_FREQ + 2 * D) * 4                           # time_in, txt_in.t_embedder
                     + (cfg.text_states_dim + 2 * D) * s + Lt * cfg.text_states_dim * w  # c_embedder, input copy
                     + depth * refiner + depth * D * s + (D * 4 if s == 4 else depth * D * s)  # adaLN inputs
                     + (Lg * (cfg.byt5_states_dim * s + 8 + 4 * cfg.byt5_hidden_dim * s) if Lg else 0)
                     + (Li * (3 * cfg.vision_states_dim * s + D * a + 16) if Li else 0))
        g, gh, v = cfg.byt5_states_dim, cfg.byt5_hidden_dim, cfg.vision_states_dim
        # (a Linear whose input needs no gradient keeps no weight copy: input_embedder's and the pooled-text
        # one's read the batch; the patch conv keeps its weight whatever)
        embedder_weights = w * (D * c_in * patch + D * D
                                + depth * (6 + 2 * REFINER_RATIO) * D * D
                                + ((g * gh + gh * gh + gh * D) if Lg else 0) + ((v * v + v * D) if Li else 0))
        largest_embedder = max(D * c_in * patch, cfg.text_states_dim * D, REFINER_RATIO * D * D,
                               *((g * gh, gh * gh, gh * D) if Lg else ()), *((v * v, v * D) if Li else ()))
    outside = final + loss + embedders

    # a checkpointed block keeps its two inputs (the first block's video input: the patch tokens, in s);
    # without checkpointing the first block's inputs need no gradient under LoRA (`stream(first=True)`)
    # and the arguments they share, once: the text key mask (bool) and, under LoRA (nothing else keeps it), vec
    kept = n_ckpt * (Ll + M) * D * a - Ll * D * (a - s) + M + (0 if full else D * 4) if n_ckpt else 0
    plain = range(n_ckpt, layers)
    saved = sum(block(i == 0, i == layers - 1) for i in plain) + kept + outside
    # under sequence parallelism this rank's rows of the RoPE tables, split in every forward (B-independent)
    weights = (sum(block_weights(i == 0, i == layers - 1) for i in plain) + embedder_weights
               + (Ll * (D // H) * 4 if N > 1 else 0))
    # a weight gradient is made in the compute dtype, then (bf16) cast to its float32 master's dtype for .grad;
    # its layer's weight copy is freed by then
    grad_bytes = s + (4 if s < 4 else 0)
    # the video MLP's backward (traced): two Ll F gradients at once around GELU, and the stream's gradient
    mlp_backward = 2 * Ll * F * s + Ll * D * a
    fc2_grad = D * F * (grad_bytes - w) if full else 0
    head_backward = (3 if full else 2) * Ll * D * a - L * C * a
    peaks = [(saved + head_backward) * B + weights]
    if n_plain:
        peaks.append((saved - final + mlp_backward) * B + weights + fc2_grad)
    if n_ckpt:
        # the recomputed block's text MLP (created after the video one) has run backward by the video MLP's
        recomputed = block(n_ckpt == 1, last=True)
        peaks.append((kept + outside - final + recomputed + mlp_backward) * B + embedder_weights
                     + block_weights(n_ckpt == 1, last=True) + fc2_grad)
    if full:  # the embedders' backward: the blocks' tensors freed, the largest embedder weight's gradient
        peaks.append((embedders + loss) * B + embedder_weights + largest_embedder * (grad_bytes - w))
    parts = {"per_block": block(False) if n_plain else (Ll + M) * D * a, "outside": outside, "weights": weights,
             "checkpointed_blocks": n_ckpt, "text_tokens": M}
    return Activations(saved=saved * B + weights, peak=max(peaks), parts=parts)


def hy15_text_tokens(preset, i2v: bool) -> tuple[int, int, int]:
    """(text_len, glyph_len, image_len) a job's batches pad to at most: the Qwen2.5-VL crop, the ByT5 glyph
    prompt, and the SigLIP tokens of an image-to-video job (a DiT with the SigLIP branch reads one masked zero
    token in text-to-video: `families._hy15_text_inputs`)."""
    from video_dit.families.hunyuan15.encoders import GLYPH_LEN

    cfg = preset.dit
    image = 0
    if cfg.vision_projection != "none":
        image = preset.image_encoder.tokens if i2v and preset.image_encoder is not None else 1
    return preset.text_encoder.text_len, GLYPH_LEN if cfg.glyph_byT5_v2 else 0, image

