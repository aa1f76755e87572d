"""Activation memory of the LTX-2 DiT in one training step, per rank: what `dit.py` and `layers.py` make
autograd keep, op by op (the plan's other terms, parameters and DeepSpeed's state, are the family-blind ones
of `plan.py`). Checked to the byte against `CPUAllocationTracker` (tests/test_plan_ltx2.py: full and LoRA,
fp32 and the bf16 of a GPU job, no / some / every block checkpointed, t2v and i2v, batches of 1 and 2, the
2.0 / 2.3 / 2.5 flags, RecomputeSaved on and off; tests/test_ltx2_sequence_parallel.py: SP 2), the step's peak
within 10%. A one-stream LoRA (`network.streams`, `lora_streams`): the other stream's modules have no lora_A
outputs or adapter copies, and its text attention's keys (the text's) need no gradient, so their rstd is not kept
(Lt 4); exact when the first block is checkpointed. An unchecked first block is counted as both streams' (an
over-count: the unadapted stream's attentions there read inputs that need no gradient until the cross-modal
attention; measured 5.0% / 1.3% of a three-block tiny DiT's saved bytes, audio / video LoRA).

Notation as in `plan.py`: s bytes of the compute dtype, a = max(s, 4) the float32 islands (residual streams,
norms, modulation, RoPE, gates), w the compute-dtype copy autocast makes of a float32 trainable weight (s in
bf16, 0 in fp32); B micro-batch; N the sequence-parallel size; per rank T = ceil(L / N) video tokens of width D
and Ta = ceil(La / N) audio tokens of width Da; X = Da the audio <-> video attentions' width; H heads; Lt text
tokens (every caption is the connectors' max_length rows); r the LoRA rank; m the video's modulation rows per
sample: 1, or T with per-token timesteps (image-to-video). Every block runs the torch path (SDPA; on CPU its
output is laid out (B, T, H, Dh), so the output projection reads it without a copy).

RecomputeSaved (`LTX2Block.recompute`: a plain block unless `train.recompute_saved` is off; never a
checkpointed one, whose re-run keeps what autograd keeps, the set R below): a registered result costs nothing,
but its recipe holds its inputs, and the recipes of one block (one `_output`) live as long as any tensor its
hooks packed, used or not (the saved-tensor hook keeps its `RecomputeSaved`), so each recipe input that
nothing else keeps is counted. Recipes (what they cost): every modulated norm's normed x and output (x, the
stream, kept anyway; the scale / shift rows they read: the a2v / v2a ones 4 m W a, the others kept whole with
their gate), the normed and rotated q / k (the projections, which the q / k norms keep), the gated attention
output and its float32 operand (the attention's output: SDPA keeps its own, the seam's is then kept), the GELU
output (its input, kept by GELU), the modulated text (the text, once, and its shift / scale (B, 1, 2, W) with
the prompt adaLN; else a view of the table), 2.0's normed text-attention input (the stream).

One plain block keeps, per sample, for each stream (T tokens of width W, the video's rows m, the audio's 1)
(R: without recipes, the terms in [brackets] added):
  an adaLN-modulated RMSNorm    when its input needs a gradient rstd T 4 and (1 + scale) m W a (addcmul's);
                                [its output T W s (the next Linears' input); full: the normed x T W a (for the
                                scale's gradient)]
  the adaLN rows read           3 m W a per modulated part (shift, scale, gate: kept whole with the gate); the
                                a2v / v2a gate W a, and with recipes their scale / shift rows 4 m W a
  an attention (Tq queries of a stream of width Wq, Tk keys, inner width I)
                                q, k before their RMSNorms (Tq + Tk) I s and rstd (Tq + Tk) 4; v Tk I s; [q, k
                                rotated or normed (Tq + Tk) I s]; SDPA's output Tq I s, logsumexp H Tq 4, the float
                                key mask Tk s (padded text); gated (2.3+): the gates Tq H 4, and where the gates
                                need a gradient the sigmoid Tq H 4 (full bf16: the float32 gate Linear's input Tq
                                Wq 4); [the gated output Tq I s, and where the gates need a gradient, bf16, the
                                output's float32 copy Tq I 4]; full: the output projection's Tq Wq s (for the
                                gate's gradient; not 2.0's ungated text attention); LoRA: each adapter's lora_A
                                output, (2 Tq + 2 Tk) r s
  self-attention                a modulated norm (LoRA's first block: its input needs no gradient), an attention
  text attention (2.3+)         a modulated norm, with the prompt adaLN the text's shift / scale 2 W a [instead:
                                the modulated text Lt W s (full bf16: the text's float32 copy Lt W 4)], an
                                attention over Lt keys; 2.0: RMSNorm (rstd T 4 [, output T W s]) and the attention
                                over the caption projection's output (counted once, outside)
  audio <-> video               per stream its gate rows and two modulated norms (q input, k / v input); a2v
                                (q video, k / v audio at width X) and v2a attentions
  FFN                           a modulated norm, 4 W up (GELU's input) T 4W s [and the GELU output T 4W s]; full:
                                the down output T W s (for the gate's gradient); LoRA: two lora_A outputs 2 T r s
  and after each of the four updates the stream, T W a
Weight copies (bf16, per plain block): full 16 D^2 + 16 Da^2 + 4 X (D + Da) w (every Linear but the float32 gates);
  LoRA r (in + out) w per adapter, without the lora_A copy where the input needs no gradient (the text's k / v,
  and the first block's self-attention q / k / v).
Held once by the blocks, per sample: the first block's inputs, the streams T D a + Ta Da a (full: its norms';
  LoRA: the first block's recipes' or the checkpoint's; LoRA without either: none), and, bf16 (2.3+), the text
  cast to it Lt (D + Da) s (the modulated text's recipes' or the checkpoints').
Outside the blocks, per sample: the output layers (LayerNorm statistics 2 T 4 + 2 Ta 4, (1 + scale) m D a + Da a;
  with recipes the shift / scale rows their recipes hold 2 m D a + 2 Da a, without, full: their normed and
  modulated inputs 2 T D a + 2 Ta Da a), the loss's differences L C a + La Ca a (the whole prediction on every
  rank under sequence parallelism); full: the gathers' indices of the adaLN outputs (8 per timestep, per-token:
  per token), the patch embeddings' inputs L Cp s + La Ca s (the video's a view of the batch for one fp32 sample
  of a 1-cell patch), the keyframe mask T 4 (2.5, i2v), 2.0's caption projections Lt (Cc w + 2 W s) per stream;
  2.0: their outputs Lt (D + Da) s. Per batch (full): each adaLN-single per distinct timestep (per-token video
  timesteps: 0 and each sample's t) 256 4 + 4 W a; 2.0's projection weight copies. Not counted: the batch itself
  and the RoPE tables, cached per grid.

Block checkpointing keeps each checkpointed block's output (its successor's input) T D a + Ta Da a and, once,
what the blocks' closures hold of the forward: the streams' modulation rows (m (rows + 4) + 1 + 2) D a + (rows
+ 4 + 1 + 2) Da a (blocks, a2v / v2a scale-shift, gate, text: 2 rows with the prompt adaLN); it re-runs one block
at a time, without recipes (R).
Sequence parallelism (`parallel.sequence`, the two-stream seam): each of the four attentions over a stream keeps
its local q, k, v for its recomputed exchange (q, k: recipes, with recipes) instead of SDPA's output and
logsumexp (the output projection, or the gated output's recipe, then reads the exchanged output, a tensor of its
own: + Tq I s), each holds the bool key mask of a padded key stream (Lk bytes, every block), and every forward
splits the RoPE tables (T (D + X) 4 + Ta (Da + X) 4).

The peak, traced (`ltx2_activation_bytes`' candidates), the highest of: the forward at the video output Linear
(the streams' modulation rows and output embeddings still alive); the output layers' backward; the backward of
the last plain block's video FFN (the streams' gradients and one FFN hidden gradient; with recipes, the GELU
output recomputed); that of the last checkpointed block, re-run after the plain ones; full fine-tuning with
per-token timesteps, the sum of a block's modulation-row gradients (two T rows D a tensors: with recipes, the
first, after the FFN's backward, the rest of the block alive; without, by the end of the block's backward).
"""

from __future__ import annotations


from video_dit.models.activation_terms import Activations, Setting, checkpointed_count, float32_bytes, weight_copy_bytes

TIME_FREQ = 256  # the timestep sinusoid's width (layers.timestep_sinusoid)


def ltx2_activation_bytes(cfg, grid: tuple[int, int, int], setting: Setting, *, lora_rank: int | None, s: int,
                          text_len: int, audio_tokens: int, per_token: bool = False,
                          text_masked: bool = False, lora_streams: str = "both") -> Activations:
    """Activation memory of one forward + backward of the LTX-2 DiT `cfg` on one rank for video latents of
    `grid` (F', h, w) with `audio_tokens` audio latent frames and `text_len` text tokens (see the module
    docstring for every term). `per_token`: per-token video timesteps (image-to-video); `text_masked`: the
    captions are padded (a key mask reaches the text attentions). `setting.recompute`: the plain blocks and
    the output layers keep RecomputeSaved's recipes (`LTX2DiT.recompute_saved`); checkpointed blocks never do.
    `lora_streams`: the streams a LoRA adapts (`network.streams`; the module docstring says what of a one-stream
    LoRA is counted)."""
    pt, ph, pw = cfg.patch_size
    L = (grid[0] // pt) * (grid[1] // ph) * (grid[2] // pw)
    La = audio_tokens
    N, B = setting.sp, setting.micro_batch
    T, Ta = -(-L // N), -(-La // N)
    D, Da, X, H, Lt = cfg.hidden_size, cfg.audio_hidden_size, cfg.audio_cross_attention_dim, cfg.num_heads, text_len
    a, w = float32_bytes(s), weight_copy_bytes(s)
    bf16 = s < 4
    full, r = not lora_rank, lora_rank or 0
    gated, adaln = cfg.apply_gated_attention, cfg.cross_attention_adaln
    layers = cfg.num_layers
    n_ckpt = checkpointed_count(setting, layers)
    rc = setting.recompute  # the plain blocks' and the output layers' recipes (`LTX2DiT._set_block_recompute`)
    C = cfg.out_channels * pt * ph * pw
    m = T if per_token else 1  # the video's modulation rows per sample

    def adapted(stream: str, first: bool) -> bool:
        """Whether `stream`'s modules carry adapters, as counted: a one-stream LoRA's other stream has none; its
        first block is counted as both streams' (an over-count: module docstring)."""
        return full or first or lora_streams in ("both", stream)

    def norm(T_, W, rows, grad_in=True, recipes=True) -> int:
        """An adaLN-modulated RMSNorm (`rms_modulate`) of T_ tokens of width W with `rows` modulation rows;
        `grad_in`: its input needs a gradient; `recipes`: its normed x and output are recipes of x."""
        kept = T_ * 4 + rows * W * a if grad_in else 0  # rstd, 1 + scale (addcmul's, for the normed x's gradient)
        if not recipes:
            kept += T_ * W * s + (T_ * W * a if full and grad_in else 0)  # its output (the Linears'); the normed x
        return kept

    def attention(Tq, Tk, I, Wq, *, seam=False, masked=False, gate_grad=True, gated_update=True,
                  recipes=True, lora=True, k_grad=True) -> int:
        """One attention: Tq queries of a stream of width Wq, Tk keys, inner width I. `seam`: through the
        sequence-parallel exchange (recomputed in backward: its local q, k, v kept, not SDPA's output);
        `gate_grad`: its gates need a gradient (not in LoRA's first self-attentions); `gated_update`: its
        output is added to the stream through an adaLN gate (2.0's text attention is added as it is);
        `recipes`: the normed, rotated q / k and the gated output (and its float32 operand) are recipes; `lora`:
        its projections carry adapters; `k_grad`: its keys need a gradient (the text's not, without adapters)."""
        kept = (Tq + Tk) * I * s + (Tq + (Tk if k_grad else 0)) * 4 + Tk * I * s  # q, k before their norms, rstd; v
        if not recipes:
            kept += (Tq + Tk) * I * s  # q, k normed and rotated (SDPA's or the seam's)
        if not seam:
            kept += Tq * I * s + H * Tq * 4 + (Tk * s if masked else 0)  # SDPA's output, logsumexp, float mask
        if gated:
            kept += Tq * H * 4  # the gates (the product's, for the output's gradient)
            if gate_grad:
                kept += Tq * H * 4 + (Tq * Wq * 4 if full and bf16 else 0)  # the sigmoid; the gate Linear's f32 input
            if recipes:  # the gated output a recipe of the attention output: the seam's then kept (SDPA keeps its own)
                kept += Tq * I * s if seam else 0
            else:  # the gated output (to_out's input); the output the gates multiply (fp32 without the seam: SDPA's)
                kept += Tq * I * s + ((Tq * I * 4 if bf16 else Tq * I * s if seam else 0) if gate_grad else 0)
        elif seam:
            kept += Tq * I * s  # to_out's input: the exchanged output (without the seam: SDPA's, laid out (T, H, Dh))
        if full:
            kept += Tq * Wq * s if gated_update else 0  # to_out's output, kept for the gate's gradient
        elif lora:
            kept += (2 * Tq + 2 * Tk) * r * s  # the lora_A outputs
        return kept

    def ffn(T_, W, rows, recipes, lora=True) -> int:
        """The FFN: its rows, norm, the hidden layer (GELU's input) and, without recipes, the GELU output."""
        return 3 * rows * W * a + norm(T_, W, rows, recipes=recipes) + (1 if recipes else 2) * T_ * 4 * W * s \
            + (T_ * W * s if full else 2 * T_ * r * s if lora else 0) + T_ * W * a

    def block(first: bool, recipes: bool) -> int:
        """One block, per sample (the B-independent SP key masks: `key_masks`); `recipes`: with RecomputeSaved
        (a plain block), else as autograd keeps it (a checkpointed block re-run, or `recompute_saved` off)."""
        seam = N > 1
        kept = 0
        for T_, W, rows, stream in ((T, D, m, "video"), (Ta, Da, 1, "audio")):
            grad_in = full or not first  # LoRA: the first block's streams need no gradient
            ad = adapted(stream, first)
            kept += 3 * rows * W * a + norm(T_, W, rows, grad_in, recipes)  # self-attention
            kept += attention(T_, T_, W, W, seam=seam, gate_grad=grad_in, recipes=recipes, lora=ad) + T_ * W * a
            if adaln:  # text attention
                kept += 3 * rows * W * a + norm(T_, W, rows, recipes=recipes)
                if recipes:  # the modulated text a recipe of the text (`held`) and its shift / scale (B, 1, 2, W)
                    kept += 2 * W * a if cfg.has_prompt_adaln else 0  # (without prompt_adaln_single: the table's view)
                else:
                    kept += Lt * W * s + (Lt * W * 4 if full and bf16 else 0)  # the modulated text (its float32 copy)
            else:
                kept += T_ * 4 + (0 if recipes else T_ * W * s)  # the RMSNorm's rstd and (no recipe) output
            kept += attention(T_, Lt, W, W, masked=text_masked, gated_update=adaln, recipes=recipes, lora=ad,
                              k_grad=ad) + T_ * W * a
            kept += W * a + 2 * norm(T_, W, rows, recipes=recipes)  # audio <-> video: the gate rows, q and k / v inputs
            kept += 4 * rows * W * a if recipes else 0  # ... whose recipes hold the four scale / shift rows
            kept += ffn(T_, W, rows, recipes, lora=ad)
        kept += attention(T, Ta, X, D, seam=seam, recipes=recipes, lora=adapted("video", first)) + T * D * a  # a2v
        kept += attention(Ta, T, X, Da, seam=seam, recipes=recipes, lora=adapted("audio", first)) + Ta * Da * a  # v2a
        return kept

    def key_masks() -> int:
        """Under sequence parallelism, the bool key mask of each seam attention over a padded stream."""
        if N == 1:
            return 0
        video, audio = T * N if T * N > L else 0, Ta * N if Ta * N > La else 0
        return 2 * video + 2 * audio  # self-attention and the other stream's cross attention over each

    def block_weights(first: bool) -> int:
        if full:
            return (16 * D * D + 16 * Da * Da + 4 * X * (D + Da)) * w
        # lora_A (r x in) and lora_B (out x r) copies; lora_A's only where its input needs a gradient
        b = 0
        for W, stream in ((D, "video"), (Da, "audio")):
            if not adapted(stream, first):
                continue
            b += 4 * (W + W) * r  # self-attention q, k, v, out
            b += (2 * W + W + W + 2 * W) * r  # text: q (in, out), k and v (out only: the text needs no gradient), out
            b += 2 * (W + 4 * W) * r  # FFN
            if first:
                b -= 3 * W * r  # the self-attention's q, k, v read a stream that needs no gradient
        # a2v: q D -> X, k, v Da -> X, out X -> D; v2a the same sum
        b += sum(adapted(stream, first) for stream in ("video", "audio")) * (2 * D + 2 * Da + 4 * X) * r
        return b * w

    plain = range(n_ckpt, layers)
    # held once by the blocks, per sample: the first block's inputs, the streams (full fine-tuning: its norms';
    # LoRA: the checkpoint's or the first block's recipes'), and in bf16 (2.3+) the text cast to it (the
    # checkpoints' or the modulated text's recipes'; without either the modulated text is a tensor of its own)
    held = T * D * a + Ta * Da * a if full or n_ckpt or rc else 0
    held += Lt * (D + Da) * s if bf16 and cfg.caption_proj_before_connector and (n_ckpt or rc) else 0

    # outside the blocks, per sample
    outside = held
    if full:
        # the gathers' index (per-token: of every token, gathered before the split)
        outside += sum(idx * 8 for idx in (L if per_token else 1,) * 2 + (1,) * (6 if cfg.has_prompt_adaln else 4))
        # the patch embeddings' inputs (all tokens: they run before the split), copies but for a 1-cell patch of one
        # sample in float32, a view of the batch
        outside += L * cfg.patch_in_channels * s if bf16 or pt * ph * pw > 1 or B > 1 else 0
        outside += La * cfg.audio_in_channels * s
        if per_token and cfg.use_keyframes_abs_pos_embedding:
            outside += T * 4  # the keyframe mask
        if not cfg.caption_proj_before_connector:  # 2.0's caption projections: input copy (bf16), hidden, GELU
            outside += Lt * (cfg.caption_channels * w + 2 * D * s) + Lt * (cfg.caption_channels * w + 2 * Da * s)
    if not cfg.caption_proj_before_connector:
        outside += Lt * (D + Da) * s  # their outputs, the text the blocks read
    # output layers: LayerNorm statistics, 1 + scale; with recipes the shift / scale rows (B, m, 2, D) the
    # recipes of the normed and the modulated input hold (used or not: LoRA), without them, full: those two
    # (for the scale's and the Linear's gradients)
    heads = 2 * T * 4 + m * D * a + 2 * Ta * 4 + Da * a
    if rc:
        heads += 2 * m * D * a + 2 * Da * a
    elif full:
        heads += 2 * T * D * a + 2 * Ta * Da * a
    outside += heads
    outside += L * C * a + La * cfg.audio_out_channels * a  # the loss's differences
    # ... and per batch: the adaLN-singles (full) run once per distinct timestep (per-token video timesteps: 0
    # and each sample's t), each keeping the sinusoid and four of its width in its MLP
    batch = 0
    if full:
        n_v = B + 1 if per_token else B
        widths = [(D, n_v), (D, n_v), (D, B), (Da, B), (Da, B), (Da, B)]  # adaln, av_ca_video_ss; a2v gate; audio's
        widths += [(D, B), (Da, B)] if cfg.has_prompt_adaln else []  # prompt_adaln_single, audio_prompt_...
        batch += sum(n * (TIME_FREQ * 4 + 4 * W * a) for W, n in widths)
        batch += (D * D + Da * Da) * w if not cfg.caption_proj_before_connector else 0  # the projections' weights
    if N > 1:  # this rank's rows of the RoPE tables, split in every forward (self: W wide, a2v / v2a: X)
        batch += T * (D + X) * 4 + Ta * (Da + X) * 4

    # block checkpointing: each checkpointed block's output (its successor's input; the first block's inputs are
    # `held`); once, what the blocks' closures hold of the streams: their modulation rows (blocks, a2v / v2a,
    # gate, text)
    prompt = 2 if cfg.has_prompt_adaln else 0
    rows_v, rows_a = m * (cfg.modulation_rows + 4) + 1 + prompt, cfg.modulation_rows + 4 + 1 + prompt
    kept = 0
    if n_ckpt:
        kept = n_ckpt * (T * D * a + Ta * Da * a) + rows_v * D * a + rows_a * Da * a

    saved = sum(block(i == 0, rc) for i in plain) + outside + kept
    # (the seam's key masks are held by every block's autograd nodes, checkpointed or not)
    weights = sum(block_weights(i == 0) for i in plain) + layers * key_masks() + batch

    # The peak (traced), the highest of (module docstring):
    loss = L * C * a + La * cfg.audio_out_channels * a
    # the streams' gradients and, full, the video FFN gate's
    grads = T * D * a + Ta * Da * a + (m * D * a if full else 0)
    ffn_backward = T * 4 * D * s  # the video FFN hidden gradient (its weight gradient being made)
    #   the forward at the video output Linear: what the blocks keep, the streams' modulation rows and the output
    #   layers' embeddings, the text's bf16 copies, its shift / scale, its normed and modulated input (but where
    #   full fine-tuning keeps them without recipes), and the output itself (per-token timesteps make the rows as
    #   large as the stream)
    streams = 0 if n_ckpt else (rows_v * D * a + rows_a * Da * a  # (with checkpointing: in `kept`)
                                + (Lt * (D + Da) * s if bf16 and cfg.caption_proj_before_connector and not rc else 0))
    audio_head = 2 * Ta * 4 + Da * a + (2 * Da * a if rc else 2 * Ta * Da * a if full else 0)
    peaks = [(saved - loss - audio_head + streams + m * D * a + Da * a + 2 * m * D * a
              + (0 if full and not rc else 2 * T * D * a) + T * C * a) * B + weights]
    #   the output layers' backward: the prediction's, the LayerNorm's and the stream's gradients
    peaks.append((saved - loss + 4 * T * D * a + Ta * Da * a) * B + weights)
    # the backward of the last plain block (the output layers' done), and of the last checkpointed one, re-run
    # without recipes after the plain ones' (every block checkpointed: without the seam's recompute, counted as
    # with it) (with what of that block is freed by the end of its backward, where its modulation rows' gradient
    # is summed); a plain block with recipes recomputes its GELU output for the FFN's backward
    # (with recipes its first sum comes after the FFN's backward, the rest of the block still alive)
    backwards = [((saved - loss - heads) * B + weights, 0 if rc else block(layers == 1, False) * B, rc)] \
        if len(plain) else []
    if n_ckpt:
        backwards.append(((kept + outside - loss - heads + block(n_ckpt == 1, False)) * B + batch
                          + block_weights(n_ckpt == 1) + key_masks(), 0, False))
    for base, freed, recomputed in backwards:
        #   its video FFN: the streams' gradients and one hidden gradient (its weight's gradient being made)
        peaks.append(base + (grads + ffn_backward + (T * 4 * D * s if recomputed else 0)) * B)
        if full and per_token:  # its per-token modulation rows' gradient summed over its parts: the sum and an addend
            peaks.append(base - freed + (grads + 2 * m * cfg.modulation_rows * D * a) * B)
    parts = {"per_block": block(False, rc), "outside": outside, "per_batch": weights, "checkpointed_blocks": n_ckpt,
             "video_tokens": L, "audio_tokens": La, "text_tokens": Lt, "peaks": peaks}
    return Activations(saved=saved * B + weights, peak=max(peaks), parts=parts)


def audio_tokens_of(grid: tuple[int, int, int], fps: float, temporal: int = 8, per_second: float = 25.0) -> int:
    """Audio latent frames of a clip of `grid[0]` latent frames: (F' - 1) x 8 + 1 pixel frames at `fps`, 25
    audio latents a second (16 kHz, hop 160, 4x: the release's), rounded as the references round."""
    frames = (grid[0] - 1) * temporal + 1
    return max(1, round(frames / fps * per_second))
