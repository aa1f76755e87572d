"""Sequence parallelism (DeepSpeed-Ulysses) for the video DiT, applied through its one seam.

    rank layout (world W, sequence-parallel size N):   ranks [0..N-1] form sequence group 0,
    [N..2N-1] group 1, ...; dp_rank = rank // N. The N ranks of a group see the same batch.

    VideoDiT.forward with `model.seq_parallel = UlyssesSequenceParallel(group)`:
      tokens (B, L, D) -> split: pad L to Lp = N * ceil(L/N), keep rank r's rows   (B, Lp/N, D)
      RoPE rows (1, L, 1, Dh/2) and per-token e/e0 (B, L, ...) split the same way (true positions)
      each block's self-attention:
        q, k, v (B, Lp/N, H, Dh) -> all-to-all (scatter heads, gather tokens) -> (B, Lp, H/N, Dh)
        -> local attention over the whole sequence, padded keys masked -> (B, Lp, H/N, Dh)
        -> all-to-all back -> (B, Lp/N, H, Dh)
      cross-attention to the (replicated) text, FFN, modulation: local
      head output (B, Lp/N, C) -> gather: all-gather, drop the padding -> (B, L, C)

Gradients. Every rank of a group computes the same loss on the gathered output. The gather's
backward SUMS the N ranks' output gradients for this rank's rows (the adjoint of an all-gather), so
a rank's parameter gradient is N x the part its tokens contribute; DeepSpeed is handed no mpu and
averages over all W ranks, which divides that N back out: the update equals the data-parallel
(W/N ranks) update of the unsplit model. ZeRO partitions over all W ranks as before.

The replicated text of the joint-attention seam (a DiT attending over [video | text] at once, HunyuanVideo
1.5's double blocks) follows the same rule: every collective's backward is
its exact adjoint, so the N ranks' gradients of any parameter sum to N x the unsplit model's (the sum
over ranks of N identical losses). The head slice of the text q/k/v is a local narrow (adjoint: its
gradient zero-padded back to all heads, autograd's own), the text output's all-gather of heads has
all-reduce + narrow as backward (`_GatherTokens`). So rank r's text gradient holds only what flows
through its heads (times N, like its video tokens'), and DeepSpeed's average over the ranks is the
unsplit gradient. Giving each rank the *whole* text q/k/v gradient instead (an all-gather of the head
gradients as the narrow's backward) would count the text parameters N times over in that average.

Two token streams (a DiT generating sound with the picture, LTX-2: the class docstring of its DiT says the
contract): each stream's tokens are split on their own (`split(x, dim, stream)`, its padding recorded per
stream), and attention over them is the same Ulysses exchange, with q from one stream and k / v from the same
one (`self_attention`) or the other (`cross_modal_attention`): q, k, v each all-to-all'd (heads scattered,
tokens gathered), the key stream's padded keys masked, the output exchanged back to the query stream's rows.
Attention to the replicated text (`text_attention`) is local: every key is on every rank, and a rank's
queries are its own tokens, so its text parameters' gradient is N x its tokens' part, as above.

One packed sequence of several modalities (MiniMax H3: text, audio and video rows attending over one another):
one token stream to this layer; the DiT orders and pads its rows so that each rank's share holds a slice of
every modality, and hands `attention` a key mask of its rows (its padded rows False), all-gathered here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from video_dit.models.attention import attention, joint_attention


def model_heads(config) -> int:
    """The attention head count of a DiT config (the family contract's `num_heads`)."""
    heads = getattr(config, "num_heads", None)
    if heads is None:
        raise ValueError(f"{type(config).__name__} has no num_heads (families.contract.DiTShape): cannot split its heads")
    return heads


def valid_sizes(num_heads: int) -> list[int]:
    return [n for n in range(1, num_heads + 1) if num_heads % n == 0]


def check_heads(num_heads: int, sp_size: int, key: str = "deepspeed.sequence_parallel_size") -> None:
    """Ulysses gives each rank H/N whole heads: N must divide the number of attention heads."""
    if sp_size < 1 or num_heads % sp_size:
        raise ValueError(f"{key}={sp_size} does not divide the model's num_heads={num_heads} (Ulysses "
                         f"splits the heads over the sequence group); valid values: {valid_sizes(num_heads)}")


@dataclass(frozen=True)
class SPInfo:
    """This rank's place in the data-parallel x sequence-parallel grid."""

    group: object  # torch ProcessGroup of this rank's N sequence ranks (None when sp_size == 1)
    sp_rank: int
    sp_size: int
    dp_rank: int
    dp_size: int
    dp_group: object = None  # the ranks with this sp_rank, one per sequence group (None when sp_size == 1)


def init_sequence_parallel(sp_size: int) -> SPInfo:
    """Build the groups on an initialised process group (every rank must call this, same sp_size).
    Consecutive ranks form a sequence group, so a group sits on one node when N <= GPUs per node."""
    if not dist.is_initialized():
        raise RuntimeError("init_sequence_parallel needs torch.distributed initialised first "
                           "(deepspeed.init_distributed)")
    world, rank = dist.get_world_size(), dist.get_rank()
    if sp_size < 1 or world % sp_size:
        raise ValueError(f"deepspeed.sequence_parallel_size={sp_size} must divide the number of ranks "
                         f"({world}); valid values: {valid_sizes(world)}")
    if sp_size == 1:
        return SPInfo(None, 0, 1, rank, world, None)
    dp_size = world // sp_size
    group = dp_group = None
    # new_group is collective: every rank creates every group, in the same order.
    for g in range(dp_size):
        ranks = list(range(g * sp_size, (g + 1) * sp_size))
        pg = dist.new_group(ranks)
        if rank in ranks:
            group = pg
    for s in range(sp_size):
        ranks = list(range(s, world, sp_size))
        pg = dist.new_group(ranks)
        if rank in ranks:
            dp_group = pg
    return SPInfo(group, rank % sp_size, sp_size, rank // sp_size, dp_size, dp_group)


class _GatherTokens(torch.autograd.Function):
    """All-gather equal chunks along `dim`; backward: sum the ranks' gradients, keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group, rank: int, size: int) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.rank, ctx.size = dim, group, rank, size
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        # all_reduce + chunk rather than reduce_scatter: gloo has no reduce_scatter; the gathered
        # tensor is the DiT's small output (B, L, out_dim * patch), so the extra traffic is minor.
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=ctx.dim)[ctx.rank].contiguous(), None, None, None, None


def _all_to_all(x: torch.Tensor, scatter: int, gather: int, group, size: int) -> torch.Tensor:
    """x cut into N equal chunks along `scatter`, chunk j sent to rank j; the N chunks received (rank j's
    j-th) concatenated along `gather`. E.g. (B, Lp/N, H, Dh), scatter 2, gather 1 -> (B, Lp, H/N, Dh)."""
    send = torch.stack(x.chunk(size, dim=scatter))  # (N, *chunk): row j goes to rank j
    recv = torch.empty_like(send)  # (N, *chunk): row j comes from rank j
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather)  # gather dim N x the chunk's


class _Exchange(torch.autograd.Function):
    """The Ulysses all-to-all (`_all_to_all`); backward: the reverse all-to-all (its exact adjoint)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scatter: int, gather: int, group, size: int) -> torch.Tensor:
        ctx.scatter, ctx.gather, ctx.group, ctx.size = scatter, gather, group, size
        return _all_to_all(x, scatter, gather, group, size)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad.contiguous(), ctx.gather, ctx.scatter, ctx.group, ctx.size), None, None, None, None


class _RecomputedExchange(torch.autograd.Function):
    """exchange -> attention -> exchange back, saving only this rank's q, k, v for backward.

    Saving what the local attention saves (the exchanged q, k, v: full sequence, H/N heads) would
    keep two tensors per block more than a single process does: the DiT stores q/k only as recipes
    (recomputed from the q/k projections in backward), which cannot reach tensors made on the far
    side of an all-to-all. So backward redoes the exchange and the attention forward (one extra
    attention forward and q/k/v exchange per block: compute for memory, like block checkpointing)."""

    @staticmethod
    def forward(ctx, q, k, v, run, key_mask):
        ctx.run, ctx.key_mask = run, key_mask
        ctx.save_for_backward(q, k, v)  # the block's RecomputeSaved stores q and k as recipes
        with torch.no_grad():
            return run(q, k, v, key_mask)

    @staticmethod
    def backward(ctx, grad_out):
        inputs = [t.detach().requires_grad_() for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.run(*inputs, ctx.key_mask)
        grads = torch.autograd.grad(out, inputs, grad_out)
        return (*grads, None, None)


class UlyssesSequenceParallel:
    """The object a DiT's `seq_parallel` seam takes (see the module docstring): split / attention / gather
    (one token stream: Wan's `VideoDiT`), joint_attention (HunyuanVideo 1.5), and, for two token streams
    (LTX-2), split / gather by stream, self_attention, cross_modal_attention and text_attention.

    `split` records the token count L of the running forward (keyed by the local length, and the stream, so a
    checkpointed block recomputed in backward finds its own mask); attention masks keys >= L."""

    def __init__(self, group, backend: str = "native", recompute: bool = True):
        from deepspeed.sequence.layer import DistributedAttention

        self.group = group
        # recompute: backward redoes the exchange + attention forward instead of keeping the exchanged
        # q/k/v (see _RecomputedExchange); pointless under block checkpointing, which keeps nothing
        self.recompute = recompute
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # the local attention kernel, one of models/attention.py's BACKENDS; the key-masked calls of a padded
        # sequence go through SDPA whatever it is (the optional kernels take no mask)
        self.backend = backend
        self._valid: dict[tuple[str | None, int], int] = {}  # (stream, local length) -> true token count L
        # scatter_idx=2 (heads), gather_idx=1 (tokens) on (B, L, H, Dh); the local attention gets the
        # key mask through DistributedAttention's *args.
        self._attn = DistributedAttention(self._local_attention, group, scatter_idx=2, gather_idx=1)

    def _local_attention(self, q, k, v, key_mask):
        return attention(q, k, v, backend=self.backend, attn_mask=key_mask)

    def split(self, x: torch.Tensor, dim: int, stream: str | None = None) -> torch.Tensor:
        """This rank's chunk of x along `dim` (zero-padded to a multiple of N), a copy of its own. `stream`:
        which token stream x belongs to, for a DiT with more than one (None: the one stream)."""
        L = x.shape[dim]
        local = -(-L // self.size)
        self._valid[stream, local] = L
        pad = local * self.size - L
        if pad:
            x = F.pad(x, [0, 0] * (x.dim() - 1 - dim) + [0, pad])
        # clone: a view would keep the full padded tensor alive for as long as the chunk lives
        return x.narrow(dim, self.rank * local, local).clone()

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """q, k, v (B, L_local, H, Dh) of this rank's tokens -> (B, L_local, H, Dh), attending over all L.
        key_mask: (B, L_local) bool of this rank's rows (False: a key no query attends to, e.g. a padded text
        row of a packed sequence, MiniMax H3's), split as the rows were, or None (every real row a key)."""
        B, local, H, _ = q.shape
        check_heads(H, self.size)
        L = self._true_length(local)
        padded = None
        if L < local * self.size:  # padded tokens are never attended to
            padded = (torch.arange(local * self.size, device=q.device) < L).unsqueeze(0)  # (1, Lp)
        if key_mask is None:
            key_mask = padded
        else:
            key_mask = self._gather_mask(key_mask)  # (B, Lp)
            key_mask = key_mask if padded is None else key_mask & padded
        if self.recompute and torch.is_grad_enabled():
            return _RecomputedExchange.apply(q, k, v, self._exchange, key_mask)
        return self._exchange(q, k, v, key_mask)

    def _exchange(self, q, k, v, key_mask):
        return self._attn(q, k, v, 0, None, key_mask)

    def _gather_mask(self, key_mask: torch.Tensor) -> torch.Tensor:
        """(B, L_local) bool of this rank's rows -> (B, Lp) bool of every rank's, in rank order (no gradient;
        as uint8: gloo gathers no bool)."""
        local = key_mask.to(torch.uint8).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=1).bool()

    def _true_length(self, local: int, stream: str | None = None) -> int:
        """The token count L of the split that gave `local` tokens per rank (this forward's, of `stream`)."""
        if (stream, local) not in self._valid:
            of = "" if stream is None else f" of stream {stream!r}"
            raise RuntimeError(f"sequence-parallel attention on {local} local tokens{of}, but no split of that "
                               "length ran in this forward (the seam is used outside the DiT's forward?)")
        return self._valid[stream, local]

    def joint_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, txt_q: torch.Tensor,
                        txt_k: torch.Tensor, txt_v: torch.Tensor, txt_key_mask: torch.Tensor | None):
        """The joint-attention seam (a DiT's blocks attending over [video | text] at once, as HunyuanVideo 1.5's
        double blocks; the DiT's `seq_parallel` docstring says its contract): one attention over [all video |
        text] tokens. q, k, v (B, L_local, H, Dh) this rank's video tokens; txt_q, txt_k, txt_v (B, Lt, H, Dh)
        the text, the same on every rank; txt_key_mask (B, Lt) bool or None (all real) -> out (B, L_local, H, Dh),
        txt_out (B, Lt, H, Dh), the same on every rank. The local attention is the model's own
        (`models.attention.joint_attention`: its softmax scale, key order and backend), over the true L
        video tokens: the split's padded rows are dropped before it rather than masked (the same result).
        `recompute` does not apply: the block saves no q/k recipes, so nothing is kept twice."""
        B, local, H, Dh = q.shape
        check_heads(H, self.size)
        if txt_q.shape[2] != H:
            raise ValueError(f"joint_attention: the text has {txt_q.shape[2]} heads, the video {H}")
        L = self._true_length(local)
        h = H // self.size
        # scatter heads, gather tokens: rank r gets heads [r*h, (r+1)*h) of every token
        q, k, v = (_Exchange.apply(t, 2, 1, self.group, self.size)[:, :L] for t in (q, k, v))  # (B, L, h, Dh)
        # the same heads of the replicated text; a local narrow, whose adjoint (zero-padding the head
        # gradient back to all H heads) is autograd's: see the module docstring for why not an all-gather
        txt_q, txt_k, txt_v = (t.narrow(2, self.rank * h, h) for t in (txt_q, txt_k, txt_v))  # (B, Lt, h, Dh)
        out, txt_out = joint_attention(q, k, v, txt_q, txt_k, txt_v, txt_key_mask,
                                       self.backend)  # (B, L, h, Dh), (B, Lt, h, Dh)
        out = F.pad(out, [0, 0, 0, 0, 0, local * self.size - L])  # padded rows back (zero) -> (B, Lp, h, Dh)
        out = _Exchange.apply(out, 1, 2, self.group, self.size)  # scatter tokens, gather heads -> (B, L_local, H, Dh)
        txt_out = _GatherTokens.apply(txt_out, 2, self.group, self.rank, self.size)  # all heads -> (B, Lt, H, Dh)
        return out, txt_out

    def gather(self, x: torch.Tensor, dim: int, stream: str | None = None) -> torch.Tensor:
        """All ranks' chunks of x concatenated along `dim`, the padding dropped (autograd-correct); `stream`
        as `split`'s."""
        local = x.shape[dim]
        full = _GatherTokens.apply(x, dim, self.group, self.rank, self.size)
        return full.narrow(dim, 0, self._valid.get((stream, local), local * self.size))

    # ------------------------------------------------------------ two token streams (LTX-2's seam)

    def self_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, stream: str) -> torch.Tensor:
        """q, k, v (B, L_local, H, Dh) this rank's tokens of `stream` -> (B, L_local, H, Dh), each query
        attending over all L tokens of the stream (the Ulysses exchange, `_streams_attention`)."""
        return self._streams_attention(q, k, v, stream, stream)

    def cross_modal_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_stream: str,
                              kv_stream: str) -> torch.Tensor:
        """q (B, Lq_local, H, Dh) this rank's tokens of `q_stream`, k, v (B, Lk_local, H, Dh) this rank's of
        `kv_stream` -> (B, Lq_local, H, Dh), each query attending over all Lk tokens of `kv_stream`."""
        return self._streams_attention(q, k, v, q_stream, kv_stream)

    def text_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       key_mask: torch.Tensor | None) -> torch.Tensor:
        """q (B, L_local, H, Dh) this rank's tokens of a stream, k, v (B, Lt, H, Dh) the replicated text,
        key_mask (B, Lt) bool (False = padding) or None -> (B, L_local, H, Dh): local, every key is here."""
        return attention(q, k, v, backend=self.backend, attn_mask=key_mask)

    def _streams_attention(self, q, k, v, q_stream: str, kv_stream: str) -> torch.Tensor:
        B, local_q, H, _ = q.shape
        check_heads(H, self.size)
        self._true_length(local_q, q_stream)  # q's split ran in this forward (its padded rows are dropped later)
        local_k = k.shape[1]
        Lk = self._true_length(local_k, kv_stream)
        key_mask = None
        if Lk < local_k * self.size:  # the key stream's padded tokens are never attended to
            key_mask = (torch.arange(local_k * self.size, device=q.device) < Lk).unsqueeze(0)  # (1, Lk_p)
        if self.recompute and torch.is_grad_enabled():
            return _RecomputedExchange.apply(q, k, v, self._exchange_streams, key_mask)
        return self._exchange_streams(q, k, v, key_mask)

    def _exchange_streams(self, q, k, v, key_mask):
        """q (B, Lq_local, H, Dh), k, v (B, Lk_local, H, Dh) -> (B, Lq_local, H, Dh): scatter heads, gather
        tokens; local attention of this rank's H/N heads over every token; scatter tokens, gather heads."""
        q, k, v = (_Exchange.apply(t, 2, 1, self.group, self.size) for t in (q, k, v))  # (B, L*_p, H/N, Dh)
        out = attention(q, k, v, backend=self.backend, attn_mask=key_mask)  # (B, Lq_p, H/N, Dh)
        return _Exchange.apply(out, 1, 2, self.group, self.size)  # (B, Lq_local, H, Dh)


def attach(model, info: SPInfo, backend: str | None = None):
    """Set `model.seq_parallel` for this rank (None when sp_size == 1); checks heads % N first.
    `backend`: the local attention kernel; by default the one the model's self-attention is set to.
    Call after choosing block checkpointing (the seam recomputes attention only without it)."""
    if info.sp_size == 1:
        model.seq_parallel = None
        return model
    check_heads(model_heads(model.config), info.sp_size)
    if backend is None:
        backend = next((m.attention_backend for m in model.modules() if hasattr(m, "attention_backend")), "native")
    model.seq_parallel = UlyssesSequenceParallel(info.group, backend=backend,
                                                 recompute=not model.gradient_checkpointing)
    return model


def launch_env(rank: int, world: int, port: int) -> None:
    """The environment variables a rank started by hand (tests, benchmarks) needs for torch.distributed."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
