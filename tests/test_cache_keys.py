"""The latent and text caches are keyed by everything that changes what they hold (the trainer's
`cache_spaces`, the ai-toolkit arch's space versions): the preset, the VAE / text encoder / tokenizer
files, the dtype each encoder ran in, the text encoder's quantization type, the i2v tensors stored.
Changing any one of them misses the cache (the encoder runs again); leaving all equal hits it; what
does not change the cached tensors (the DiT's weights) does not invalidate it."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from video_dit.data.cache import build_cache, source_identity
from video_dit.data.dataset import scan_datasets
from video_dit.families import get_preset
from video_dit.spec import model_sources
from video_dit.train.caches import cache_spaces
from video_dit.train.config import parse_job

PRESET = "wan2.1-t2v-1.3b"


def touch(path, data: bytes | None = None):
    """Rewrite a file (same size unless `data`) and move its mtime forward, as replacing weights does."""
    path.write_bytes(data if data is not None else path.read_bytes())
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


@pytest.fixture()
def world(tmp_path):
    """A diffusers-style model folder (files stand in for weights: identity is what they are, not
    what they hold), a dataset folder with one image, and a raw job using both."""
    from PIL import Image

    model = tmp_path / "Wan2.1-T2V-1.3B-Diffusers"
    for rel in ("vae/config.json", "vae/diffusion_pytorch_model.safetensors", "text_encoder/config.json",
                "text_encoder/model-00001-of-00002.safetensors", "tokenizer/tokenizer.json",
                "transformer/diffusion_pytorch_model.safetensors"):
        (model / rel).parent.mkdir(parents=True, exist_ok=True)
        (model / rel).write_bytes(rel.encode() * 8)
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (32, 32), (200, 30, 30)).save(data / "a.png")
    (data / "a.txt").write_text("a red square")
    raw = {"job": "extension", "config": {"name": "j", "process": [{
        "training_folder": str(tmp_path / "out"), "network": {"type": "lora", "linear": 4},
        "datasets": [{"folder_path": str(data), "resolution": [32]}],
        "model": {"name_or_path": str(model), "preset": PRESET}}]}}
    return model, data, raw


def spaces(raw, vae_dtype=torch.float32, te_dtype=torch.float32):
    p = parse_job(copy.deepcopy(raw)).process
    vae_src, te_src = model_sources(p)
    return cache_spaces(p, get_preset(p.model.preset), vae_src, te_src, vae_dtype, te_dtype)


def with_model(raw, **model):
    raw = copy.deepcopy(raw)
    raw["config"]["process"][0]["model"].update(model)
    return raw


def test_each_ingredient_changes_its_space_and_only_its_own(world):
    model, data, raw = world
    latent, text = base = spaces(raw)
    assert spaces(raw) == base  # the same job: the same keys (a hit)

    def changes(new, which):  # which: the spaces that must differ, the others must be equal
        assert (new[0] != latent, new[1] != text) == ("latent" in which, "text" in which), (new, base)

    changes(spaces(raw, vae_dtype=torch.bfloat16), {"latent"})
    changes(spaces(raw, te_dtype=torch.bfloat16), {"text"})
    q8 = spaces(with_model(raw, quantize_te=True, qtype_te="qfloat8"))
    changes(q8, {"text"})
    changes(spaces(with_model(raw, quantize_te=True, qtype_te="qint8")), {"text"})
    assert spaces(with_model(raw, quantize_te=True, qtype_te="qint8"))[1] != q8[1]  # qtype_te, not only quantize_te
    assert spaces(with_model(raw, quantize_te=True, qtype_te="float8")) == q8  # ai-toolkit's name for qfloat8
    changes(spaces(with_model(raw, quantize=True, qtype="qint8")), set())  # the DiT's quantization: no
    changes(spaces(with_model(raw, preset="wan2.1-t2v-14b")), {"latent", "text"})  # same VAE, other preset
    do_i2v = copy.deepcopy(raw)
    do_i2v["config"]["process"][0]["datasets"][0]["do_i2v"] = True
    changes(spaces(do_i2v), {"latent"})  # the first-frame tensors are stored too
    touch(model / "transformer" / "diffusion_pytorch_model.safetensors")
    changes(spaces(raw), set())  # new DiT weights: the encoders' outputs are the same
    touch(model / "vae" / "diffusion_pytorch_model.safetensors")  # same size, new mtime
    changes(spaces(raw), {"latent"})
    latent = spaces(raw)[0]
    touch(model / "vae" / "config.json", b'{"z_dim": 16}')  # the VAE's config (latent mean / std)
    changes(spaces(raw), {"latent"})
    latent = spaces(raw)[0]
    touch(model / "text_encoder" / "model-00001-of-00002.safetensors")  # one shard of the text encoder
    changes(spaces(raw), {"text"})
    text = spaces(raw)[1]
    touch(model / "tokenizer" / "tokenizer.json")
    changes(spaces(raw), {"text"})


def test_a_single_vae_file_is_keyed_with_the_config_beside_it(tmp_path):
    """The tiny VAE stage writes `tiny_vae.safetensors` + `config.json` (its measured latent stats)."""
    vae = tmp_path / "tiny_vae.safetensors"
    vae.write_bytes(b"weights")
    alone = source_identity(vae)
    (tmp_path / "config.json").write_text("{}")
    with_config = source_identity(vae)
    assert with_config != alone
    touch(tmp_path / "config.json", b'{"mean": [0.1]}')
    assert source_identity(vae) != with_config
    assert source_identity("preset:tiny") == "preset:tiny"


class Counting:
    """Stand-ins for the VAE and text encoder that count what they encode."""

    def __init__(self):
        self.latents = self.texts = 0

    def encode(self, video):
        self.latents += 1
        return {"latents": video[:, :, :1, ::8, ::8].repeat(1, 2, 1, 1, 1)}

    def text(self, captions):
        self.texts += len(captions)
        return [torch.full((3, 8), float(len(c))) for c in captions]


def test_a_changed_space_misses_the_cache_and_an_equal_one_hits(world):
    model, data, raw = world
    p = parse_job(copy.deepcopy(raw)).process
    scan = scan_datasets(p.datasets, 16, verbose=False)
    enc = Counting()

    def build(space_pair):
        before = (enc.latents, enc.texts)
        build_cache(scan, enc.encode, enc.text, space_version=space_pair[0], text_space_version=space_pair[1],
                    verbose=False)
        return enc.latents - before[0], enc.texts - before[1]

    assert build(spaces(raw)) == (1, 2)  # one clip; its caption and the empty prompt
    assert build(spaces(raw)) == (0, 0)  # equal keys: a hit
    assert build(spaces(with_model(raw, quantize_te=True, qtype_te="qint8"))) == (0, 2)
    assert build(spaces(raw, vae_dtype=torch.bfloat16)) == (1, 0)
    touch(model / "vae" / "diffusion_pytorch_model.safetensors")
    assert build(spaces(raw)) == (1, 0)
    assert build(spaces(raw)) == (0, 0)


def test_the_ai_toolkit_arch_keys_its_caches_alike():
    """ai-toolkit keys its latent / text caches by the arch's `latent_space_version` /
    `text_embedding_space_version` (toolkit/dataloader_mixins.py): the same ingredients."""
    import aitk_standin

    aitk = aitk_standin.activate()
    try:
        from toolkit.config_modules import ModelConfig

        def versions(**model):
            cfg = ModelConfig(**{"name_or_path": "preset:tiny", "arch": "video_dit", "dtype": "fp32", **model})
            sd = aitk.VideoDiTModel(device="cpu", model_config=cfg, dtype="fp32")
            sd.load_model()
            return sd.latent_space_version, sd.text_embedding_space_version

        base = versions()
        assert versions() == base
        te_bf16, vae_bf16 = versions(te_dtype="bf16"), versions(vae_dtype="bf16")
        assert te_bf16[0] == base[0] and te_bf16[1] != base[1]
        assert vae_bf16[0] != base[0] and vae_bf16[1] == base[1]
        q8, qi8 = versions(quantize_te=True, qtype_te="qfloat8"), versions(quantize_te=True, qtype_te="qint8")
        assert len({base[1], q8[1], qi8[1]}) == 3 and q8[0] == qi8[0] == base[0]
    finally:
        aitk_standin.deactivate()
