"""`build_dit` under ZeRO-3: the DiT built partitioned on 2 gloo ranks from every weights layout.

One launch checks, for a diffusers sharded folder, a ComfyUI-keyed single file, an original Wan
zip `.pth` and a preset: each rank holds ceil(numel / 2) elements of every parameter, the tensors a
rank allocated while building never exceeded half the model plus one module group, the per-
parameter dtypes equal `load_dit`'s, and the gathered model computes what `load_dit`'s does (the
reference output is computed in the test process from the native file). Then a LoRA on the
partitioned build goes through `deepspeed.initialize` (ZeRO-3 hooks) and predicts what an
unpartitioned copy with the same adapters predicts.
Lazy reading (single process): names converted and checked before any tensor is read.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import ranks
import torch

from video_dit.families.wan.dit import LORA_TARGETS as WAN_LORA_TARGETS

pytestmark = pytest.mark.multirank
BF16_SOURCE = "comfy.safetensors"  # the source also built at bf16 (dtype per parameter compared)


def reference_model():
    """The tiny preset with a non-zero output layer (a zero head would hide every other weight)."""
    from video_dit.families.wan.loading import load_dit

    dit = load_dit("preset:tiny", seed=3)
    with torch.no_grad():
        dit.head.head.weight.normal_(std=0.05, generator=torch.Generator().manual_seed(1))
    return dit


def probe():
    g = torch.Generator().manual_seed(5)
    return torch.randn(1, 16, 3, 4, 4, generator=g), torch.tensor([600.0]), [torch.randn(5, 64, generator=g)]


def write_sources(root: Path) -> dict:
    from safetensors.torch import save_file

    from video_dit.families.wan.convert import dit_to_diffusers

    sd = {k: v.contiguous() for k, v in reference_model().state_dict().items()}
    folder = root / "diffusers" / "transformer"  # sharded, diffusers names, with an index
    folder.mkdir(parents=True)
    diff = dit_to_diffusers(sd)
    keys = sorted(diff)
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        name = f"diffusion_pytorch_model-0000{i + 1}-of-00002.safetensors"
        save_file({k: diff[k] for k in part}, str(folder / name))
        weight_map.update({k: name for k in part})
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    save_file({"model.diffusion_model." + k: v for k, v in sd.items()}, str(root / "comfy.safetensors"))
    torch.save(sd, root / "wan.pth")
    save_file(sd, str(root / "native.safetensors"))
    return {"diffusers": str(root / "diffusers"), "comfy": str(root / "comfy.safetensors"),
            "pth": str(root / "wan.pth"), "preset": "preset:tiny"}


# ---------------------------------------------------------------- the worker (one rank)

def worker(spec_path: str) -> int:
    import deepspeed
    import torch.distributed as dist

    from video_dit.families import get_preset
    from video_dit.families.wan.loading import load_dit
    from video_dit.lora import add_lora
    from video_dit.models.weights import module_groups
    from video_dit.parallel.memory import CPUAllocationTracker
    from video_dit.train.build import build_dit

    spec = json.loads(Path(spec_path).read_text())
    deepspeed.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": world,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
          "zero_allow_untested_optimizer": True}
    x, t, ctx = probe()
    report = {}
    for kind, source in spec["sources"].items():
        for dtype in (torch.float32, torch.bfloat16) if kind == "comfy" else (torch.float32,):
            with CPUAllocationTracker() as tracker:
                model = build_dit(source, get_preset("tiny"), zero_stage=3, dtype=dtype, seed=3, ds_config=ds)
            full = load_dit(source, dtype=dtype, seed=3)
            held = {n: p.ds_tensor.numel() for n, p in model.named_parameters()}
            expected = {n: math.ceil(p.numel() / world) for n, p in full.named_parameters()}
            sizes = {n: p.numel() * p.element_size() for n, p in full.named_parameters()}
            group = max(sum(sizes[n] for n in g) for g in module_groups(sizes))
            dtypes_equal = all(p.dtype == dict(full.named_parameters())[n].dtype for n, p in model.named_parameters())
            with deepspeed.zero.GatheredParameters(list(model.parameters())), torch.no_grad():
                out = model(x.to(dtype), t, [c.to(dtype) for c in ctx]).float()
                params = dict(full.named_parameters())
                param_diff = max((p.float() - params[n].float()).abs().max().item() for n, p in model.named_parameters())
            report[f"{kind}:{dtype}"] = {
                "sizes_ok": held == expected, "peak": tracker.peak, "half_plus_group": sum(sizes.values()) / world + group,
                "full_bytes": sum(sizes.values()), "dtypes_equal": dtypes_equal, "param_diff": param_diff,
                "out": out.tolist()}
    # LoRA injected into the partitioned Linears, then DeepSpeed's ZeRO-3 engine (hooks gather per module)
    model = build_dit(spec["sources"]["comfy"], get_preset("tiny"), zero_stage=3, dtype=torch.float32, ds_config=ds)
    full = load_dit(spec["sources"]["comfy"])
    for m in (model, full):
        torch.manual_seed(11)
        add_lora(m, 4, targets=WAN_LORA_TARGETS)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds,
                                      optimizer=torch.optim.AdamW(params, lr=1e-3))
    with deepspeed.zero.GatheredParameters([p for n, p in engine.module.named_parameters() if "lora_B" in n],
                                           modifier_rank=0), torch.no_grad():
        for (n, p), (_, q) in zip(engine.module.named_parameters(), full.named_parameters()):
            if "lora_B" in n:  # the same non-zero adapters in both (lora_B starts at zero)
                p.normal_(std=0.1, generator=torch.Generator().manual_seed(len(n)))
                q.copy_(p)
    with torch.no_grad():
        report["lora_engine_vs_full"] = (engine(x, t, ctx) - full(x, t, ctx)).abs().max().item()
    report["lora_is_partitioned"] = all(hasattr(p, "ds_tensor") for p in engine.module.parameters())
    (Path(spec["out"]) / f"rank{rank}.json").write_text(json.dumps(report))
    return 0


# ---------------------------------------------------------------- tests

def test_zero3_build_partitions_every_layout_and_equals_the_full_model(tmp_path):
    sources = write_sources(tmp_path)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"sources": sources, "out": str(tmp_path)}))
    procs = ranks.start([__file__, "--worker", str(spec)], cwd=tmp_path, log_prefix=tmp_path / "build")
    ranks.wait(procs, tmp_path / "build", timeout=600)

    x, t, ctx = probe()
    with torch.no_grad():
        expected = reference_model()(x, t, ctx)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for name, r in report.items():
            if not isinstance(r, dict):
                continue
            assert r["sizes_ok"], (rank, name)
            assert r["dtypes_equal"], (rank, name)
            assert r["param_diff"] == 0, (rank, name)  # the gathered parameters are load_dit's, exactly
            # never the whole model: what this rank allocated while building stayed below half of
            # the model (its partitions) plus one module group read in full
            assert r["peak"] <= r["half_plus_group"] * 1.05 and r["peak"] < 0.8 * r["full_bytes"], (rank, name, r)
            if name.startswith("preset"):
                continue  # the preset's output layer is zero (its parameters were compared above)
            tol = 5e-2 if "bfloat16" in name else 1e-6
            torch.testing.assert_close(torch.tensor(r["out"]), expected, rtol=0, atol=tol * expected.abs().max().item())
        assert report["lora_is_partitioned"]
        assert report["lora_engine_vs_full"] < 1e-5


def test_weights_are_opened_renamed_and_checked_before_any_tensor_is_read(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    from video_dit.families.wan import loading
    from video_dit.families.wan.convert import dit_to_diffusers
    from video_dit.models import weights as weights_io

    sd = {k: v.contiguous() for k, v in reference_model().state_dict().items()}
    save_file(dit_to_diffusers(sd), str(tmp_path / "d.safetensors"))
    torch.save(sd, tmp_path / "zip.pth")
    torch.save(sd, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    reads = []
    real = weights_io._read_safetensors
    monkeypatch.setattr(weights_io, "_read_safetensors", lambda path, keys: reads.append(len(keys)) or real(path, keys))
    weights, config, description = loading.open_dit(tmp_path / "d.safetensors")
    assert reads == [] and "diffusers layout" in description
    assert set(weights.keys()) == set(sd) and config.num_layers == 4  # native names and shapes, no data read
    got = weights.read(["blocks.1.ffn.0.weight"])
    assert reads == [1] and torch.equal(got["blocks.1.ffn.0.weight"], sd["blocks.1.ffn.0.weight"])
    # a zip .pth is mapped, not held; a legacy .pth cannot be mapped and is held whole (said in held_bytes)
    assert weights_io.open_weights(tmp_path / "zip.pth").held_bytes == 0
    legacy = weights_io.open_weights(tmp_path / "legacy.pth")
    assert legacy.held_bytes == sum(v.numel() * v.element_size() for v in sd.values())
    assert torch.equal(legacy.read(["head.head.weight"])["head.head.weight"], sd["head.head.weight"])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2]))
    sys.exit(f"usage: {sys.argv[0]} --worker SPEC.json")
