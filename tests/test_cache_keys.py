"""The latent and text caches are keyed by everything that changes what they hold (the trainer's
`cache_spaces`, the ai-toolkit arch's space versions): the preset, the VAE / text encoder / tokenizer
files, the dtype each encoder ran in, the text encoder's quantization type, the i2v tensors stored; for a
model with sound (LTX-2), its audio codec, the rate and channels a track is read at, the datasets' fps,
and per item whether it trains sound and its span. Changing any one of them misses the cache (the
encoder runs again); leaving all equal hits it; what does not change the cached tensors (the DiT's
weights, the vocoder, a caption) does not invalidate it."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

from video_dit import media
from video_dit.data.audio import AudioSpan
from video_dit.data.cache import TEXT_FORMAT, build_cache, item_key, source_identity
from video_dit.data.dataset import scan_datasets
from video_dit.families import get_preset
from video_dit.families.registry import FAMILIES, get_family
from video_dit.spec import model_sources, spec_of_job
from video_dit.train.caches import cache_spaces, encoder_dtypes, job_cache_spaces
from video_dit.train.config import parse_job
from video_dit.train.trainer import audio_entry

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


def test_a_text_cache_of_the_earlier_layout_is_not_read(world):
    """Text entries of the v1 layout (before LTX-2's video context was stored as `text_embeds`) sat at the key
    of the space string without its format; a job of today misses them and encodes its captions again (it
    read them before, and an LTX-2 job then failed with KeyError 'text_embeds')."""
    model, data, raw = world
    p = parse_job(copy.deepcopy(raw)).process
    scan = scan_datasets(p.datasets, 16, verbose=False)
    latent, text = spaces(raw)
    assert text.startswith(f"format={TEXT_FORMAT};") and TEXT_FORMAT.endswith(".v2")
    enc = Counting()
    v1 = text.replace(f"format={TEXT_FORMAT};", "")  # the v1 code's string for the same job
    build_cache(scan, enc.encode, enc.text, space_version=latent, text_space_version=v1, verbose=False)
    assert enc.texts == 2
    build_cache(scan, enc.encode, enc.text, space_version=latent, text_space_version=text, verbose=False)
    assert (enc.latents, enc.texts) == (1, 4)  # the latents hit; both captions encoded again


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


# ---------------------------------------------------------------- sound (a family with `Family.audio`: LTX-2)

LTX2 = "ltx2.3-22b-dev"


def ltx2_folder(path):
    """A diffusers-style LTX-2 folder of stand-in files: the video VAE, the audio VAE + vocoder (the audio
    codec, `ltx2.loading.folder_source`), Gemma + tokenizer + connectors, the DiT."""
    for rel in ("vae/config.json", "vae/diffusion_pytorch_model.safetensors", "audio_vae/config.json",
                "audio_vae/diffusion_pytorch_model.safetensors", "vocoder/config.json",
                "vocoder/diffusion_pytorch_model.safetensors", "text_encoder/config.json",
                "text_encoder/model.safetensors", "tokenizer/tokenizer.json", "connectors/config.json",
                "connectors/diffusion_pytorch_model.safetensors", "transformer/diffusion_pytorch_model.safetensors"):
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(rel.encode() * 8)
    return path


@pytest.fixture()
def sound_world(tmp_path):
    """An LTX-2 model folder, a second audio codec (audio_vae/ + vocoder/), a dataset of one 32x32 clip of 24
    frames at 16 fps with a 440 Hz track, and a raw job (9 consecutive frames at 16 fps: a 9/16 s span)."""
    model = ltx2_folder(tmp_path / "LTX-2.3")
    other = tmp_path / "codec-b"
    for rel in ("audio_vae/config.json", "audio_vae/diffusion_pytorch_model.safetensors",
                "vocoder/config.json", "vocoder/diffusion_pytorch_model.safetensors"):
        (other / rel).parent.mkdir(parents=True, exist_ok=True)
        (other / rel).write_bytes(b"b" + rel.encode() * 8)
    data = tmp_path / "clips"
    data.mkdir()
    t = np.arange(int(1.5 * 16000)) / 16000
    media.write_video(np.full((24, 32, 32, 3), 100, np.uint8), data / "a.mp4", fps=16,
                      audio=0.5 * np.sin(2 * np.pi * 440 * t)[None], audio_rate=16000)
    (data / "a.txt").write_text("a tone")
    raw = {"job": "extension", "config": {"name": "j", "process": [{
        "training_folder": str(tmp_path / "out"), "network": {"type": "lora", "linear": 4},
        "datasets": [{"folder_path": str(data), "resolution": [32], "num_frames": 9, "fps": 16,
                      "shrink_video_to_frames": False}],
        "model": {"name_or_path": str(model), "preset": LTX2}}]}}
    return model, other, data, raw


def job_spaces(raw, audio_src: str | None = None):
    """The spaces of a job as the trainer computes them; with sound, its own audio codec (`spec_of_job`, as
    `job_cache_spaces` resolves it), or `audio_src` (another codec: the trainer passes `spec.audio`)."""
    p = parse_job(copy.deepcopy(raw)).process
    if audio_src is None:
        return job_cache_spaces(p)
    spec = spec_of_job(p)
    vae_dtype, te_dtype = encoder_dtypes(p)
    return cache_spaces(p, get_preset(p.model.preset), spec.vae, spec.text_encoder, vae_dtype, te_dtype,
                        audio_src=audio_src)


def with_dataset(raw, **dataset):
    raw = copy.deepcopy(raw)
    raw["config"]["process"][0]["datasets"][0].update(dataset)
    return raw


def test_the_audio_codec_rate_and_channels_change_the_latent_space_only(sound_world, monkeypatch):
    model, other, data, raw = sound_world
    p = parse_job(copy.deepcopy(raw)).process
    assert spec_of_job(p).audio == str(model)  # the model's own audio_vae/ + vocoder/
    latent, text = base = job_spaces(raw)
    assert job_spaces(raw) == base == job_spaces(raw, str(model))
    # composed here from its parts: the video VAE's space, then the codec's identity, rate and channels
    vae_dtype, _ = encoder_dtypes(p)
    assert latent == (f"preset={LTX2};vae={source_identity(model, 'vae')};vae_dtype={vae_dtype};stores=i2v=none"
                      f";audio={source_identity(model, 'audio_vae')};rate=16000;channels=2;fps=16")

    def changes(new, which):
        assert (new[0] != latent, new[1] != text) == ("latent" in which, "text" in which), (new, base)

    # (each fails with caches.py's `stores += f";audio=...` line removed)
    changes(job_spaces(raw, str(other)), {"latent"})  # another codec
    touch(model / "vocoder" / "diffusion_pytorch_model.safetensors")
    changes(job_spaces(raw), set())  # the vocoder decodes only: the cached latents are the audio VAE's
    touch(model / "audio_vae" / "diffusion_pytorch_model.safetensors")  # the codec's weights replaced
    changes(job_spaces(raw), {"latent"})
    latent = job_spaces(raw)[0]
    family = get_family("ltx2")
    for change in ({"rate": 24000}, {"channels": 1}):  # what a clip's track is read at
        sound = dataclasses.replace(family.audio, **change)
        monkeypatch.setitem(FAMILIES, "ltx2", dataclasses.replace(family, audio=sound))
        changes(job_spaces(raw), {"latent"})
    monkeypatch.setitem(FAMILIES, "ltx2", family)
    assert job_spaces(raw)[0] == latent
    # each dataset's fps (fails without caches.py's `stores += ";fps=..."`; why: the test of a still below)
    changes(job_spaces(with_dataset(raw, fps=8)), {"latent"})


class ShapeCodec:
    """An audio codec's `latent_shape` as LTX-2's (16 kHz, hop 160, 4x: 25 latent frames a second)."""

    def latent_shape(self, num_frames, fps):
        return 8, max(1, round(num_frames / fps * 25)), 16


def test_a_stills_sound_follows_its_datasets_fps(sound_world):
    """A still has no span: what the trainer caches for its sound (`audio_entry`: zeros of a 1-frame clip's
    length at its dataset's fps, and that fps) changes with the fps while its item key does not, so the
    latent space carries every dataset's fps (a bug found here: 16 and 8 fps shared one entry)."""
    model, other, data, raw = sound_world
    Image.new("RGB", (32, 32), (200, 30, 30)).save(data / "b.png")
    (data / "a.mp4").unlink()
    stills = {fps: _sound_item(raw, fps=fps) for fps in (16, 8)}
    assert stills[16].audio_span is None and item_key(stills[16]) == item_key(stills[8])
    sound = get_family("ltx2").audio
    cached = {fps: audio_entry(item, ShapeCodec(), sound, fps, "cpu", torch.float32) for fps, item in stills.items()}
    assert cached[16]["fps"].item() == 16 and cached[8]["fps"].item() == 8
    assert cached[16]["audio_latents"].shape == (1, 8, 2, 16) and cached[8]["audio_latents"].shape == (1, 8, 3, 16)
    assert job_spaces(raw)[0] != job_spaces(with_dataset(raw, fps=8))[0]


def test_a_job_without_sound_has_no_audio_part(world, sound_world):
    model, data, raw = world
    p = parse_job(copy.deepcopy(raw)).process
    latent, _ = job_spaces(raw)
    vae_dtype, _ = encoder_dtypes(p)
    assert latent == f"preset={PRESET};vae={source_identity(model, 'vae')};vae_dtype={vae_dtype};stores=i2v=none"
    # a family without sound ignores an audio source handed to it (the trainer passes None)
    vae_src, te_src = model_sources(p)
    codec = str(sound_world[1])
    assert cache_spaces(p, get_preset(PRESET), vae_src, te_src, vae_dtype, vae_dtype, audio_src=codec)[0] == latent


def _sound_item(raw, sound=True, **dataset):
    """The one item of the sound world's dataset (with `dataset` keys changed), scanned in a job with sound or not."""
    p = parse_job(copy.deepcopy(with_dataset(raw, **dataset))).process
    (item,) = scan_datasets(p.datasets, 32, verbose=False, audio=sound).items
    return item


def test_an_items_key_follows_its_sound_and_span(sound_world):
    model, other, data, raw = sound_world
    item = _sound_item(raw)
    assert item.has_audio and item.audio_span == AudioSpan(0.0, 9 / 16)
    key = item_key(item)
    parts = [item.path, item.size, item.mtime_ns, "video", list(range(9)), [9, 32, 32], list(item.resize),
             list(item.crop), False]
    # a job without sound: the item is scanned without a span and keyed as before sound (no audio part)
    silent_job = _sound_item(raw, sound=False)
    assert silent_job.audio_span is None and not silent_job.has_audio
    assert item_key(silent_job) == hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    assert key != item_key(silent_job)
    # `audio: off`: the same frames and span, trained as the picture alone (fails without `item.has_audio`)
    off = _sound_item(raw, audio="off")
    assert off.audio_span == item.audio_span and off.frames == item.frames and not off.has_audio
    assert item_key(off) != key
    # the span alone (fails without `[span.start, span.duration]`): a later start, a longer duration
    assert item_key(dataclasses.replace(item, audio_span=AudioSpan(0.0625, 9 / 16))) != key
    assert item_key(dataclasses.replace(item, audio_span=AudioSpan(0.0, 10 / 16))) != key
    # another fps: other frames and another span
    half = _sound_item(raw, fps=8)
    assert half.audio_span == AudioSpan(0.0, 18 / 16) and item_key(half) != key
    # what the cached tensors do not depend on
    for change in ({"caption": "another"}, {"num_repeats": 3}, {"caption_dropout_rate": 0.5}, {"dataset": 2}):
        assert item_key(dataclasses.replace(item, **change)) == key, change


def test_a_cache_built_for_one_audio_codec_misses_for_another(sound_world):
    model, other, data, raw = sound_world
    p = parse_job(copy.deepcopy(raw)).process
    scan = scan_datasets(p.datasets, 32, verbose=False, audio=True)
    enc, tracks = Counting(), []

    def audio_fn(item):
        tracks.append(item.path)
        return {"audio_latents": torch.zeros(1, 8, 14, 16), "has_audio": torch.ones(1, dtype=torch.bool)}

    def build(raw, audio_src=None):
        latent, text = job_spaces(raw, audio_src)
        before = (enc.latents, len(tracks), enc.texts)
        build_cache(scan, enc.encode, enc.text, space_version=latent, text_space_version=text, verbose=False,
                    audio_fn=audio_fn)
        return enc.latents - before[0], len(tracks) - before[1], enc.texts - before[2]

    assert build(raw) == (1, 1, 2)
    assert build(raw) == (0, 0, 0)
    assert build(raw, str(other)) == (1, 1, 0)  # the text cache is the codec's no concern
    assert build(raw, str(other)) == (0, 0, 0)
    assert build(raw) == (0, 0, 0)  # the first codec's entry is still there
