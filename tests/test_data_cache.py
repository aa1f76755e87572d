"""Scan + caches: bad files skipped and reported, zero encoder calls on a second pass, touching a file
re-caches only it, rank split, i2v keys, cached batches, per-step caption dropout."""

from __future__ import annotations

import os
import warnings

import av
import numpy as np
import pytest
import torch

from video_dit import media
from video_dit.data.cache import CachedDataset, build_cache, collate, latent_path
from video_dit.data.dataset import DataError, DatasetConfig, DataWarning, scan_dataset
from video_dit.data.demo import render_clip
from video_dit.data.sampler import BucketBatchSampler
from video_dit.typed_config import parse

DIV = 16


class Counting:
    """Stand-ins for the VAE and text encoder that count their calls (latents: 4x time, 8x space)."""

    def __init__(self, i2v=False):
        self.vae_calls, self.text_calls, self.i2v = 0, 0, i2v

    def encode(self, video):  # (1, 3, F, H, W) in [-1, 1]
        assert video.ndim == 5 and video.shape[:2] == (1, 3) and video.min() >= -1 and video.max() <= 1
        self.vae_calls += 1
        lat = torch.cat([video[:, :, :1], video[:, :, 1::4]], 2)[:, :, :, ::8, ::8]  # (1, 3, F', h, w)
        out = {"latents": lat.repeat(1, 2, 1, 1, 1)}
        if self.i2v:
            out["first_frame_latents"] = out["latents"][:, :, :1].clone()
        return out

    def text(self, captions):
        self.text_calls += 1
        return [torch.full((4 + len(c) % 3, 8), float(len(c))) for c in captions]


def _clip(path, seed, frames=9, size=32, direction="right"):
    clip = render_clip("square", "red", direction, frames, size, np.random.default_rng(seed))
    return media.write_video(clip, path, fps=16)


def _good_folder(root, n=4, captions=True):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        _clip(root / f"c{i}.mp4", i, direction=["right", "left", "up", "down"][i % 4])
        if captions:
            (root / f"c{i}.txt").write_text(f"a red square number {i}")
    return root


def _cfg(root, **kw):
    return parse(DatasetConfig, {"folder_path": str(root), "num_frames": 9, "resolution": [32], **kw}, "ds")


def _faststart_mp4(path, frames=9, size=32):
    """An MP4 with its index first (moov before mdat), as many tools write."""
    clip = render_clip("circle", "blue", "down", frames, size, np.random.default_rng(0))
    with av.open(str(path), "w", format="mp4", options={"movflags": "faststart"}) as c:
        s = c.add_stream("libx264", rate=16)
        s.width = s.height = size
        s.pix_fmt = "yuv420p"
        for f in clip:
            for p in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)


def test_second_pass_is_free_and_touch_recaches_only_that_file(tmp_path):
    root = _good_folder(tmp_path / "data")
    media.tensor_to_pil(torch.zeros(3, 40, 40))[0].save(root / "img.png")  # image item, no caption
    enc = Counting()
    with pytest.warns(DataWarning, match="1 files have no .txt caption"):
        scan = scan_dataset(_cfg(root), DIV)
    assert {it.bucket for it in scan.items} == {(9, 32, 32), (1, 32, 32)}
    r1 = build_cache(scan, enc.encode, enc.text, space_version="vae-a", verbose=False)
    assert (r1.hits, r1.misses, enc.vae_calls) == (0, 5, 5)
    assert r1.text_misses == 5 and enc.text_calls == 1  # 4 captions + the empty prompt, one batch

    scan2 = scan_dataset(_cfg(root), DIV, verbose=False)
    r2 = build_cache(scan2, enc.encode, enc.text, space_version="vae-a", verbose=False)
    assert (enc.vae_calls, enc.text_calls) == (5, 1)  # zero calls on the second pass
    assert (r2.hits, r2.misses, r2.text_hits, r2.hit_ratio) == (5, 0, 5, 1.0)

    st = os.stat(root / "c2.mp4")
    os.utime(root / "c2.mp4", ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    scan3 = scan_dataset(_cfg(root), DIV, verbose=False)
    r3 = build_cache(scan3, enc.encode, enc.text, space_version="vae-a", verbose=False)
    assert (enc.vae_calls, enc.text_calls, r3.misses, r3.hits) == (6, 1, 1, 4)  # only c2 re-encoded

    r4 = build_cache(scan3, enc.encode, enc.text, space_version="vae-b", verbose=False)  # new latent space
    assert r4.misses == 5 and r4.text_misses == 5


def test_rank_split_is_disjoint_and_complete(tmp_path):
    root = _good_folder(tmp_path / "data", n=5)
    scan = scan_dataset(_cfg(root), DIV, verbose=False)
    encs = [Counting(), Counting(), Counting()]
    barrier_calls = []
    reports = [build_cache(scan, e.encode, e.text, rank=r, world_size=3, space_version="v",
                           barrier=lambda: barrier_calls.append(1), verbose=False) for r, e in enumerate(encs)]
    assert [e.vae_calls for e in encs] == [2, 2, 1] and sum(r.misses for r in reports) == 5
    assert sum(r.text_misses for r in reports) == 6 and len(barrier_calls) == 3
    again = build_cache(scan, encs[0].encode, encs[0].text, space_version="v", verbose=False)
    assert again.hits == 5 and again.misses == 0 and again.text_misses == 0


def test_bad_files_are_skipped_reported_and_training_uses_the_rest(tmp_path):
    root = _good_folder(tmp_path / "data", n=3)
    good = (root / "c0.mp4").read_bytes()
    (root / "truncated.mp4").write_bytes(good[: len(good) // 2])
    _faststart_mp4(tmp_path / "fs.mp4")
    fs = (tmp_path / "fs.mp4").read_bytes()
    (root / "truncated_faststart.mp4").write_bytes(fs[:-40])  # index intact, last frames cut
    (root / "zero.mp4").write_bytes(b"")
    (root / "notes.mp4").write_text("this is a text file, not a video\n" * 20)
    _clip(root / "short.mp4", 0, frames=3)
    _clip(root / "badcap.mp4", 1)
    (root / "badcap.txt").write_bytes(b"\xff\xfe\xfa not utf-8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scan = scan_dataset(_cfg(root), DIV)
    bad = {"truncated.mp4", "truncated_faststart.mp4", "zero.mp4", "notes.mp4", "short.mp4"}
    skipped = {os.path.basename(p): reason for p, reason in scan.skipped}
    assert set(skipped) == bad
    assert "empty file" in skipped["zero.mp4"] and "3 frames < num_frames 9" in skipped["short.mp4"]
    assert "truncated" in skipped["truncated_faststart.mp4"]
    assert "not a readable video" in skipped["notes.mp4"]
    assert "truncated or corrupt" in skipped["truncated.mp4"] and "Errno" not in skipped["truncated.mp4"]
    messages = [str(w.message) for w in caught if w.category is DataWarning]
    for name in bad:  # exactly one warning per bad file, naming it
        assert sum(name in m and "skipped" in m for m in messages) == 1, name
    # a caption that is not UTF-8 is read as cp1252 with one warning naming it: the clip is kept
    as_cp1252 = b"\xff\xfe\xfa not utf-8".decode("cp1252")
    assert [m for m in messages if "badcap" in m] == [
        f"{root / 'badcap.mp4'}: caption badcap.txt is not UTF-8: invalid start byte at byte 0; read as "
        f"cp1252: {as_cp1252!r}"]
    assert sorted(os.path.basename(it.path) for it in scan.items) == ["badcap.mp4", "c0.mp4", "c1.mp4", "c2.mp4"]
    assert "5 files skipped" in scan.summary()
    scan.items = [it for it in scan.items if "badcap" not in it.path]  # the rest as before

    # a file that passed the probe but fails to decode at caching time (replaced after the scan)
    victim = root / "c1.mp4"
    st = victim.stat()
    victim.write_bytes(b"\0" * st.st_size)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    enc = Counting()
    with pytest.warns(DataWarning, match="c1.mp4: skipped at caching"):
        report = build_cache(scan, enc.encode, enc.text, space_version="v", rank=1, world_size=2)
    report0 = build_cache(scan, enc.encode, enc.text, space_version="v", rank=0, world_size=2, verbose=False)
    assert [os.path.basename(p) for p, _ in report.skipped + report0.skipped] == ["c1.mp4"]
    ds = CachedDataset(scan, space_version="v")  # any rank sees the skip marker
    assert [os.path.basename(it.path) for it in ds.items] == ["c0.mp4", "c2.mp4"]
    assert len(ds.skipped) == 6  # the 5 of the scan + c1 at caching
    batch = collate([ds[i] for i in next(iter(BucketBatchSampler(ds, 2)))])
    assert batch["latents"].shape == (2, 6, 3, 4, 4)

    only_bad = tmp_path / "only_bad"
    only_bad.mkdir()
    (only_bad / "zero.mp4").write_bytes(b"")
    (only_bad / "notes.mp4").write_text("not a video")
    with pytest.raises(DataError, match="no usable item.*zero.mp4: empty file"):
        scan_dataset(_cfg(only_bad), DIV, verbose=False)


def test_cached_dataset_batches_i2v_keys_and_caption_dropout(tmp_path):
    root = _good_folder(tmp_path / "data", n=4)
    cache = tmp_path / "cache"
    scan = scan_dataset(_cfg(root, do_i2v=True, caption_dropout_rate=0.5, num_repeats=5), DIV, verbose=False)
    enc = Counting(i2v=True)
    build_cache(scan, enc.encode, enc.text, cache_dir=cache, space_version="v", verbose=False)
    assert not (root / "_latent_cache").exists() and latent_path(scan.items[0], "v", cache).is_file()
    with pytest.raises(DataError, match="no latent cache entry"):
        CachedDataset(scan, space_version="other", cache_dir=cache)
    ds = CachedDataset(scan, cache, space_version="v", seed=3)
    assert len(ds) == 20 and list(ds.buckets) == [(9, 32, 32)]
    s = ds[7]
    assert s["latents"].shape == (6, 3, 4, 4) and s["first_frame_latents"].shape == (6, 1, 4, 4)
    assert torch.equal(s["first_frame_latents"], s["latents"][:, :1]) and s["index"] == 7
    # the cached latents are the encoder's output on the file's pixels, decoded here with PyAV (not
    # through the cache's own reader): 9 frames of a 9-frame 32x32 clip, no resize or crop
    item = ds.item(7)
    assert (tuple(item.frames), tuple(item.bucket)) == (tuple(range(9)), (9, 32, 32))
    with av.open(str(item.path)) as container:
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])  # (F, H, W, 3)
    pixels = torch.from_numpy(frames).permute(3, 0, 1, 2)[None].float() / 127.5 - 1  # (1, 3, F, H, W)
    assert pixels.shape == (1, 3, 9, 32, 32)
    assert torch.allclose(s["latents"], enc.encode(pixels)["latents"][0], atol=1e-6)
    batch = collate([ds[i] for i in range(4)])
    assert batch["latents"].shape == (4, 6, 3, 4, 4) and isinstance(batch["text_embeds"], list)
    assert all(t.ndim == 2 for t in batch["text_embeds"]) and batch["index"].tolist() == [0, 1, 2, 3]

    # dropout: random per (seed, epoch, index), reproducible, swaps in the empty prompt's embeds
    pattern0 = [ds[i]["caption_dropped"] for i in range(len(ds))]
    assert 3 <= sum(pattern0) <= 17
    for i in range(len(ds)):
        s = ds[i]
        assert (s["caption"] == "") == s["caption_dropped"]
        assert s["text_embeds"][0, 0].item() == float(len(s["caption"]))
    ds.set_epoch(1)
    pattern1 = [ds[i]["caption_dropped"] for i in range(len(ds))]
    assert pattern1 != pattern0
    again = CachedDataset(scan, cache, space_version="v", seed=3)
    again.set_epoch(1)
    assert [again[i]["caption_dropped"] for i in range(len(ds))] == pattern1

    # as the trainer uses it: a DataLoader with a worker process, the sampler and collate
    sampler = BucketBatchSampler(again, 3, seed=3)
    sampler.set_epoch(1)
    loader = torch.utils.data.DataLoader(again, batch_sampler=sampler, collate_fn=collate, num_workers=1)
    seen = [i for b in loader for i in b["index"].tolist()]
    assert sorted(seen) == list(range(20))
    by_index = {i: d for b in loader for i, d in zip(b["index"].tolist(), b["caption_dropped"].tolist())}
    assert [by_index[i] for i in range(20)] == pattern1


def _rank_main(rank, world_size, port, root, out_q):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        scan = scan_dataset(_cfg(root), DIV, verbose=False)
        enc = Counting()
        report = build_cache(scan, enc.encode, enc.text, rank=rank, world_size=world_size, space_version="v",
                             barrier=dist.barrier, verbose=False)
        ds = CachedDataset(scan, space_version="v")  # needs every rank's entries: the barrier ran
        sampler = BucketBatchSampler(ds, 2, world_size=world_size, rank=rank, seed=1)
        seen = [i for b in sampler for i in collate([ds[j] for j in b])["index"].tolist()]
        out_q.put((rank, enc.vae_calls, report.misses, seen))
    finally:
        dist.destroy_process_group()


@pytest.mark.multirank
def test_two_ranks_build_disjoint_halves_then_share_the_cache(tmp_path):
    import torch.multiprocessing as mp

    from video_dit.devices import free_port

    root = _good_folder(tmp_path / "data", n=6)
    port = free_port()
    # spawn, not fork: a process forked from this one (torch's and the earlier tests' threads running) can hang
    # on a lock one of those threads held at the fork
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, root, q)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert [r[1] for r in results] == [3, 3]  # VAE calls split 3 + 3
    seen = results[0][3] + results[1][3]
    assert sorted(seen) == list(range(6))  # every item once across the two ranks
