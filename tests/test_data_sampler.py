"""BucketBatchSampler: exactly-once epochs over 1/2/3 ranks, one shape per batch, exact resume
(same and different world size), determinism by (seed, epoch)."""

from __future__ import annotations

from collections import Counter

import pytest

from video_dit.data.sampler import BucketBatchSampler

# 4 buckets of uneven sizes (37 items); bucket id of index i is BUCKET_OF[i]
BUCKETS = {(17, 64, 64): list(range(0, 13)), (17, 48, 80): list(range(13, 20)),
           (1, 64, 64): list(range(20, 31)), (5, 32, 32): list(range(31, 37))}
BUCKET_OF = {i: k for k, v in BUCKETS.items() for i in v}
N = 37


def run_ranks(world_size, batch_size=3, seed=0, epoch=0, states=None, steps=None, **kw):
    """Per rank: the batches of one epoch (or of the first `steps` steps), and their states after."""
    out, samplers = [], []
    for r in range(world_size):
        s = BucketBatchSampler(BUCKETS, batch_size, world_size=world_size, rank=r, seed=seed, **kw)
        s.set_epoch(epoch)
        if states is not None:
            s.load_state_dict(states)
        remaining = len(s)
        it = iter(s)
        batches = [next(it) for _ in range(steps)] if steps is not None else list(it)
        assert steps is not None or len(batches) == remaining  # __len__ = what this __iter__ yields
        out.append(batches)
        samplers.append(s)
    return out, samplers


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_epoch_exactly_once_disjoint_one_shape(world_size):
    per_rank, samplers = run_ranks(world_size)
    lens = {len(b) for b in per_rank}
    assert len(lens) == 1 and lens == {len(samplers[0])} == {samplers[0].steps_per_epoch()}  # same steps
    seen = Counter(i for batches in per_rank for b in batches for i in b)
    assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}  # every item exactly once
    for batches in per_rank:
        for b in batches:
            assert 1 <= len(b) <= 3
            assert len({BUCKET_OF[i] for i in b}) == 1  # never mixes shapes
    assert samplers[0].padded == 0


def test_order_depends_on_seed_and_epoch_only():
    a, _ = run_ranks(1, seed=5, epoch=2)
    b, _ = run_ranks(1, seed=5, epoch=2)
    c, _ = run_ranks(1, seed=5, epoch=3)
    d, _ = run_ranks(1, seed=6, epoch=2)
    assert a == b and a != c and a != d
    # the global order is world-size independent: 2 ranks interleave the 1-rank sequence
    two, _ = run_ranks(2, seed=5, epoch=2)
    flat = [x for pair in zip(*two) for x in pair]
    full_rounds = len(a[0]) // 2 * 2  # the last, short round may be split across the ranks
    assert flat[:full_rounds] == a[0][:full_rounds]


@pytest.mark.parametrize("ws_before,ws_after", [(1, 1), (2, 2), (3, 3), (2, 1), (1, 2), (2, 3)])
def test_resume_mid_epoch_exact(ws_before, ws_after):
    full, _ = run_ranks(ws_after, epoch=1)
    first, samplers = run_ranks(ws_before, epoch=1, steps=2)
    states = [s.state_dict() for s in samplers]
    assert all(st == states[0] for st in states)  # every rank holds the same state
    rest, resumed = run_ranks(ws_after, epoch=1, states=states[0])
    seen = Counter(i for batches in first + rest for b in batches for i in b)
    assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}
    if ws_before == ws_after:  # same world size: the exact remaining sequence
        assert rest == [batches[2:] for batches in full]
    # after the epoch the sampler stands at the start of the next one
    assert resumed[0].state_dict()["epoch"] == 2 and resumed[0].state_dict()["position"] == 0


def test_state_with_consumed_batches_for_prefetching_loaders():
    s = BucketBatchSampler(BUCKETS, 3, world_size=2, rank=0, seed=1)
    it = iter(s)
    batches = [next(it) for _ in range(5)]  # a DataLoader prefetched 5, the trainer used 3
    st = s.state_dict(consumed_batches=3)
    assert st["position"] == 6
    t = BucketBatchSampler(BUCKETS, 3, world_size=2, rank=0, seed=1)
    t.load_state_dict(st)
    assert next(iter(t)) == batches[3]


def test_bad_state_is_refused():
    s = BucketBatchSampler(BUCKETS, 3, seed=1)
    st = s.state_dict()
    with pytest.raises(ValueError, match="batch_size"):
        BucketBatchSampler(BUCKETS, 4, seed=1).load_state_dict(st)
    with pytest.raises(ValueError, match="num_items"):
        BucketBatchSampler({(1, 16, 16): list(range(5))}, 3, seed=1).load_state_dict(st)


def test_final_round_split_and_padding():
    # 1 bucket of 5 items, batch 4: batches [4], [1] -> with 3 ranks the 4 is split so all 3 ranks step
    s = [BucketBatchSampler({(1, 16, 16): list(range(5))}, 4, world_size=3, rank=r) for r in range(3)]
    per_rank = [list(x) for x in s]
    assert [len(b) for b in per_rank] == [1, 1, 1]
    assert sorted(i for b in per_rank for i in b[0]) == list(range(5))
    # 2 items over 3 ranks: one rank repeats an item (documented), counted in `padded`
    s = [BucketBatchSampler({(1, 16, 16): [0, 1]}, 1, world_size=3, rank=r) for r in range(3)]
    items = [i for x in s for b in x for i in b]
    assert sorted(set(items)) == [0, 1] and len(items) == 3 and s[0].padded == 1
    # drop_last drops the smaller batches and the short final round instead
    s = [BucketBatchSampler(BUCKETS, 3, world_size=2, rank=r, drop_last=True) for r in range(2)]
    per_rank = [list(x) for x in s]
    assert len(per_rank[0]) == len(per_rank[1]) and all(len(b) == 3 for x in per_rank for b in x)


def test_accepts_items_and_lists():
    class It:
        def __init__(self, bucket):
            self.bucket = bucket
    items = [It((1, 16, 16)), It((5, 16, 16)), It((1, 16, 16))]
    s = BucketBatchSampler(items, 2)
    assert sorted(map(sorted, s)) == [[0, 2], [1]]
    assert sorted(map(sorted, BucketBatchSampler([[0, 2], [1]], 2))) == [[0, 2], [1]]
