"""The benchmark harness computes what it claims: the FLOP count MFU is built on, the MFU and
throughput arithmetic, the per-rank memory split, and `video-dit bench` dispatch + JSON.
No timings are asserted (speed lives in `video_dit/bench/`, not in tests)."""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import helpers
import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from video_dit import devices
from video_dit.bench import common
from video_dit.bench import train as train_bench
from video_dit.models.dit import dit_flops

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- FLOPs and MFU


def _tiny():
    model = helpers.tiny_dit(in_dim=16, out_dim=16, text_len=8, head_std=0.02)
    cfg = model.config
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 2, 4, 6, generator=g)  # 2 x 2 x 3 = 12 tokens
    return cfg, model, (x, torch.tensor([500.0]), torch.randn(1, 8, 24, generator=g)), 12


def test_dit_flops_equals_counted_matmul_flops():
    """The analytic count MFU divides by equals torch's FLOP counter on the real forward (SDPA as
    its math kernel so the counter sees the attention matmuls), and forward + backward equals
    3x forward minus the input gradients the first layers never compute."""
    cfg, model, inputs, L = _tiny()
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        model(*inputs)
    assert fc.get_total_flops() == dit_flops(cfg, L, cfg.text_len)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        model(*inputs).square().mean().backward()
    patch = 2 * L * cfg.dim * cfg.in_dim * 4  # patch embedding conv (no input gradient)
    text_in = 2 * cfg.text_len * cfg.text_dim * cfg.dim  # text MLP's first Linear
    time_in = 2 * cfg.freq_dim * cfg.dim  # time MLP's first Linear
    assert fc.get_total_flops() == 3 * dit_flops(cfg, L, cfg.text_len) - (patch + text_in + time_in)


def test_train_bench_step_flops_and_throughput():
    shape = dict(train_bench.SMALL, batch=3)
    flops, tokens = train_bench.step_flops(shape)
    _, Fl, h, w = shape["latents"]
    assert tokens == 3 * Fl * (h // 2) * (w // 2)
    assert flops == 3 * dit_flops(train_bench.dit_config(shape), Fl * (h // 2) * (w // 2), shape["text_len"], 3)
    fig = train_bench.throughput(flops, tokens, step_s=0.5, dp_world=2, peak_flops=flops)
    assert fig["tokens_per_s"] == pytest.approx(tokens * 2 / 0.5)
    assert fig["tflops_per_rank"] == pytest.approx(flops / 0.5 / 1e12)
    assert fig["mfu"] == pytest.approx(2.0)  # one step's FLOPs in half a second at 1 step's FLOPs / s
    assert common.mfu(3e12, 2.0, 1e12) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="peak_flops"):
        common.mfu(1.0, 1.0, 0.0)


@pytest.fixture
def small_matmul(monkeypatch):
    """The measured peak at n = 256 (the default 2048 costs seconds on a shared CPU)."""
    monkeypatch.setattr(devices, "matmul_flops", functools.partial(devices.matmul_flops, n=256, repeats=3))


def test_device_peak_table_and_measured(small_matmul):
    assert devices.table_peak("NVIDIA H200", torch.bfloat16) == (989e12, "H200")
    assert devices.table_peak("NVIDIA H100 80GB HBM3", torch.float32) == (989e12 / 2, "H100")
    assert devices.table_peak("NVIDIA A100-SXM4-80GB", torch.bfloat16) == (312e12, "A100")
    assert devices.table_peak("Some CPU", torch.bfloat16) is None
    peak = devices.device_peak("cpu", torch.float32)
    assert peak.source == "measured matmul" and peak.table is None and peak.flops == peak.measured > 0


def test_time_side_by_side_alternates_and_counts():
    calls = []
    times = common.time_side_by_side({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
                                     repeats=3, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-up, then order reversed every other round
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}
    assert common.median([3.0, 1.0, 2.0]) == 2.0


# ---------------------------------------------------------------- memory split


def test_tensor_memory_split_counts_each_storage_once():
    flat = torch.zeros(100)  # 400 bytes: views of it count once, with the whole buffer
    a, b = flat[:50], flat[50:]
    other = torch.zeros(10, dtype=torch.float64)  # 80 bytes
    split = common.tensor_memory_split({"p": [a, b], "g": [flat, other], "o": [other, torch.zeros(0)]})
    assert split == {"p": 400, "g": 80, "o": 0}


def _fake_zero_engine():
    """A stand-in with the shapes of a ZeRO-2 engine on one of 2 ranks: a flat model buffer the
    parameters view, a half-size gradient partition (+ a view of it), a fp32 master partition
    held by the inner optimizer, Adam moments of the partition, and a reduce bucket."""
    model = torch.nn.Linear(10, 10)  # 110 params
    flat = torch.zeros(110)
    with torch.no_grad():
        model.weight.data, model.bias.data = flat[:100].view(10, 10), flat[100:]
    master = torch.zeros(55, requires_grad=True)
    inner = torch.optim.AdamW([master])
    inner.state[master] = {"exp_avg": torch.zeros(55), "exp_avg_sq": torch.zeros(55), "step": torch.tensor(1.0)}
    grad_partition = torch.zeros(55)
    zero = SimpleNamespace(optimizer=inner, bit16_groups_flat=[flat], averaged_gradients={0: [grad_partition[:20]]},
                           grads_in_partition=grad_partition, ipg_buffer=[torch.zeros(30)],
                           fp32_partitioned_groups_flat=[master], dummy=torch.zeros(7), module=model)
    return SimpleNamespace(module=model, optimizer=zero)


def test_engine_memory_split_adds_up():
    engine = _fake_zero_engine()
    split = train_bench.engine_memory_split(engine)
    assert split["parameters"] == 110 * 4
    assert split["gradients"] == (55 + 30) * 4  # the partition once (its view is not recounted) + bucket
    assert split["optimizer"] == (55 + 55 + 55 + 1) * 4  # master partition + two moments + step
    assert split["other"] == 7 * 4
    assert split["attributes"]["gradients"] == ["averaged_gradients", "grads_in_partition", "ipg_buffer"]
    assert split["attributes"]["optimizer"] == ["fp32_partitioned_groups_flat"]
    everything = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (
        *engine.module.parameters(), engine.optimizer.grads_in_partition, engine.optimizer.ipg_buffer[0],
        *[t for s in engine.optimizer.optimizer.state.values() for t in s.values()],
        engine.optimizer.fp32_partitioned_groups_flat[0], engine.optimizer.dummy)}
    assert sum(split[k] for k in train_bench.MEMORY_KEYS) == sum(everything.values())


@pytest.mark.slow  # 2 real DeepSpeed ranks over gloo, three engines each: ~1 min on 2 shared cores
def test_engine_memory_split_on_real_zero_engines_matches_the_parameter_count(tmp_path):
    """The split behind the README's ZeRO-3 / ZeRO-0 figure, on the benchmark's own engines (2 ranks,
    bf16 full fine-tune, ZeRO-0, 2 and 3, after a step), against bytes derived from the parameter
    count P alone. The weights are float32 masters computing in bf16 (`cast_for_training`):
    ZeRO-0 holds fp32 params + fp32 grads (4P each) and Adam's two moments (8P, plus a 4-byte step per
    tensor); ZeRO-2 keeps the params whole and partitions the grads (4P/W) and DeepSpeed's fp32
    partition copy + the moments (12P/W); ZeRO-3 also partitions the params (4P/W), except that
    parameters of at most `stage3_param_persistence_threshold` elements stay whole on every rank, and
    its fp32 partitions are the master weights (`alias_fp32_partitions`): the moments alone (8P/W)."""
    import math

    from video_dit.parallel import zero as eng

    shape = dict(train_bench.SMALL)
    model = train_bench.build_model(shape)
    sizes = [p.numel() for p in model.parameters()]
    P, W = sum(sizes), 2
    res = train_bench.run_ranks(shape, (0, 2, 3), 1, W, "cpu", 2, tmp_path, "bf16")
    job = train_bench.trainer_job(3, str(tmp_path / "job_data"), str(tmp_path / "out"))  # the ranks' job
    threshold = eng.ds_config(job, W)["zero_optimization"]["stage3_param_persistence_threshold"]
    persistent = sum(n for n in sizes if n <= threshold)
    assert 0 < persistent < P

    def near(got, want, rel=0.02):  # bucket / partition padding: at most a few percent at this size
        return want <= got <= want * (1 + rel) + 64

    for r in res:
        z0, z2, z3 = (r["zero"][s]["memory"] for s in ("0", "2", "3"))
        assert (z0["parameters"], z0["gradients"]) == (4 * P, 4 * P), z0
        assert z0["optimizer"] == 8 * P + 4 * len(sizes), z0
        assert z2["parameters"] == 4 * P and near(z2["gradients"], 4 * P // W), z2
        assert near(z2["optimizer"], 12 * P // W), z2
        assert near(z3["parameters"], 4 * math.ceil(P / W) + 4 * persistent), z3
        assert near(z3["gradients"], 4 * P // W) and near(z3["optimizer"], 8 * P // W), z3
        assert z0["other"] == 0 and z3["other"] <= 64  # nothing of size left unclassified
    for stage, state in (("2", 12 * P), ("3", 8 * P)):  # the partitions of the fp32 state add up to the whole
        assert near(sum(r["zero"][stage]["memory"]["optimizer"] for r in res), state, rel=0.005)


# ---------------------------------------------------------------- `video-dit bench`


@pytest.fixture
def fake_suites(monkeypatch):
    from video_dit.commands import bench as cmd

    calls = []

    def make(name, result, prints):
        mod = types.ModuleType(f"fake_bench_{name}")

        def run(device="cpu", repeats=3, small=False, threads=None):
            calls.append((name, device, repeats, small, threads))
            return json.loads(json.dumps(result))

        mod.run = run
        if prints:
            mod.print_table = lambda res: print(f"TABLE {name} {res['time_ratio']}")
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        return mod.__name__

    suites = {
        "dit": make("dit", {"time_ratio": 0.9, "peak_ratio": 0.85, "tflops": {"ours": 1e-3, "diffusers": 1e-3}}, False),
        "vae": make("vae", {"time_ratio": 0.5, "memory_ratio": 0.6}, True),
        "sp": "video_dit.bench.no_such_suite_module",
    }
    monkeypatch.setattr(cmd, "SUITES", suites)
    return cmd, calls


def _bench(argv):
    from video_dit import cli

    return cli.main(["bench", *argv])


def test_bench_dispatch_summary_and_json(fake_suites, tmp_path, capsys):
    cmd, calls = fake_suites
    out = tmp_path / "b.json"
    assert _bench(["--suite", "vae", "--small", "--repeats", "2", "--json", str(out)]) == 0
    assert calls == [("vae", "cpu", 2, True, None)]  # only the chosen suite, with the flags passed on
    printed = capsys.readouterr().out
    assert "TABLE vae 0.5" in printed and "Summary vs targets" in printed
    data = json.loads(out.read_text())
    assert set(data["results"]) == {"vae"} and data["meta"]["small"] is True
    rows = {r["figure"]: r for r in data["summary"]}
    assert rows["encode+decode time ours / diffusers"]["met"] is True  # 0.5 <= 0.7
    assert rows["peak memory ours / diffusers"]["value"] == 0.6


def test_bench_all_adds_dit_mfu_and_skips_a_missing_suite(fake_suites, small_matmul, tmp_path, capsys):
    cmd, calls = fake_suites
    out = tmp_path / "all.json"
    assert _bench(["--suite", "all", "--small", "--json", str(out)]) == 0
    assert [c[0] for c in calls] == ["dit", "vae"]
    data = json.loads(out.read_text())
    assert "does not exist" in data["results"]["sp"]["error"]
    dit = data["results"]["dit"]
    assert dit["mfu"] == pytest.approx(1e9 / dit["peak"]["flops"])  # TFLOP/s over the matmul measured here
    rows = {r["figure"]: r for r in data["summary"]}
    assert rows["activation peak ours / diffusers"]["met"] is False  # 0.85 > 0.8
    assert "bf16 MFU vs datasheet peak" not in rows  # a cuda-only target on a cpu run
    assert "skipped" in capsys.readouterr().out


def test_bench_explicit_missing_suite_exits_2(fake_suites, capsys):
    assert _bench(["--suite", "sp"]) == 2
    assert "no_such_suite_module does not exist" in capsys.readouterr().err


def test_levers_switch_one_thing_at_a_time_and_leave_the_model_as_shipped():
    """Each lever's off state computes the same step (the lever changes cost, not math), the
    recompute lever lowers the activation peak it exists for, and the model is left as shipped."""
    from video_dit.bench import levers
    from video_dit.models import dit

    shipped = dit.RMSNorm.forward
    model, inputs = levers.build(levers.SMALL, "cpu", torch.float32)
    grads = {}
    with_triton = importlib.util.find_spec("triton") is not None  # the kernels lever sets "triton"
    for name in ("recompute", "rms_norm", "rope_cache") + (("kernels",) if with_triton else ()):
        sw = levers.Switch(name, model)
        for on in (False, True):
            model.zero_grad(set_to_none=True)
            sw.set(on)
            sw.before_step()
            model(*inputs).float().square().mean().backward()
            grads[name, on] = torch.cat([p.grad.flatten() for p in model.parameters()])
        sw.restore()
        torch.testing.assert_close(grads[name, False], grads[name, True], rtol=1e-4, atol=1e-6)
    assert dit.RMSNorm.forward is shipped and all(b.recompute for b in model.blocks)
    assert {m.kernels for m in model.modules() if hasattr(m, "kernels")} == {"auto"}
    assert dit.RMSNorm.forward is not levers._torch_rms_norm

    res = levers.run(repeats=1, small=True, levers=("recompute",))
    r = res["levers"]["recompute"]
    assert "error" not in r, r
    assert r["act_peak_bytes"]["on"] < 0.9 * r["act_peak_bytes"]["off"]
    with pytest.raises(ValueError, match="unknown lever"):
        levers.run(small=True, levers=("fused_qkv",))
