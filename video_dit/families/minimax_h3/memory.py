"""Activation memory of the MiniMax H3 DiT in one training step, per rank: what `dit.py` and `layers.py` make
autograd keep, op by op (the plan's other terms, parameters and DeepSpeed's state, are the family-blind ones of
`plan.py`). Checked to the byte against `CPUAllocationTracker` (tests/test_plan_h3.py: full and LoRA, fp32 and the
bf16 of a GPU job, no / the first / every block checkpointed, padded and unpadded text, batches of 1 and 2), the
step's peak within 10% (planned / measured 0.996-1.024; the released widths / 32 too); under Ulysses sequence
parallelism 2 on 2 CPU ranks over gloo, each rank's to the byte (tests/test_plan_h3_sp.py, the same settings, the
peak 0.943-1.021: a run's peak moves by ~3%, gloo's thread letting go of a collective's tensors late); a
first-frame step (the keyframe's rows, a caption presenting it) at SP 1 too. Not yet measured: keyframe rows under
SP (their rows and runs per rank are checked against `packing.rank_order`), SP above 2, and anything against a
GPU's allocator.

Notation as in `plan.py`: s bytes of the compute dtype, a = max(s, 4) the float32 islands (the residual stream,
RMSNorms, AdaLN arithmetic, RoPE, the final layer), w the compute-dtype copy autocast makes of a float32
trainable weight at each call (s in bf16, 0 in fp32); B micro-batch. The packed sequence (packing.py) has N = Lt
+ K h'w' + S T + F' h'w' rows (text, keyframes, audio, video); a rank holds n = the sum over these segments of
ceil(segment / sp) (`packing.rank_order`: each segment cut into sp chunks, the last ones zero-padded), Np = n sp;
D hidden, I = heads x head_dim (wider than D), H heads, R rotated channels, Fd the SwiGLU width, Te the timestep
embedding, C = patch_dim, Ca the audio latent channels, G timestep groups (2, 3 with keyframes), E the runs of
rows sharing one AdaLN entry on the rank (3: text, audio, video; under SP a padded chunk's rows take video's
entry: rank 1 of 7 text rows at SP 2 has 4), r the LoRA rank. CPU SDPA (flash) keeps q, k, v, its output (laid
out (B, n, H, Dh): the output projection reads it without a copy) and its logsumexp; a padded caption adds the
float key mask it makes of the bool one (n s per attention).

One plain block (`layers.Block`) keeps, per sample:
  norm1          its input x n D a, rstd n 4; full: its output n D a (the scale's gradient; LoRA: no gradient
                 reaches the AdaLN rows, so addcmul keeps only (1 + scale))
  modulate       (1 + scale) per run E D a; the modulated rows cast, h n D s (qkv's, or lora_A's, input)
  AdaLN table    (4 entries, 6 D) a (the gates are views of it); full bf16: temb cast G Te w (the projection's
                 input; its bias copy is not kept)
  attention      qkv's output 3 n I s (kept whole: q_norm / k_norm keep their views, SDPA keeps v), the norms'
                 rstd 2 n H 4, q and k rotated (and cast) 2 n I s (the rotation keeps only the cos / sin tables),
                 SDPA's output n I s and logsumexp n H 4; full: out_proj's output n D s (the gate's gradient)
  residual       the gated sum's cat n D a (norm2's input), rstd n 4; full: norm2's output n D a
  modulate       (1 + scale) E D a, h2 n D s
  MLP            fc1's output 2 n Fd s (SiLU keeps the gate half, the product the value half), SiLU's output
                 n Fd s, the product n Fd s (fc2's input); full: fc2's output n D s
  LoRA           each adapter's lora_A output 4 x n r s (qkv, out_proj, fc1, fc2); LoRA's first block: no input
                 x, rstd, (1 + scale1) (its input needs no gradient)
  weight copies  (bf16) full (4 I D + 3 Fd D + Te 18 D) w; LoRA r (in + out) w per adapter, without qkv's
                 lora_A copy in the first block (its input needs no gradient)
A checkpointed block keeps its input n D a (and LoRA, once, temb G Te 4 and a padded caption's bool key mask
B n, the checkpoints' arguments kept nowhere else).
Sequence parallelism (`parallel.sequence.UlyssesSequenceParallel.attention`, the one seam): the blocks keep what
they keep at SP 1 on their n rows but for the attention's core. Unless every block is checkpointed the seam
recomputes its exchange and attention in backward (`_RecomputedExchange`): it saves this rank's q, k, v (the
tensors above, no copy), its output is out_proj's input as SDPA's was, and neither SDPA's logsumexp nor its float
key mask is kept; instead each block's node holds the gathered bool key mask B Np (with padded text or padded
chunks: a key mask exists), checkpointed blocks too (an attribute of the node, not a saved tensor). Every block
checkpointed: the seam runs under the checkpoint with autograd, nothing of it kept. With a key mask and
checkpointing, the local mask B n is a checkpoint argument. The RoPE tables and the rows' entries are split (n
rows); the final layer's output is gathered (B, Np, C + Ca) and restored to (B, N, ...): a peak term only.
Outside the blocks, per sample: the final layer's norm input n D a, rstd n 4, (1 + scale) E D a (full: the
norm's output and the modulated rows, the heads' input, 2 n D a); the loss's differences (the whole prediction)
F'h'w' C a + S T Ca a; full: the text refiner's blocks Lt (D (2a + 2s) + 8 + 6 I s + 12 H + 4 Fd s) each (the
block's keeps without AdaLN, RoPE, gated outputs; + Lt s with a padded caption), its final norm Lt D a + Lt 4,
condition_proj's cast input Lt text_dim s (bf16), the patch projections' inputs (K + F') h'w' C 4 + S T Ca 4,
the timestep MLP G (freq 4 + 2 hidden 4 + 2 Te 4); bf16, the refiner's weight copies (4 I D + 3 Fd D) w each.
Per batch: the RoPE tables 2 n R 4 (per sample with a padded caption: each sample's clock starts at its length).

The peak (traced), the highest of: the forward's end, in the final layer: what the forward leaves but the loss's
differences, `_forward`'s locals (the refiner's output Lt D a, the patch projections' outputs (K h'w' + F'h'w' +
S T) D a, the rotary coordinates N 3 8 and entries N 8 (n 8 under SP), the final AdaLN rows and table (G + 4) 2
D a; LoRA: the patchified video and temb) and the larger of its modulation (full n D a, LoRA 3 n D a), its heads
(2 n (C + Ca) a, LoRA + n D a) and, under SP, the gathered output (n + 2 Np) (C + Ca) a; with checkpointing,
the last checkpointed block's backward after the plain blocks': the checkpoints, the embeddings' tensors, the
re-run block with its weight copies (under SP with every block checkpointed, its seam under autograd: the
exchanged attention's output n I s, logsumexp n H 4 and float key mask) and the stream's gradient with its
addends 4 n D a. Released 480p / 720p
clips sit far above these tiny sizes: there the saved bytes dominate.
"""

from __future__ import annotations

import math

from video_dit.families.minimax_h3.dit_config import MODALITIES
from video_dit.families.minimax_h3.packing import E_AUDIO, E_KEYFRAME, E_TEXT, E_VIDEO
from video_dit.models.activation_terms import Activations, Setting, checkpointed_count, float32_bytes, weight_copy_bytes

# The caption length the plan assumes: MiniMax's prompts are paragraphs (its Context-IR prompts, hundreds to a
# few thousand tokens); ai-toolkit's H3 trainer caps a caption at 512 tokens (`max_text_length`), the figure here.
PLAN_TEXT_TOKENS = 512
SEGMENTS = ("text", "keyframe", "audio", "video")  # the packed order (packing.py)


def h3_rows(cfg, grid: tuple[int, int, int], text_len: int, audio_frames: int, keyframes: int = 0) -> dict[str, int]:
    """The packed sequence's rows of a clip of latent grid (F', h, w): text, keyframe, audio, video, all."""
    pt, ph, pw = cfg.patch_size
    frame = (grid[1] // ph) * (grid[2] // pw)
    rows = {"text": text_len, "keyframe": keyframes * frame, "audio": cfg.audio_channels * audio_frames,
            "video": (grid[0] // pt) * frame}
    rows["all"] = sum(rows.values())
    return rows


def h3_activation_bytes(cfg, grid: tuple[int, int, int], setting: Setting, *, lora_rank: int | None, s: int,
                        text_len: int, audio_frames: int, keyframes: int = 0, text_masked: bool = False,
                        rank: int | None = None, presented: bool = False) -> Activations:
    """What one forward of the H3 DiT `cfg` leaves for backward on one rank, and the step's peak, for video
    latents of `grid` (F', h, w) with `audio_frames` audio latents per channel, `text_len` text rows (padded in
    some sample: `text_masked`) and `keyframes` keyframe latent frames (every term: the module docstring). Under
    sequence parallelism the ranks' shares differ only in their runs of AdaLN entries (a padded chunk's rows take
    video's entry): `rank` None plans the rank with the most, an int that rank of the `setting.sp`. `presented`: the
    caption presents a keyframe (a first-frame job: its label, vision block and caption, three runs of entries)."""
    rows = h3_rows(cfg, grid, text_len, audio_frames, keyframes)
    N, B, Lt = rows["all"], setting.micro_batch, text_len
    sp = setting.sp
    segments = [rows[k] for k in SEGMENTS]
    n = sum(math.ceil(m / sp) for m in segments)  # this rank's rows (`packing.rank_order`: padding included)
    Np = n * sp  # the reordered sequence, every rank's rows
    D, I, H, Fd, Te, R = cfg.hidden_size, cfg.inner_dim, cfg.num_heads, cfg.ffn_dim, cfg.time_embed_dim, cfg.rotary_dim
    C, Ca = cfg.patch_dim, cfg.audio_in_channels
    a, w = float32_bytes(s), weight_copy_bytes(s)
    full, r = not lora_rank, lora_rank or 0
    G = 3 if keyframes else 2
    E = _runs(rows, sp, rank, presented)
    layers = cfg.num_layers
    n_ckpt = checkpointed_count(setting, layers)
    # the seam recomputes its exchange + attention in backward unless every block is checkpointed (`attach`)
    recompute = sp > 1 and n_ckpt < layers
    key_mask = text_masked or Np > N  # a key mask reaches the attentions: padded text or padded rank chunks
    # per attention: SDPA's float key mask (bool -> the query's dtype) at SP 1; through the seam, the gathered
    # bool key mask of all Np rows its recomputed exchange holds, and no logsumexp (its attention ran without grad)
    mask = (Np if key_mask else 0) if sp > 1 else (n * s if text_masked else 0)
    lse = 0 if sp > 1 else n * H * 4

    def block(first: bool) -> int:
        """Bytes one plain block keeps, per sample (`first`: LoRA's first block, whose input needs no gradient)."""
        kept = (n * D * s + 3 * n * I * s + 2 * n * H * 4 + 2 * n * I * s + n * I * s + lse + mask
                + n * D * a + n * 4 + E * D * a + n * D * s + 4 * n * Fd * s  # the residual, norm2, MLP
                + 4 * 6 * D * a)  # the AdaLN table (its gates kept)
        if not (first and not full):
            kept += n * D * a + n * 4 + E * D * a  # the input x and norm1's rstd, (1 + scale1)
        if full:
            kept += 2 * n * D * a + 2 * n * D * s + G * Te * w  # the normed x (x2), out_proj / fc2 outputs, temb copy
        else:
            kept += 4 * n * r * s  # the lora_A outputs
        return kept

    def block_weights(first: bool) -> int:
        """The weight copies one plain block's matmuls keep (bf16; `first` as `block`'s)."""
        if full:
            return (4 * I * D + 3 * Fd * D + Te * 6 * MODALITIES * D) * w
        return r * ((0 if first else D) + 3 * I + (I + D) + (D + 2 * Fd) + (Fd + D)) * w

    # outside the blocks, per sample: the final layer's, the loss's and (full) the text path's and embeddings'
    final = n * D * a + n * 4 + E * D * a  # the final norm's input and rstd, (1 + scale)
    if full:
        final += 2 * n * D * a  # the final norm's output, the modulated rows (the heads' input)
    loss = rows["video"] * C * a + rows["audio"] * Ca * a  # the loss's differences (the whole prediction)
    embed = 0
    if full:
        refiner = Lt * (D * (2 * a + 2 * s) + 8 + 6 * I * s + 3 * H * 4 + 4 * Fd * s) + (Lt * s if text_masked else 0)
        embed += cfg.num_refiner_layers * refiner + Lt * D * a + Lt * 4  # + the refiner's final norm
        embed += Lt * cfg.text_dim * (s if s < 4 else 0)  # condition_proj's input, cast
        embed += (rows["video"] + rows["keyframe"]) * C * 4 + rows["audio"] * Ca * 4  # the patch projections' inputs
        embed += G * (cfg.freq_dim * 4 + 2 * cfg.time_embed_hidden_dim * 4 + 2 * Te * 4)  # the timestep MLP
    elif n_ckpt:
        embed += G * Te * 4  # the checkpoints' argument temb (LoRA keeps it nowhere else)
    per_batch = 2 * n * R * 4 * (B if text_masked else 1)  # the RoPE tables (per sample: each text length's clock)
    if key_mask and n_ckpt:
        per_batch += B * n  # the bool key mask, a checkpoint argument
    if key_mask and recompute:
        per_batch += n_ckpt * B * Np  # a checkpointed block's seam: its gathered key mask (an autograd node's)
    refiner_weights = cfg.num_refiner_layers * (4 * I * D + 3 * Fd * D) * w if full else 0
    plain = range(n_ckpt, layers)
    kept = n_ckpt * n * D * a  # the checkpointed blocks' inputs
    saved = sum(block(i == 0) for i in plain) + kept + final + loss + embed
    weights = refiner_weights + sum(block_weights(i == 0) for i in plain)
    total = saved * B + per_batch + weights

    # The peak, the highest of:
    #   the forward's end, in the final layer: what the forward leaves but the loss's differences, the forward's
    #   locals (the refiner's output, the patch projections' outputs, LoRA: the patchified video and temb, the
    #   rotary coordinates (float64), the rows' entries (int64), the final AdaLN rows and table), and either its
    #   modulation (full: its parts, LoRA: the norm's output, its parts, their cat) or its heads (their outputs,
    #   their cat; LoRA: the modulated rows)
    locals_ = (Lt * D * a + (rows["video"] + rows["keyframe"]) * D * a + rows["audio"] * D * a + G * 4
               + G * 2 * D * a + 4 * 2 * D * a)
    if not full:
        locals_ += (rows["video"] + rows["keyframe"]) * C * 4 + (0 if n_ckpt else G * Te * 4)
    coords = (B if text_masked else 1) * N * 3 * 8 + (N if sp == 1 else n) * 8
    heads = 2 * n * (C + Ca) * a
    moment = max(n * D * a if full else 3 * n * D * a, heads + (0 if full else n * D * a))
    if sp > 1:  # the output gathered: this rank's, every rank's (the all-gather's parts, their cat), restored
        moment = max(moment, (n + 2 * Np) * (C + Ca) * a)
    peaks = [(saved - loss + locals_ + moment) * B + per_batch + weights + coords]
    #   the backward of the last checkpointed block, re-run after the plain blocks' backward: the checkpoints, the
    #   embeddings' tensors, the re-run block and its weight copies, the stream's gradient and its addends
    if n_ckpt:
        rerun = block(n_ckpt == 1)
        if sp > 1 and not recompute:  # the seam under autograd: the exchanged SDPA's output, logsumexp, float mask
            rerun += n * I * s + n * H * 4 + (Np * (s - 1) if key_mask else 0)
        peaks.append((kept + embed + rerun + 4 * n * D * a) * B + per_batch + block_weights(n_ckpt == 1)
                     + refiner_weights)
    parts = {"per_block": block(False), "final": final, "loss": loss, "embeddings": embed, "weights": weights,
             "per_batch": per_batch, "checkpointed_blocks": n_ckpt, "rows": rows, "rows_per_rank": n, "runs": E,
             "peaks": peaks}
    return Activations(saved=total, peak=max(peaks), parts=parts)


def _runs(rows: dict[str, int], sp: int, rank: int | None = None, presented: bool = False) -> int:
    """The most runs of rows sharing one AdaLN entry on one rank (`packing.row_runs` of its share of
    `packing.rank_order`): each segment's chunk (text, keyframes, audio, video: one entry each, the text taken as
    text-tagged), a padded chunk's zero rows taking entry 0 (video's, `RankOrder.reorder`), adjacent equal entries
    one run; the largest count over the ranks, or `rank`'s. A `presented` caption (a keyframe's label, its vision
    block tagged as video, the caption) is three runs in its chunk: exact at SP 1; under SP a rank's text chunk may
    hold fewer (at most two runs, 2 D a bytes a modulation, over)."""
    if rank is not None and not 0 <= rank < sp:
        raise ValueError(f"rank={rank}: not a rank of sequence-parallel degree {sp} (0..{sp - 1})")
    most = 0
    for r in range(sp) if rank is None else (rank,):
        entries = []
        for k, entry in zip(SEGMENTS, (E_TEXT, E_KEYFRAME, E_AUDIO, E_VIDEO)):
            per = math.ceil(rows[k] / sp)
            real = min(rows[k], (r + 1) * per) - min(rows[k], r * per)
            held = [E_TEXT, E_VIDEO, E_TEXT] if k == "text" and presented else [entry]
            entries += held * (real > 0) + [E_VIDEO] * (per > real)
        most = max(most, sum(1 for i, e in enumerate(entries) if i == 0 or e != entries[i - 1]))
    return most
