"""`network.streams`: a LoRA on one stream of an audio-video DiT (tiny LTX-2, every weight random). Each stream's
modules are its own attentions and FFN and the cross-modal attention that writes into it (dit.py LORA_STREAMS):
  * the streams partition today's targets (`both` is exactly `Family.lora_targets`);
  * with the other direction of the cross-modal attention cut (its output projection zeroed, so the other stream
    reads nothing of the adapted one), the other stream's output is bit-identical with and without the adapters,
    and its loss gives them no gradient; a misassignment (the cut direction's module in the adapted set) and the
    uncut model both change it, so the check can fail;
  * the trainer's build (`make_trainable`) and the ai-toolkit arch (`network_kwargs.streams`) keep those modules;
    a LoRA file started from (`pretrained_lora_path`) with modules outside the stream is refused at the build;
  * the refusals, before any rank: a family without sound (tiny Wan), one whose streams share their modules
    (MiniMax H3: the family's words), a value that is not a stream, two disagreeing keys."""

from __future__ import annotations

import copy
import re
import types

import helpers
import pytest
import torch
from test_train_config import base_job, error_of, folder, with_key  # noqa: F401 (folder: the fixture)

from video_dit.families.ltx2 import FAMILY as LTX2
from video_dit.families.ltx2.dit import LORA_TARGETS, LTX2DiT
from video_dit.families.ltx2.presets import TINY_LTX2_DIT
from video_dit.families.minimax_h3 import FAMILY as H3
from video_dit.lora import add_lora, save_lora
from video_dit.train.config import parse_job
from video_dit.typed_config import ConfigError

# what the test holds each stream to be (written here, not read from the family): the blocks' own modules and the
# cross-modal attention whose queries are the stream's tokens (its output is added to them)
OWN = {"video": ("attn1", "attn2", "audio_to_video_attn", "ff"),
       "audio": ("audio_attn1", "audio_attn2", "video_to_audio_attn", "audio_ff")}
# the cross-modal attention that carries the adapted stream into the other one: zeroed to cut that path
CARRIES = {"audio": "audio_to_video_attn", "video": "video_to_audio_attn"}
OUTPUT = {"video": 0, "audio": 1}  # the DiT returns (video velocity, audio velocity)
OTHER = {"audio": "video", "video": "audio"}


def dit(cut: str | None = None) -> LTX2DiT:
    """The tiny LTX-2 DiT, every weight random; `cut`: that cross-modal attention's output projection zeroed in
    every block (weight and bias: its output is exactly 0)."""
    model = helpers.randomize_all(LTX2DiT(TINY_LTX2_DIT), seed=0)
    if cut is not None:
        with torch.no_grad():
            for block in model.transformer_blocks:
                getattr(block, cut).to_out[0].weight.zero_()
                getattr(block, cut).to_out[0].bias.zero_()
    return model.eval()


def adapters(model) -> set[str]:
    """The module names peft put an adapter on (its parameters `<module>.lora_A.<adapter>.weight`)."""
    return {n.split(".lora_A.")[0] for n, _ in model.named_parameters() if ".lora_A." in n}


def lora_on(model, targets: str, seed: int = 1):
    """`model` with rank-2 adapters on `targets`, lora_B random (peft starts it at 0: no change to see)."""
    add_lora(model, 2, targets=targets)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def inputs(cfg=TINY_LTX2_DIT) -> dict:
    g = torch.Generator().manual_seed(2)
    return dict(video=torch.randn(1, cfg.in_channels, 2, 2, 2, generator=g), video_timestep=torch.tensor([400.0]),
                video_context=torch.randn(1, 5, cfg.hidden_size, generator=g),
                audio=torch.randn(1, 2, 6, cfg.audio_in_channels // 2, generator=g),
                audio_timestep=torch.tensor([400.0]),
                audio_context=torch.randn(1, 5, cfg.audio_hidden_size, generator=g))


def test_the_streams_partition_todays_targets():
    assert LTX2.stream_lora_targets(False, "both") == LORA_TARGETS == LTX2.lora_targets(False)
    both = adapters(add_lora(LTX2DiT(TINY_LTX2_DIT), 2, targets=LORA_TARGETS))
    got = {s: adapters(add_lora(LTX2DiT(TINY_LTX2_DIT), 2, targets=LTX2.stream_lora_targets(False, s)))
           for s in ("video", "audio")}
    assert got["video"] | got["audio"] == both and not got["video"] & got["audio"]
    blocks = TINY_LTX2_DIT.num_layers
    for stream, names in got.items():
        # per block: 3 attentions x (q, k, v, out) + the FFN's 2 Linears, each on one of the stream's modules
        assert len(names) == blocks * 14
        assert all(re.fullmatch(rf"transformer_blocks\.\d+\.({'|'.join(OWN[stream])})\..+", n) for n in names)


@pytest.mark.parametrize("stream", ["audio", "video"])
def test_one_streams_lora_leaves_the_other_stream_alone(stream):
    other = OTHER[stream]
    kw = inputs()
    base = dit(cut=CARRIES[stream])
    adapted = lora_on(copy.deepcopy(base), LTX2.stream_lora_targets(False, stream))
    with torch.no_grad():
        want, got = base(**kw), adapted(**kw)
    # the other stream never reads the adapted one (cut) and no adapter sits on its modules: bit-identical
    assert torch.equal(got[OUTPUT[other]], want[OUTPUT[other]])
    assert (got[OUTPUT[stream]] - want[OUTPUT[stream]]).abs().max() > 1e-2  # the adapters act on their stream
    adapted(**kw)[OUTPUT[other]].square().mean().backward()
    grads = [p.grad for n, p in adapted.named_parameters() if ".lora_" in n]
    assert grads and all(g is None or not g.any() for g in grads)

    # it can fail: the cut module adapted too (the other stream's cross-modal attention in the set) ...
    wrong = rf"{LTX2.stream_lora_targets(False, stream)}|transformer_blocks\.\d+\.{CARRIES[stream]}\.to_out\.0"
    with torch.no_grad():
        leaked = lora_on(copy.deepcopy(base), wrong)(**kw)[OUTPUT[other]]
    assert (leaked - want[OUTPUT[other]]).abs().max() > 1e-3
    # ... or the path left open: the other stream reads the adapted one in the next cross-modal attention
    open_base = dit()
    with torch.no_grad():
        coupled = lora_on(copy.deepcopy(open_base), LTX2.stream_lora_targets(False, stream))(**kw)[OUTPUT[other]]
        assert (coupled - open_base(**kw)[OUTPUT[other]]).abs().max() > 1e-3


def ltx2_job(folder, tmp_path, **network) -> dict:  # noqa: F811 (folder: the fixture's value)
    job = with_key(base_job(folder, tmp_path), "model.preset", "tiny-ltx2-t2v")
    job = with_key(job, "sample", None)
    for key, value in network.items():
        job = with_key(job, f"network.{key}", value)
    return job


def test_the_trainers_build_adapts_the_streams_modules(folder, tmp_path):  # noqa: F811
    from video_dit.train.build import make_trainable

    for keys in ({"streams": "audio"}, {"network_kwargs": {"streams": "audio"}}):
        process = parse_job(ltx2_job(folder, tmp_path, **keys)).process
        assert process.network.lora_streams == "audio"
        model = make_trainable(LTX2DiT(TINY_LTX2_DIT), process, torch.float32, family=LTX2)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable and all(".lora_" in n for n in trainable)
        names = adapters(model)
        assert len(names) == TINY_LTX2_DIT.num_layers * 14
        assert all(re.fullmatch(rf"transformer_blocks\.\d+\.({'|'.join(OWN['audio'])})\..+", n) for n in names)
    process = parse_job(ltx2_job(folder, tmp_path)).process  # unset: both, today's targets
    assert adapters(make_trainable(LTX2DiT(TINY_LTX2_DIT), process, torch.float32, family=LTX2)) == adapters(
        add_lora(LTX2DiT(TINY_LTX2_DIT), 2, targets=LORA_TARGETS))


def test_a_file_started_from_keeps_to_the_stream(folder, tmp_path):  # noqa: F811
    """`pretrained_lora_path` brings its own modules: a file of both streams under `streams: audio` is refused
    at the build, naming the key; a file of the audio stream's starts the audio adapters."""
    from video_dit.train.build import make_trainable

    for name, targets in (("both", LORA_TARGETS), ("audio", LTX2.stream_lora_targets(False, "audio"))):
        save_lora(tmp_path / f"{name}.safetensors", lora_on(LTX2DiT(TINY_LTX2_DIT), targets), 2.0,
                  comfy=LTX2.lora_to_comfy)
    job = ltx2_job(folder, tmp_path, streams="audio", linear=2, linear_alpha=2,
                   pretrained_lora_path=str(tmp_path / "both.safetensors"))
    with pytest.raises(ConfigError, match=r"pretrained_lora_path: .*both.safetensors holds LoRA on 28 modules "
                                          r"outside the audio stream \(network.streams: audio\).*streams: both"):
        make_trainable(LTX2DiT(TINY_LTX2_DIT), parse_job(job).process, torch.float32, family=LTX2)
    job = with_key(job, "network.pretrained_lora_path", str(tmp_path / "audio.safetensors"))
    model = make_trainable(LTX2DiT(TINY_LTX2_DIT), parse_job(job).process, torch.float32, family=LTX2)
    audio = re.compile(rf"transformer_blocks\.\d+\.({'|'.join(OWN['audio'])})\..+")
    both = adapters(add_lora(LTX2DiT(TINY_LTX2_DIT), 2, targets=LORA_TARGETS))
    assert adapters(model) == {m for m in both if audio.fullmatch(m)}
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if ".lora_B." in n)  # started from the file


def test_refusals_name_the_key(folder, tmp_path):  # noqa: F811
    wan = base_job(folder, tmp_path)  # the tiny Wan: no sound
    msg = error_of(with_key(wan, "network.streams", "audio"))
    assert "network.streams" in msg and "generates no sound" in msg and "accepted: both" in msg
    msg = error_of(with_key(wan, "network.network_kwargs", {"streams": "video"}))
    assert "network.network_kwargs.streams" in msg and "accepted: both" in msg
    with pytest.raises(ValueError, match="same modules: no LoRA target is one stream's alone; accepted: both"):
        H3.stream_lora_targets(False, "audio")  # what the job's check above says of MiniMax H3, under its key
    msg = error_of(ltx2_job(folder, tmp_path, streams="drums"))
    assert "network.streams" in msg and "'video'" in msg and "'audio'" in msg
    msg = error_of(ltx2_job(folder, tmp_path, network_kwargs={"streams": "drums"}))
    assert "network.network_kwargs.streams" in msg and "both, video, audio" in msg
    msg = error_of(ltx2_job(folder, tmp_path, streams="audio", network_kwargs={"streams": "video"}))
    assert "network.network_kwargs.streams" in msg and "disagrees with network.streams" in msg
    assert parse_job(ltx2_job(folder, tmp_path, streams="video")).process.network.lora_streams == "video"


@pytest.fixture()
def aitk():
    import aitk_standin

    yield aitk_standin.activate()
    aitk_standin.deactivate()


def test_the_ai_toolkit_arch_keeps_the_streams_modules(aitk):
    """`network_kwargs.streams` through the arch's `network` setter, on the stand-in's LoRASpecialNetwork
    (ai-toolkit's: every Linear of the blocks, `streams` taken as one of its **kwargs and kept by none)."""
    from toolkit.lora_special import LoRASpecialNetwork

    from video_dit.integrations.ai_toolkit.model import VideoDiTModel, network_modules

    model = LTX2DiT(TINY_LTX2_DIT)
    block_names = types.SimpleNamespace(get_transformer_block_names=lambda: ["transformer_blocks"])
    # what the setter reads of the arch: its family and the model it names (trained weights: a LoRA is allowed)
    arch = types.SimpleNamespace(family=LTX2, spec=types.SimpleNamespace(
        request=types.SimpleNamespace(name_or_path="/weights/ltx2.safetensors")))

    def attach(streams=None):
        kwargs = {} if streams is None else {"streams": streams}
        net = LoRASpecialNetwork(model, 2, 2.0, network_config=types.SimpleNamespace(network_kwargs=kwargs),
                                 base_model=block_names, target_lin_modules=("LTX2DiT",), **kwargs)
        VideoDiTModel.network.fset(arch, net)
        return network_modules(arch._network)

    every = attach()
    for stream in ("audio", "video"):
        kept = attach(stream)
        want = [m for m in every if re.fullmatch(rf"transformer_blocks\.\d+\.({'|'.join(OWN[stream])})\..+", m)]
        assert kept == want and 0 < len(kept) < len(every)
    with pytest.raises(ConfigError, match="network.network_kwargs.streams.*accepted: both, video, audio"):
        attach("drums")
