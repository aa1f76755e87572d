"""lora.py: peft adapters <-> ComfyUI-keyed files, exact round trips and clear mismatches."""

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from video_dit import lora
from video_dit.families.wan.dit import LORA_TARGETS as WAN_LORA_TARGETS
from video_dit.families.wan.dit import lora_targets as wan_lora_targets
from video_dit.models.weights import WeightsError


class _Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.self_attn = nn.ModuleDict({n: nn.Linear(d, d) for n in "qkvo"})
        self.cross_attn = nn.ModuleDict({n: nn.Linear(d, d) for n in "qkvo"})
        self.ffn = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))


class _Net(nn.Module):  # Wan-named stand-in; the real DiT is tested in test_dit*.py
    def __init__(self, d=8, n=2):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(d) for _ in range(n))
        self.head = nn.Linear(d, d)

    def forward(self, x):
        for b in self.blocks:
            x = x + b.ffn(b.self_attn["o"](b.cross_attn["v"](x)))
        return self.head(x)


def _trained(rank=4, alpha=2.0, seed=0):
    torch.manual_seed(seed)
    net = lora.add_lora(_Net(), rank, alpha, targets=WAN_LORA_TARGETS)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.normal_()
    return net


def test_only_adapters_train_and_targets_are_the_blocks_linears():
    net = _trained()
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    modules = {n.split(".lora_")[0] for n in trainable}
    assert "head" not in modules and len(modules) == 2 * (4 + 4 + 2)


def test_file_uses_comfy_keys_and_round_trips(tmp_path):
    net = _trained(alpha=2.0)
    path = lora.save_lora(tmp_path / "l.safetensors", net, alpha=2.0, metadata={"step": 7})
    keys = set(load_file(path))
    assert "diffusion_model.blocks.1.self_attn.q.lora_A.weight" in keys
    assert "diffusion_model.blocks.1.self_attn.q.alpha" in keys
    assert all(k.startswith("diffusion_model.") for k in keys)
    _, alpha, rank, meta = lora.read_lora(path)
    assert (alpha, rank, meta["step"], meta["format"]) == (2.0, 4, "7", lora.FILE_FORMAT)

    torch.manual_seed(0)  # same base weights, fresh adapters
    fresh = lora.load_lora(path, _Net())
    x = torch.randn(3, 8)
    assert torch.equal(fresh(x), net(x))
    assert not torch.equal(_Net()(x), net(x))


def test_peft_style_keys_without_alpha_mean_alpha_equals_rank():
    net = _trained(rank=4)
    sd = {f"transformer.{k}": v for k, v in lora.lora_state_dict(net).items()}
    native, alpha, rank = lora.from_comfy(sd)
    assert (alpha, rank) == (4.0, 4) and set(native) == set(lora.lora_state_dict(net))


def test_lora_for_another_model_names_file_and_keys(tmp_path):
    path = lora.save_lora(tmp_path / "l.safetensors", _trained(), alpha=2.0)
    other = nn.Module()
    other.blocks = nn.ModuleList([_Block(16)])
    with pytest.raises(WeightsError) as err:
        lora.load_lora(path, other)
    msg = str(err.value)
    assert "l.safetensors" in msg and "wrong shape" in msg and "unexpected" in msg


def test_image_branch_layers_are_targeted_with_comfy_keys(tmp_path):
    """Wan 2.1 I2V: k_img / v_img always; img_emb's Linears only with include_img_emb; ComfyUI keys;
    a file with img_emb adapters loads into a fresh model (its targets follow the file)."""
    from video_dit.families.wan.loading import load_dit

    plain = lora.add_lora(load_dit("preset:tiny-clip-i2v"), 2, targets=WAN_LORA_TARGETS)
    modules = {n.split(".lora_")[0] for n, _ in plain.named_parameters() if ".lora_A." in n}
    assert {"blocks.0.cross_attn.k_img", "blocks.3.cross_attn.v_img"} <= modules
    assert not any(m.startswith("img_emb") or "norm_k_img" in m for m in modules)
    assert len(modules) == 4 * (4 + 4 + 2 + 2)
    full = lora.add_lora(load_dit("preset:tiny-clip-i2v"), 2, targets=wan_lora_targets(include_img_emb=True))
    with torch.no_grad():
        for name, p in full.named_parameters():
            if "lora_B" in name:
                p.normal_()
    path = lora.save_lora(tmp_path / "i2v.safetensors", full, alpha=2.0)
    keys = set(load_file(path))
    assert {"diffusion_model.blocks.0.cross_attn.k_img.lora_A.weight", "diffusion_model.img_emb.proj.3.lora_B.weight",
            "diffusion_model.img_emb.proj.1.alpha"} <= keys
    fresh = lora.load_lora(path, load_dit("preset:tiny-clip-i2v"))
    assert lora.lora_state_dict(fresh).keys() == lora.lora_state_dict(full).keys()
    assert all(torch.equal(lora.lora_state_dict(fresh)[k], v) for k, v in lora.lora_state_dict(full).items())
