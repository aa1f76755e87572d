"""What a job's caches hold, named: the latent and text cache spaces (`data.cache.latent_space` /
`text_space`) of a job on this machine. Equal strings reuse a cache; any difference recomputes it.
The trainer computes them with its loaded encoders; `video-dit inspect-data` without loading any."""

from __future__ import annotations

from pathlib import Path

import torch

from video_dit.data.cache import latent_space, source_identity, text_space
from video_dit.families import family_of, get_preset
from video_dit.models.common import te_quantization
from video_dit.spec import spec_of_job
from video_dit.train.precision import train_dtype


def cache_spaces(process, preset, vae_src: str, te_src: str, vae_dtype, te_dtype, clip_src: str | None = None,
                 image_encoder=None, audio_src: str | None = None) -> tuple[str, str]:
    """(latent space, text space) of a job: everything that changes what the caches hold (preset,
    weights, encoder dtypes, the text encoder's quantization and tokenizer, the i2v tensors stored:
    first-last frame, and the CLIP image encoder whose features sit next to the latents; for a family with
    sound, its audio codec, the rate and channels it reads the clips' tracks at, and each dataset's fps: a
    still's sound spans one frame at it)."""
    m = process.model
    i2v = process.i2v_mode if any(d.do_i2v for d in process.datasets) else "none"
    stores = f"i2v={i2v}"
    if i2v != "none" and process.flf2v:
        stores += "+last_frame"
    if i2v != "none" and image_encoder is not None:
        processor = Path(clip_src) / "image_processor"  # a diffusers folder's normalisation
        stores += (f";clip={source_identity(clip_src, 'image_encoder')};clip_dtype={image_encoder.dtype};"
                   f"clip_quant={bool(m.quantize_image_encoder)}"
                   + (f";clip_processor={source_identity(processor)}" if processor.is_dir() else ""))
    sound = family_of(preset).audio
    if sound is not None and audio_src is not None:  # the audio latents beside the video's
        stores += f";audio={source_identity(audio_src, 'audio_vae')};rate={sound.rate};channels={sound.channels}"
        # an item without a span (a still) caches its dataset's fps and latents of 1 / fps s (trainer.audio_entry)
        stores += ";fps=" + ",".join(f"{d.fps:g}" for d in process.datasets)
    return (latent_space(preset.name, vae_src, vae_dtype, stores=stores),
            text_space(preset.name, te_src, m.tokenizer_path, te_dtype, te_quantization(m)))


def encoder_dtypes(process) -> tuple[torch.dtype, torch.dtype]:
    """(VAE dtype, text / image encoder dtype) the trainer loads the frozen encoders in: the VAE in
    model.vae_dtype (float32 by default, as Wan runs it), the encoders in the training dtype."""
    return process.model.vae_torch_dtype, train_dtype(process.train.dtype, process.train.cpu_bf16)


def job_cache_spaces(process) -> tuple[str, str]:
    """`cache_spaces` of a job as the trainer computes them on this machine (for `video-dit inspect-data`,
    which loads no encoder; on a machine without a GPU the encoders are float32)."""
    spec = spec_of_job(process)
    vae_dtype, te_dtype = encoder_dtypes(process)
    return cache_spaces(process, get_preset(process.model.preset), spec.vae, spec.text_encoder, vae_dtype, te_dtype,
                        audio_src=spec.audio)
