"""One training objective through our three paths: the DeepSpeed trainer (`Trainer.loss_at`, with the
conditioning and timestep sampler it builds from a parsed job), the sampling pipeline and the
ai-toolkit arch (against the stand-in, with ai-toolkit's own loss steps written out below).

- the DiT gets the same input and the same timestep for the same latents, t and first frame on all
  three paths, in both i2v modes (per-token t = 0 on the clean first frame in replace mode, one t per
  sample in concat);
- the same (t, noise) gives the same loss through the trainer and through ai-toolkit, for the
  first-frame mask settings of `mask_first_frame_loss` and for `timestep_type: weighted`.
"""

from __future__ import annotations

import dataclasses
import types

import aitk_standin
import pytest
import torch
import torch.nn.functional as F

from video_dit.diffusion.aitk_weights import AITK_WEIGHTS
from video_dit.diffusion.conditioning import encode_conditioning
from video_dit.diffusion.flow import add_noise
from video_dit.families import PRESETS, family_of, get_preset

B, T, H, W = 2, 5, 16, 16  # pixels (B, T, 3, H, W) -> latents (B, 16, 2, 2, 2) with the tiny VAE
GRID = torch.linspace(1000, 1, 1000)  # ai-toolkit's flowmatch training timesteps (linear / weighted)


@pytest.fixture(scope="module")
def aitk():
    # an in_dim 36 (concat) variant of the tiny preset, so both i2v modes run on CPU in seconds
    tiny = get_preset("tiny")
    concat = dataclasses.replace(tiny, name="tiny-concat", i2v_mode="concat", train_shift=5.0,
                                 dit=dataclasses.replace(tiny.dit, in_dim=36))
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PRESETS, "tiny-concat", concat)  # the registry's and the family's own (its loaders read it)
        mp.setitem(family_of(tiny).presets, "tiny-concat", concat)
        yield aitk_standin.activate()
        aitk_standin.deactivate()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A dataset folder that passes the job's checks (the batches themselves are built in the test)."""
    from PIL import Image

    d = tmp_path_factory.mktemp("data")
    Image.new("RGB", (16, 16)).save(d / "a.png")
    return d


class Spy(torch.nn.Module):
    """The DiT, recording what each call feeds it."""

    def __init__(self, dit):
        super().__init__()
        self.dit, self.calls = dit, []

    @property
    def device(self):  # ai-toolkit's predict_noise reads unet.device / unet.dtype (the stand-in does too)
        return self.dit.device

    @property
    def dtype(self):
        return self.dit.dtype

    def forward(self, x, t, context):
        self.calls.append((x.detach().clone(), t.detach().clone()))
        return self.dit(x, t, context)


_ARCHS: dict = {}


def arch(aitk, preset: str, **kwargs):
    """The loaded ai-toolkit model for `preset` (one per setting, kept for the module), its DiT head
    randomised (a fresh DiT's zero head predicts 0 everywhere) and wrapped in a Spy."""
    key = (id(aitk), preset, tuple(sorted(kwargs.items())))
    if key not in _ARCHS:
        _ARCHS[key] = _load_arch(aitk, preset, **kwargs)
    sd = _ARCHS[key]
    sd.model.calls.clear()
    return sd


def _load_arch(aitk, preset: str, **kwargs):
    from toolkit.config_modules import ModelConfig

    cfg = ModelConfig(name_or_path=f"preset:{preset}", arch="video_dit", dtype="fp32", model_kwargs=kwargs)
    sd = aitk.VideoDiTModel(device="cpu", model_config=cfg, dtype="fp32",
                            noise_scheduler=aitk.VideoDiTModel.get_train_scheduler())
    sd.load_model()
    with torch.no_grad():
        sd.model.head.head.weight.normal_(std=0.05, generator=torch.Generator().manual_seed(0))
    sd.model = Spy(sd.model.eval())
    return sd


def trainer(sd, folder, preset: str, timestep_type: str = "uniform", **model):
    """Our DeepSpeed trainer's loss path for a parsed job, on the arch's DiT (no ranks: `loss_at` needs
    only these attributes; the conditioning and sampler come from the trainer's own builders)."""
    from video_dit.families.wan import FAMILY as WAN
    from video_dit.train.config import parse_job
    from video_dit.train.trainer import Trainer, job_conditioning, timestep_sampler

    job = parse_job({"job": "extension", "config": {"name": "j", "process": [{
        "datasets": [{"folder_path": str(folder), "do_i2v": True}], "train": {"timestep_type": timestep_type},
        "model": {"name_or_path": f"preset:{preset}", **model}}]}})
    tr = Trainer.__new__(Trainer)
    tr.device, tr.engine = torch.device("cpu"), sd.model
    tr.family, tr.dit_config = WAN, sd.model.dit.config
    tr.conditioning = job_conditioning(job.process, sd.model.dit.config, WAN.training)
    tr.timesteps = timestep_sampler(job.process, get_preset(preset))
    tr.dataset = types.SimpleNamespace(item=lambda i: types.SimpleNamespace(do_i2v=True, conditioned=True))
    return tr


def pixels(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, T, 3, H, W, generator=g) * 2 - 1  # ai-toolkit's (B, T, 3, H, W) in [-1, 1]


_INPUTS: dict = {}


def inputs(sd, mode: str):
    """(pixels, x0, cond for the trainer's cache, embeds, noise) for one batch (the arches share the
    tiny VAE and text encoder weights: the same seeds)."""
    if mode not in _INPUTS:
        _INPUTS[mode] = _make_inputs(sd, mode)
    return _INPUTS[mode]


def _make_inputs(sd, mode: str):
    px = pixels()
    x0 = sd.encode_images(px)  # (B, 16, 2, 2, 2)
    cond = encode_conditioning(sd.vae, px[:, 0], mode, T)  # what the data cache stores
    embeds = sd.get_prompt_embeds(["a red square moving right", "a blue circle"])
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    return px, x0, cond, embeds, noise


def trainer_batch(x0, cond, embeds):
    return {"latents": x0, **cond, "text_embeds": list(embeds.text_embeds), "index": torch.arange(B)}


def aitk_loss(sd, px, x0, embeds, noise, t, timestep_type):
    """One step as SDTrainer runs it (extensions_built_in/sd_trainer/SDTrainer.py at 27a03a91):
    add_noise -> predict_noise(batch=) -> get_loss_target -> mse(reduction="none") -> sd.scale_loss
    -> timestep weight (`timestep_type: weighted`: CustomFlowMatchEulerDiscreteScheduler.
    get_weights_for_timesteps, the table at each t's index on the grid) -> mean([1, 2, 3, 4]) -> mean."""
    from toolkit.data_transfer_object.data_loader import DataLoaderBatchDTO

    batch = DataLoaderBatchDTO(tensor=px, latents=x0, do_i2v=True, num_frames=T)
    noisy = sd.add_noise(x0, noise, t)  # BaseSDTrainProcess: per sample (BaseModel.add_noise)
    pred = sd.predict_noise(noisy, text_embeddings=embeds, timestep=t, batch=batch)
    target = sd.get_loss_target(noise=noise, batch=batch, timesteps=t)
    loss = sd.scale_loss(F.mse_loss(pred.float(), target.float(), reduction="none"))
    if timestep_type == "weighted":
        idx = [(GRID == ti).nonzero().item() for ti in t]
        loss = loss * torch.tensor([AITK_WEIGHTS[i] for i in idx], dtype=t.dtype).view(-1, 1, 1, 1, 1)
    return loss.mean([1, 2, 3, 4]).mean()


@pytest.mark.parametrize("preset,mode", [("tiny", "replace"), ("tiny-concat", "concat")])
def test_trainer_pipeline_and_aitk_feed_the_dit_the_same_input_and_timestep(aitk, folder, preset, mode):
    from toolkit.data_transfer_object.data_loader import DataLoaderBatchDTO

    from video_dit.families.wan.pipeline import VideoPipeline

    sd = arch(aitk, preset)
    px, x0, cond, embeds, noise = inputs(sd, mode)
    # the pipeline: one step from noise; its first call shows the input and timestep it builds
    VideoPipeline(sd.model, sd.vae, dit_config=sd.model.dit.config).generate_latents(
        embeds.text_embeds, None, num_frames=T, height=H, width=W, steps=1, guidance_scale=1.0,
        generator=torch.Generator().manual_seed(2), first_frame=px[:, 0])
    (x_pipe, t_pipe), = sd.model.calls
    t0 = float(t_pipe.max())
    tokens = (H // 8 // 2) * (W // 8 // 2)  # per latent frame: (16 px / 8) / patch 2, squared
    if mode == "replace":  # per token: 0 on the clean first frame, the step's t elsewhere (Wan 2.2 TI2V)
        assert t_pipe.shape == (B, 2 * tokens) and bool((t_pipe[:, :tokens] == 0).all())
        assert bool((t_pipe[:, tokens:] == t0).all())
        assert torch.allclose(x_pipe[:, :, :1], cond["first_frame_latents"], atol=1e-6)
    else:  # one t per sample; [noisy | mask | VAE(first frame + zeros)]
        assert torch.equal(t_pipe, torch.full((B,), t0)) and x_pipe.shape[1] == 36
        assert torch.allclose(x_pipe[:, 20:], cond["cond_latents"], atol=1e-6)
    # the trainer and the arch at that t: the same conditioning of the same x_t
    t = torch.full((B,), t0)
    sd.model.calls.clear()
    trainer(sd, folder, preset).loss_at(trainer_batch(x0, cond, embeds), t, noise)
    with torch.no_grad():
        sd.predict_noise(add_noise(x0, noise, t), text_embeddings=embeds, timestep=t,
                         batch=DataLoaderBatchDTO(tensor=px, latents=x0, do_i2v=True, num_frames=T))
    (x_tr, t_tr), (x_ai, t_ai) = sd.model.calls
    assert torch.equal(t_tr, t_ai) and t_tr.shape == t_pipe.shape and torch.equal(t_tr, t_pipe)
    assert torch.allclose(x_tr, x_ai, atol=1e-6)
    assert torch.allclose(x_tr[:, 16:], x_pipe[:, 16:], atol=1e-6) if mode == "concat" else \
        torch.allclose(x_tr[:, :, :1], x_pipe[:, :, :1], atol=1e-6)


@pytest.mark.parametrize("preset,mode,kwargs,frame0_in_loss,timestep_type", [
    ("tiny", "replace", {}, False, "weighted"),
    ("tiny", "replace", {}, False, "uniform"),
    ("tiny-concat", "concat", {}, True, "weighted"),  # Wan I2V: the prediction of frame 0 is the video's first frame
    ("tiny-concat", "concat", {"mask_first_frame_loss": True}, False, "weighted"),
])
def test_same_job_same_loss_through_the_trainer_and_ai_toolkit(aitk, folder, preset, mode, kwargs,
                                                              frame0_in_loss, timestep_type):
    sd = arch(aitk, preset, **kwargs)
    px, x0, cond, embeds, noise = inputs(sd, mode)
    tr = trainer(sd, folder, preset, timestep_type, model_kwargs=kwargs)
    t = GRID[torch.tensor([120, 830])]  # t = 880, 170: on ai-toolkit's grid (weighted: 1.52, 0.79)
    with torch.no_grad():
        ours = tr.loss_at(trainer_batch(x0, cond, embeds), t, noise)
        theirs = aitk_loss(sd, px, x0, embeds, noise, t, timestep_type)
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-7)
    # the loss by hand, from the DiT's prediction: masked per-sample MSE times the weight
    x_in, t_in = sd.model.calls[0]
    with torch.no_grad():
        pred = sd.model.dit(x_in, t_in, embeds.text_embeds)
    err = (pred - (noise - x0)) ** 2  # (B, C, F', h, w)
    per_sample = err.mean((1, 2, 3, 4)) if frame0_in_loss else err[:, :, 1:].mean((1, 2, 3, 4))
    weight = torch.tensor([AITK_WEIGHTS[120], AITK_WEIGHTS[830]]) if timestep_type == "weighted" else torch.ones(B)
    assert torch.allclose(ours, (per_sample * weight).mean(), rtol=1e-5)


def test_replace_mode_refuses_an_unmasked_first_frame(aitk, folder):
    from video_dit.train.config import parse_job
    from video_dit.typed_config import ConfigError

    with pytest.raises(ConfigError, match=r"model_kwargs\.mask_first_frame_loss.*needs i2v mode 'concat'"):
        arch(aitk, "tiny", mask_first_frame_loss=False)
    job = {"job": "extension", "config": {"name": "j", "process": [{
        "datasets": [{"folder_path": str(folder), "do_i2v": True}],
        "model": {"name_or_path": "preset:tiny", "model_kwargs": {"mask_first_frame_loss": False}}}]}}
    with pytest.raises(ConfigError, match=r"model\.mask_first_frame_loss.*needs i2v_mode 'concat'"):
        parse_job(job)
    job["config"]["process"][0]["model"]["model_kwargs"] = {"mask_first_frame_los": True}
    with pytest.raises(ConfigError, match="did you mean 'mask_first_frame_loss'"):
        parse_job(job)


@pytest.mark.parametrize("preset,shift", [("tiny", 3.0), ("tiny-concat", 5.0)])
def test_both_trainers_train_at_the_presets_shift(aitk, folder, preset, shift):
    """ai-toolkit builds a first scheduler from the class before the model exists (no preset known);
    load_model replaces it with one at the preset's train_shift, which SDTrainer then reads as
    `sd.noise_scheduler`. Our trainer's sampler takes the same shift unless train.timestep_shift says."""
    assert arch(aitk, preset).noise_scheduler.config["shift"] == shift == get_preset(preset).train_shift
    assert aitk.VideoDiTModel.get_train_scheduler().config["shift"] == 3.0  # ai-toolkit's own call: no argument
    sd = arch(aitk, preset)
    assert trainer(sd, folder, preset, "shift").timesteps.shift == shift
