"""load_vae: presets, diffusers `vae/` folders, original Wan `.pth` files and `.safetensors` files
(original or diffusers key names), with clear errors on mismatches."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from video_dit.families.wan.convert import vae_config_to_diffusers, vae_from_diffusers, vae_key_layout, vae_to_diffusers
from video_dit.families.wan.loading import load_vae
from video_dit.families.wan.presets import VAE_PRESETS
from video_dit.families.wan.vae import CausalVideoVAE, VAEConfig
from video_dit.models.weights import WeightsError

CFG = VAEConfig(dim=8, dec_dim=12, z_dim=6, dim_mult=(1, 2, 2), num_res_blocks=1, temperal_downsample=(True, True),
                is_residual=True, patch_size=2, mean=tuple(0.1 * i for i in range(6)), std=(2.0,) * 6)


def _same_weights(a: torch.nn.Module, b: dict[str, torch.Tensor]) -> bool:
    sa = a.state_dict()
    return set(sa) == set(b) and all(torch.equal(sa[k], b[k]) for k in b)


def test_preset_is_seeded_and_uses_the_preset_config():
    a, b = load_vae("preset:tiny"), load_vae("preset:tiny")
    assert a.config == VAE_PRESETS["tiny"]
    assert _same_weights(a, b.state_dict())
    assert not _same_weights(load_vae("preset:tiny", seed=1), a.state_dict())
    assert load_vae("preset:tiny", dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(WeightsError, match="unknown VAE preset 'wan2.3'.*tiny, tiny-p2, wan2.1, wan2.2"):
        load_vae("preset:wan2.3")


def test_diffusers_vae_folder(tmp_path):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    ref = diffusers.AutoencoderKLWan(**vae_config_to_diffusers(CFG))
    ref.save_pretrained(tmp_path / "pipe" / "vae")
    vae = load_vae(tmp_path / "pipe")  # a pipeline folder holding vae/
    assert vae.config == CFG
    assert vae_key_layout(ref.state_dict()) == "diffusers"
    assert _same_weights(vae, vae_from_diffusers(ref.state_dict()))
    assert torch.allclose(vae.latent_std.flatten(), torch.tensor(CFG.std))


def test_original_pth_and_safetensors(tmp_path):
    torch.manual_seed(0)
    src = CausalVideoVAE(VAE_PRESETS["tiny"])
    sd = src.state_dict()
    torch.save(sd, tmp_path / "Wan2.1_VAE.pth")
    vae = load_vae(tmp_path / "Wan2.1_VAE.pth")  # config found by matching the preset shapes
    assert vae.config == VAE_PRESETS["tiny"] and _same_weights(vae, sd)
    save_file(vae_to_diffusers(sd), str(tmp_path / "diffusers_keys.safetensors"))
    vae = load_vae(tmp_path / "diffusers_keys.safetensors")
    assert _same_weights(vae, sd)
    with torch.no_grad():  # a loaded model computes what the source model computes
        video = torch.rand(1, 3, 5, 16, 16) * 2 - 1
        assert torch.equal(vae.encode(video).mean, src.encode(video).mean)

    other = CausalVideoVAE(CFG).state_dict()
    save_file(other, str(tmp_path / "custom.safetensors"))
    with pytest.raises(WeightsError, match="custom.safetensors.*match no VAE preset.*config="):
        load_vae(tmp_path / "custom.safetensors")
    assert _same_weights(load_vae(tmp_path / "custom.safetensors", config=CFG), other)


def test_mismatch_errors_name_the_file_and_keys(tmp_path):
    sd = CausalVideoVAE(CFG).state_dict()
    broken = dict(sd)
    broken.pop("decoder.head.2.bias")
    broken["encoder.conv1.weight"] = torch.zeros(3, 3, 3, 3, 3)
    broken["decoder.extra.weight"] = torch.zeros(1)
    torch.save(broken, tmp_path / "broken.pth")
    with pytest.raises(WeightsError) as err:
        load_vae(tmp_path / "broken.pth", config=CFG)
    msg = str(err.value)
    assert "broken.pth" in msg and "native layout" in msg
    assert "missing: decoder.head.2.bias" in msg and "unexpected: decoder.extra.weight" in msg
    assert "encoder.conv1.weight: file (3, 3, 3, 3, 3) vs model (8, 12, 3, 3, 3)" in msg
    save_file({"foo.weight": torch.zeros(1)}, str(tmp_path / "foo.safetensors"))
    with pytest.raises(WeightsError, match="foo.safetensors: not a Wan VAE state dict"):
        load_vae(tmp_path / "foo.safetensors")
    (tmp_path / "vae").mkdir()
    save_file(vae_to_diffusers(sd), str(tmp_path / "vae" / "diffusion_pytorch_model.safetensors"))
    (tmp_path / "vae" / "config.json").write_text(json.dumps({"base_dim": 8, "zdim": 6}))
    with pytest.raises(WeightsError, match=r"config.json: .*unknown keys \['zdim'\]"):
        load_vae(tmp_path / "vae")
