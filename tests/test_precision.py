"""bf16 like the reference: the float32 islands a bf16 DiT keeps (storage and arithmetic), how each
path stores it, and the precision bench's claim at a tiny width: our bf16 forward and LoRA gradient
are no further from a float64 run than diffusers' bf16 model, and closer than a pure-bf16 cast."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from video_dit.families.wan import FAMILY as WAN
from video_dit.families.wan.config import DiTConfig
from video_dit.families.wan.dit import LORA_TARGETS as WAN_LORA_TARGETS
from video_dit.families.wan.dit import VideoDiT, cast_dit, param_dtypes

CFG = DiTConfig(dim=64, ffn_dim=128, freq_dim=32, text_dim=48, num_heads=4, num_layers=2, text_len=16)


def wan_float32(name: str) -> bool:
    """The parameters Wan keeps in float32 inside bf16, listed from its wan/modules/model.py (the
    time MLPs and the head run under autocast(float32), the modulation tables are added in float32)
    and diffusers' `_keep_in_fp32_modules` (the norms), by name, independently of `float32_param_names`."""
    return (name.startswith(("time_embedding.", "time_projection.", "head.")) or name.endswith(".modulation")
            or any(f".{n}." in name for n in ("norm3", "norm_q", "norm_k")))


def test_load_dit_bf16_keeps_the_islands_float32_and_bit_equal(tmp_path):
    from video_dit.families.wan.loading import load_dit

    torch.manual_seed(0)
    fp32 = VideoDiT(CFG)
    sd = {k: v.contiguous() for k, v in fp32.state_dict().items()}
    save_file(sd, str(tmp_path / "dit.safetensors"))
    for model in (load_dit(tmp_path / "dit.safetensors", dtype=torch.bfloat16, config=CFG),
                  load_dit("preset:tiny", dtype=torch.bfloat16)):
        assert model.compute_dtype == torch.bfloat16 and model.dtype == torch.bfloat16
        names = dict(model.named_parameters())
        assert any(wan_float32(n) for n in names) and not all(wan_float32(n) for n in names)
        for name, p in names.items():
            assert p.dtype == (torch.float32 if wan_float32(name) else torch.bfloat16), name
    loaded = dict(load_dit(tmp_path / "dit.safetensors", dtype=torch.bfloat16, config=CFG).named_parameters())
    for name, p in loaded.items():  # straight from the file: no bf16 round trip on the islands
        expected = sd[name] if wan_float32(name) else sd[name].to(torch.bfloat16)
        assert torch.equal(p.detach(), expected), name


def test_training_storage_lora_and_full():
    from video_dit.lora import add_lora
    from video_dit.train.precision import cast_for_training

    lora = add_lora(VideoDiT(CFG), 4, targets=WAN_LORA_TARGETS)
    cast_for_training(lora, torch.bfloat16, WAN.arch)
    for name, p in lora.named_parameters():
        want = torch.float32 if ".lora_" in name or wan_float32(name.replace(".base_layer", "")) else torch.bfloat16
        assert p.dtype == want, name
    full = VideoDiT(CFG).requires_grad_(True)
    cast_for_training(full, torch.bfloat16, WAN.arch)  # float32 master weights computing in bf16
    assert {p.dtype for p in full.parameters()} == {torch.float32} and full.compute_dtype == torch.bfloat16
    with torch.no_grad():
        full.head.head.weight.normal_(std=0.05)  # Wan's init zeroes it: the output would be 0
    x, t, ctx = torch.randn(1, 16, 2, 4, 4), torch.tensor([500.0]), [torch.randn(5, CFG.text_dim)]
    out = full(x, t, ctx)
    out.square().mean().backward()
    assert out.dtype == torch.float32 and full.blocks[0].ffn[0].weight.grad.dtype == torch.float32
    # the bulk really ran in bf16: against the same weights computing in float32, a bf16-sized error
    with torch.no_grad():
        ref = cast_dit(full, torch.float32)(x, t, ctx)
    assert full.compute_dtype is None
    assert 1e-4 < ((out.detach() - ref).norm() / ref.norm()).item() < 0.05


def test_train_dtype_cpu_flag_and_notice(tmp_path):
    from PIL import Image

    from video_dit.train.config import parse_job
    from video_dit.train.precision import cpu_fp32_notice, train_dtype

    Image.new("RGB", (16, 16)).save(tmp_path / "a.png")  # a job must name a dataset folder with media

    assert train_dtype("bf16") == torch.float32 and train_dtype("bf16", cpu_bf16=True) == torch.bfloat16
    assert train_dtype("fp32", cpu_bf16=True) == torch.float32
    notice = cpu_fp32_notice("bf16", torch.float32)
    assert "float32" in notice and "train.cpu_bf16" in notice
    assert cpu_fp32_notice("bf16", torch.bfloat16) is None and cpu_fp32_notice("fp32", torch.float32) is None
    job = parse_job({"job": "extension", "config": {"name": "j", "process": [{
        "type": "sd_trainer", "datasets": [{"folder_path": str(tmp_path)}], "train": {"cpu_bf16": True},
        "model": {"name_or_path": "preset:tiny", "vae_dtype": "bf16"}}]}})
    p = job.process
    assert p.train.cpu_bf16 is True and p.model.vae_torch_dtype == torch.bfloat16
    default = parse_job({"job": "extension", "config": {"name": "j", "process": [{
        "type": "sd_trainer", "datasets": [{"folder_path": str(tmp_path)}],
        "model": {"name_or_path": "preset:tiny"}}]}})
    assert default.process.model.vae_torch_dtype == torch.float32 and default.process.train.cpu_bf16 is False


def test_precision_bench_small_ours_vs_diffusers_and_pure_bf16():
    from video_dit.bench.precision import SMALL, errors

    e = errors(SMALL)
    for figure in ("velocity", "lora_grad"):
        ours, diffusers, pure = (e[n][figure] for n in ("ours", "diffusers", "pure"))
        assert 0 < ours <= diffusers, (figure, ours, diffusers)
        assert ours < pure, (figure, ours, pure)
        assert ours < 0.02  # bf16-sized, not broken
    assert e["ours"]["velocity"] < 0.8 * e["pure"]["velocity"]  # visibly, not by rounding luck


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cast_dit_to_a_float_dtype_is_uniform(dtype):
    model = cast_dit(VideoDiT(CFG), dtype)
    assert {p.dtype for p in model.parameters()} == {dtype} and model.compute_dtype is None


def test_whole_model_to_bf16_keeps_the_islands_as_ai_toolkit_calls_it():
    """ai-toolkit's trainer casts the model it is given whole, `unet.to(device, dtype=train_dtype)`
    (BaseSDTrainProcess after load_model; base_model after each preview): the islands survive it."""
    torch.manual_seed(1)
    fp32 = VideoDiT(CFG)
    cast = cast_dit(VideoDiT(CFG), torch.float32)
    cast.load_state_dict(fp32.state_dict())
    cast.to("cpu", dtype=torch.bfloat16)
    assert cast.compute_dtype == torch.bfloat16 and cast.dtype == torch.bfloat16
    ref = fp32.state_dict()
    for name, p in cast.named_parameters():
        want = torch.float32 if wan_float32(name) else torch.bfloat16
        assert p.dtype == want and torch.equal(p.detach(), ref[name].to(want)), name
    assert cast.to(torch.bfloat16) is cast and cast.to("cpu").compute_dtype == torch.bfloat16
    cast.to(dtype=torch.float32)
    assert {p.dtype for p in cast.parameters()} == {torch.float32} and cast.compute_dtype is None
    pure = torch.nn.Module.to(VideoDiT(CFG), torch.bfloat16)  # the precision bench's pure cast
    assert {p.dtype for p in pure.parameters()} == {torch.bfloat16}
    from video_dit.diffusion.experts import TwoExperts  # Wan 2.2 A14B in ai-toolkit: the same cast

    pair = TwoExperts(VideoDiT(CFG), VideoDiT(CFG), 0.9).to("cpu", torch.bfloat16)
    for name, p in pair.named_parameters():
        want = torch.float32 if wan_float32(name.split(".", 1)[1]) else torch.bfloat16
        assert p.dtype == want, name


def test_full_export_keeps_the_islands_float32_and_loads_as_stored(tmp_path):
    """A bf16 full export holds the islands in float32 (a trained time MLP is not rounded), and
    `load_dit` with no dtype reads such a file as stored; other mixed files still need dtype=."""
    from video_dit.families.wan.loading import load_dit
    from video_dit.models.weights import WeightsError
    from video_dit.train.export import _gathered_state

    torch.manual_seed(2)
    fp32 = VideoDiT(CFG)
    ref = fp32.state_dict()
    sd = dict(_gathered_state(fp32, 0, torch.bfloat16, param_dtypes))
    assert sd.keys() == ref.keys()
    for name, t in sd.items():
        want = torch.float32 if wan_float32(name) else torch.bfloat16
        assert t.dtype == want and torch.equal(t, ref[name].to(want)), name
    save_file(sd, str(tmp_path / "export.safetensors"))
    loaded = load_dit(tmp_path / "export.safetensors", config=CFG)
    assert loaded.dtype == torch.bfloat16
    for name, p in loaded.named_parameters():
        assert p.dtype == sd[name].dtype and torch.equal(p.detach(), sd[name]), name
    bad = {**sd, "blocks.0.ffn.0.weight": sd["blocks.0.ffn.0.weight"].float()}  # not an island
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(WeightsError, match="several dtypes.*pass dtype="):
        load_dit(tmp_path / "bad.safetensors", config=CFG)
