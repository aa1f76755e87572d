"""`CPUAllocationTracker` (video_dit/parallel/memory.py), the instrument every "the memory plan equals what
autograd keeps" test reads, against tensors of known size: a new storage counts its bytes from the op that
makes it until it is freed; views, in-place and `out=` ops, and storages made before the tracker count
nothing; the peak is the highest live sum; autograd's first .grad counts, accumulation into it does not.
A collective's buffers on 2 gloo ranks: tests/test_cpu_comm.py (in that file's launch)."""

import torch

from video_dit.parallel.memory import CPUAllocationTracker, activation_peak

N = 1000  # float32 elements: 4,000 bytes


def test_allocation_and_free_count_the_storage_bytes():
    with CPUAllocationTracker() as tracker:
        x = torch.empty(N)
        assert (tracker.live, tracker.peak) == (4 * N, 4 * N)
        y = torch.zeros(10, 10, dtype=torch.bfloat16)  # 2 bytes an element
        z = torch.ones(3, 5, dtype=torch.float64)  # 8
        assert tracker.live == 4 * N + 200 + 120
        del y
        assert tracker.live == 4 * N + 120
        w = x + 1  # an op's output: a new storage of x's size
        assert tracker.live == 8 * N + 120
        del x, w, z
        assert tracker.live == 0 and tracker.peak == 8 * N + 120  # the peak stays the highest sum
    keep = torch.empty(N)  # after the mode is left: not seen
    assert tracker.live == 0
    del keep


def test_views_in_place_and_out_ops_are_not_new_storage():
    with CPUAllocationTracker() as tracker:
        x = torch.randn(40, 25)
        b = torch.empty(40, 25)
        for view in (x.view(25, 40), x[::2], x.t(), x[3], x.reshape(-1), x.expand(2, 40, 25), x.unsqueeze(0),
                     *x.chunk(4), *x.split(10)):
            assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        x.add_(1).mul_(2).clamp_(-1, 1)
        torch.add(x, x, out=b)
        torch.mul(x, 3, out=b)
        assert tracker.live == tracker.peak == 2 * 4 * N
        c = x.t().contiguous()  # a copy, not a view: new
        assert tracker.live == 3 * 4 * N
        del c


def test_storages_made_before_the_tracker_are_not_counted_or_uncounted():
    before = torch.randn(N)
    with CPUAllocationTracker() as tracker:
        y = before * 2
        del before  # freed inside, but never counted: live stays y's
        assert tracker.live == 4 * N
        del y
        assert tracker.live == 0


def test_autograd_saved_tensors_and_gradients():
    """A matmul, square and sum, forward and backward: outputs count, a temporary nothing saves is freed at
    once, one autograd saves lives until backward, the first .grad counts and accumulation into it does not."""
    w = torch.randn(64, 32, requires_grad=True)  # 8 KiB, made before: never counted
    x = torch.randn(16, 32)  # made before: its reference in the graph is no new storage
    with CPUAllocationTracker() as tracker:
        h = x @ w.t()  # (16, 64): 4 KiB; mm saves x and w, made before: nothing new
        s = h.square()  # 4 KiB; square saves its input h
        loss = s.sum()  # 4 bytes; sum saves nothing of its input
        assert tracker.live == 4096 + 4096 + 4
        del s  # nothing saved it: freed
        assert tracker.live == 4096 + 4
        del h  # saved by square for its backward: still alive
        assert tracker.live == 4096 + 4
        loss.backward()  # the graph (and h) freed; w.grad (8 KiB) is new
        assert w.grad is not None and tracker.live == 4 + 64 * 32 * 4
        grad = w.grad
        (x @ w.t()).sum().backward()  # accumulated into the existing .grad: no new gradient storage
        assert w.grad is grad and tracker.live == 4 + 64 * 32 * 4
    _, peak = activation_peak(lambda: torch.empty(N).add_(1).sum())
    assert peak == 4 * N + 4  # `activation_peak` reads the same counter
