"""Exponential moving average (EMA) of the trainable weights, partitioned like them.

    ema <- decay * ema + (1 - decay) * w        after every optimizer step, in float32

`w` is what the model runs with on this rank: under ZeRO-3 the parameter's local partition
`p.ds_tensor` (DeepSpeed flattens each parameter, pads it to a multiple of the partition group and
gives rank r the r-th slice), so each rank averages only its own 1/N; under ZeRO 0-2 every rank
holds the whole parameter, so every rank keeps the same whole average. With LoRA only the adapters
are trainable, so only they are averaged. In bf16 training `w` is the bf16 weight the forward uses
(not the optimizer's fp32 master copy); on CPU ranks both are the same fp32 tensor.

`swapped_in()` puts the average into the model for previews, validation and exports (every rank
must enter it under ZeRO-3) and restores the raw weights bit for bit afterwards. `save(folder)` /
`load(folder)` keep it in a checkpoint exactly, also across world sizes and ZeRO stages: each rank
writes its partitions (ZeRO-3) or rank 0 the whole tensors (ZeRO 0-2), with the layout in the
metadata; loading reassembles each parameter from whatever layout was saved and keeps this rank's
slice.
"""

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from video_dit.parallel.zero import partitioned

FOLDER = "ema"  # inside a checkpoint folder


def _part_file(rank: int) -> str:
    return f"rank_{rank:05d}.safetensors"


class EMA:
    """EMA of `module`'s trainable parameters (those with requires_grad) after `deepspeed.initialize`."""

    def __init__(self, module: torch.nn.Module, decay: float, zero_stage: int):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay, self.zero3 = float(decay), partitioned(zero_stage)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("EMA: the model has no trainable parameters")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.shadow = [self._local(p).detach().float().clone() for p in self.params]

    # ---------------------------------------------------------------- the partition layout
    def _local(self, p: torch.nn.Parameter) -> torch.Tensor:
        """This rank's tensor of `p`: its ZeRO-3 partition (1-D, padded) or the whole parameter."""
        return p.ds_tensor if self.zero3 else p.data

    @staticmethod
    def _group(p):
        return getattr(p, "ds_process_group", None)

    def _full(self, i: int) -> torch.Tensor:
        """The whole average of parameter i (shaped like it). Under ZeRO-3 a collective over its
        partition group (every rank must call, in the same order)."""
        s = self.shadow[i]
        if not self.zero3:
            return s
        p = self.params[i]
        group = self._group(p)
        parts = [torch.empty_like(s) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, s, group=group)
        return torch.cat(parts)[:p.ds_numel].view(p.ds_shape)

    def _slice(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the whole tensor `full` of parameter i, in the current layout."""
        if not self.zero3:
            return full.float().reshape(self.shadow[i].shape).clone()
        p, n = self.params[i], self.shadow[i].numel()
        r = dist.get_rank(self._group(p))
        flat = full.float().reshape(-1)
        out = torch.zeros(n, dtype=torch.float32)
        piece = flat[r * n:(r + 1) * n]
        out[:piece.numel()] = piece
        return out.to(self.shadow[i].device)

    # ---------------------------------------------------------------- the average
    @torch.no_grad()
    def update(self) -> None:
        """One EMA step from the current weights (call after each optimizer step)."""
        d = self.decay
        for s, p in zip(self.shadow, self.params):
            s.mul_(d).add_(self._local(p).float(), alpha=1.0 - d)

    @contextmanager
    def swapped_in(self):
        """The model runs with the average inside the block; the raw weights come back exactly.
        Under ZeRO-3 a parameter that is currently gathered (a persistent small one) gets its whole
        average too, so the forward and DeepSpeed's gathers both see the EMA."""
        backups = []
        with torch.no_grad():
            for i, (s, p) in enumerate(zip(self.shadow, self.params)):
                local = self._local(p)
                full = None
                if self.zero3 and p.data.numel() == p.ds_numel:  # available: the forward reads p.data
                    full = (p.data.clone(), self._full(i))
                backups.append((local.clone(), None if full is None else full[0]))
                local.copy_(s)
                if full is not None:
                    p.data.copy_(full[1])
        try:
            yield
        finally:
            with torch.no_grad():
                for (local, whole), p in zip(backups, self.params):
                    self._local(p).copy_(local)
                    if whole is not None:
                        p.data.copy_(whole)

    # ---------------------------------------------------------------- checkpoints
    def save(self, folder: Path) -> None:
        """Write the average into `<folder>/ema/` (every rank calls; ZeRO-3: one file per rank)."""
        rank = dist.get_rank()
        out = Path(folder) / FOLDER
        if rank == 0 or self.zero3:
            out.mkdir(parents=True, exist_ok=True)
        meta = {"layout": "partitioned" if self.zero3 else "full", "world_size": str(dist.get_world_size()),
                "decay": repr(self.decay), "names": json.dumps(self.names)}
        if self.zero3:
            meta["numel"] = json.dumps([int(p.ds_numel) for p in self.params])
            meta["shapes"] = json.dumps([list(p.ds_shape) for p in self.params])
            tensors = {n: s.detach().cpu().contiguous() for n, s in zip(self.names, self.shadow)}
            save_file(tensors, str(out / _part_file(dist.get_rank(self._group(self.params[0])))), metadata=meta)
        elif rank == 0:
            tensors = {n: s.detach().cpu().contiguous() for n, s in zip(self.names, self.shadow)}
            save_file(tensors, str(out / _part_file(0)), metadata=meta)

    def load(self, folder: Path) -> bool:
        """Read `<folder>/ema/` written by `save` with any world size or ZeRO stage; False (and the
        average left as it is) when the folder has none. Raises ValueError when it does not hold
        this model's trainable parameters."""
        src = Path(folder) / FOLDER
        files = sorted(src.glob("rank_*.safetensors")) if src.is_dir() else []
        if not files:
            return False
        with safe_open(str(files[0]), "pt") as f:
            meta = f.metadata() or {}
        names = json.loads(meta.get("names", "[]"))
        if sorted(names) != sorted(self.names):
            missing = sorted(set(self.names) - set(names))[:3]
            raise ValueError(f"{src}: the saved EMA does not match this model's trainable parameters "
                             f"(first missing: {missing})")
        if meta["layout"] == "full":
            with safe_open(str(files[0]), "pt") as f:
                wholes = {n: f.get_tensor(n) for n in self.names}
        else:  # partitions of `world_size` ranks: concatenate, drop the padding, reshape
            world = int(meta["world_size"])
            if len(files) != world:
                raise ValueError(f"{src}: {len(files)} partition files for a world size of {world}")
            numel = dict(zip(names, json.loads(meta["numel"])))
            shapes = dict(zip(names, json.loads(meta["shapes"])))
            wholes = {}
            with ExitStack() as stack:
                handles = [stack.enter_context(safe_open(str(f), "pt")) for f in files]
                for n in self.names:
                    flat = torch.cat([h.get_tensor(n) for h in handles])[:numel[n]]
                    wholes[n] = flat.view(shapes[n])
        self.shadow = [self._slice(i, wholes[n]) for i, n in enumerate(self.names)]
        return True


__all__ = ["EMA", "FOLDER"]
