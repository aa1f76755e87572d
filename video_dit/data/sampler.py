"""A deterministic, resumable, world-size-independent bucket batch sampler.

Epoch e has ONE global batch order, a function of (seed, e) and the buckets only:
  1. each bucket's indices are shuffled and cut into batches of `batch_size` (a bucket's last,
     smaller batch is kept, or dropped with `drop_last`), so a batch never mixes shapes;
  2. all batches of all buckets are shuffled together.
Step s of a run that started at global position p0 gives rank r the batch at `p0 + s*world_size + r`;
the state is just (epoch, position in that global order), so a checkpoint taken with 2 ranks resumes
with 1 or 3 ranks without repeating or skipping an item.

Every rank must take the same number of steps (each step is a collective). When the epoch's last
round holds fewer batches than ranks, its batches are split (halves of the largest, same shape) until
every rank has one; only if that round has fewer ITEMS than ranks do the missing ranks repeat an item
of that round (counted in `padded`); `drop_last=True` drops that short round instead.
"""

from __future__ import annotations

import random
from typing import Any, Iterator


def _groups(buckets: Any) -> list[list[int]]:
    """Normalize the accepted inputs to a list of index lists in a deterministic order."""
    if hasattr(buckets, "buckets") and not isinstance(buckets, (dict, list, tuple)):
        buckets = buckets.buckets  # a CachedDataset
    if isinstance(buckets, dict):
        return [list(buckets[k]) for k in sorted(buckets)]
    buckets = list(buckets)
    if buckets and all(hasattr(it, "bucket") for it in buckets):  # items: group by their bucket
        by: dict = {}
        for i, it in enumerate(buckets):
            by.setdefault(tuple(it.bucket), []).append(i)
        return [by[k] for k in sorted(by)]
    return [list(g) for g in buckets]


class BucketBatchSampler:
    """Lists of dataset indices, one bucket per batch; see the module docstring.

    `buckets`: `{key: [indices]}`, a list of index lists, a list of items with `.bucket`, or any
    object with a `.buckets` dict (a `CachedDataset`). Use as a DataLoader's `batch_sampler`, and
    call `set_epoch(e)` before iterating each epoch (and `CachedDataset.set_epoch(e)` too).
    """

    def __init__(self, buckets: Any, batch_size: int, world_size: int = 1, rank: int = 0, seed: int = 0,
                 drop_last: bool = False, shuffle: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.groups = [g for g in _groups(buckets) if g]
        if not self.groups:
            raise ValueError("no items to sample from")
        all_idx = [i for g in self.groups for i in g]
        if len(set(all_idx)) != len(all_idx):
            raise ValueError("an index appears in more than one bucket")
        self.batch_size, self.world_size, self.rank = batch_size, world_size, rank
        self.seed, self.drop_last, self.shuffle = seed, drop_last, shuffle
        self.epoch = 0
        self.position = 0       # global batches of this epoch's order already handed out
        self.padded = 0         # items repeated in the last epoch's final round (see module docstring)
        self._iter_epoch, self._iter_start = 0, 0

    # ---- the epoch's global order (depends on seed, epoch and buckets only)
    def global_batches(self, epoch: int | None = None) -> list[list[int]]:
        epoch = self.epoch if epoch is None else epoch
        rng = random.Random(f"bucket-sampler:{self.seed}:{epoch}")
        batches = []
        for g in self.groups:
            g = list(g)
            if self.shuffle:
                rng.shuffle(g)
            for i in range(0, len(g), self.batch_size):
                b = g[i:i + self.batch_size]
                if len(b) == self.batch_size or not self.drop_last:
                    batches.append(b)
        if self.shuffle:
            rng.shuffle(batches)
        return batches

    def _final_round(self, tail: list[list[int]]) -> tuple[list[list[int]] | None, int]:
        """The last round's batches made `world_size` long, and how many items were repeated to do
        it (None: the round is dropped, with drop_last)."""
        if self.drop_last:
            return None, 0
        tail = [list(b) for b in tail]
        while len(tail) < self.world_size:
            j = max(range(len(tail)), key=lambda k: (len(tail[k]), -k))
            if len(tail[j]) < 2:
                break
            b = tail[j]
            tail[j:j + 1] = [b[:len(b) // 2], b[len(b) // 2:]]  # same bucket, so same shape
        padded = self.world_size - len(tail)
        for k in range(padded):  # fewer items than ranks: repeat some
            tail.append(list(tail[k % len(tail)][:1]))
        return tail, padded

    def _rounds(self, epoch: int, start: int) -> tuple[list[list[list[int]]], int]:
        batches = self.global_batches(epoch)[start:]
        ws = self.world_size
        full = len(batches) // ws * ws
        rounds = [batches[i:i + ws] for i in range(0, full, ws)]
        padded = 0
        if full < len(batches):
            last, padded = self._final_round(batches[full:])
            if last is not None:
                rounds.append(last)
        return rounds, padded

    def steps_per_epoch(self) -> int:
        """Batches one rank takes over a whole epoch (from position 0)."""
        return len(self._rounds(self.epoch, 0)[0])

    def __len__(self) -> int:
        """Batches the next `__iter__` yields on this rank (the rest of the epoch after a resume)."""
        return len(self._rounds(self.epoch, self.position)[0])

    def __iter__(self) -> Iterator[list[int]]:
        epoch, start = self.epoch, self.position
        self._iter_epoch, self._iter_start = epoch, start
        rounds, self.padded = self._rounds(epoch, start)
        n_global = len(self.global_batches(epoch))
        for s, rnd in enumerate(rounds):
            self.position = min(start + (s + 1) * self.world_size, n_global)
            yield rnd[self.rank]
        # epoch finished: the next iteration is the next epoch unless set_epoch says otherwise
        self.epoch, self.position = epoch + 1, 0

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning, unless the sampler already stands in that epoch (after
        `load_state_dict`, or after the previous epoch ran to its end): then its position is kept."""
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    # ---- resume
    def state_dict(self, consumed_batches: int | None = None) -> dict:
        """World-size-independent state. Position counts the batches `__iter__` handed out; a
        DataLoader with workers prefetches, so pass `consumed_batches` (batches THIS rank trained on
        since the current `__iter__` began) to record what was really used."""
        epoch, position = self.epoch, self.position
        if consumed_batches is not None:
            epoch = self._iter_epoch
            position = self._iter_start + consumed_batches * self.world_size
            if position >= len(self.global_batches(epoch)):
                epoch, position = epoch + 1, 0
        return {"epoch": epoch, "position": position, "seed": self.seed, "batch_size": self.batch_size,
                "drop_last": self.drop_last, "num_batches": len(self.global_batches(epoch)),
                "num_items": sum(len(g) for g in self.groups)}

    def load_state_dict(self, state: dict) -> None:
        mine = {"seed": self.seed, "batch_size": self.batch_size, "drop_last": self.drop_last,
                "num_items": sum(len(g) for g in self.groups)}
        for key, value in mine.items():
            if state.get(key) != value:
                raise ValueError(f"sampler state has {key}={state.get(key)!r} but this sampler has {value!r}; "
                                 f"the dataset or the batch settings changed since the checkpoint")
        n = len(self.global_batches(state["epoch"]))
        if not 0 <= state["position"] <= n:
            raise ValueError(f"sampler state position {state['position']} is outside [0, {n}]")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        if self.position == n:
            self.epoch, self.position = self.epoch + 1, 0
