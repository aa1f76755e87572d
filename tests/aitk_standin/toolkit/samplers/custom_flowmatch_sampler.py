"""Stand-in `CustomFlowMatchEulerDiscreteScheduler`: the training surface ai-toolkit's trainer calls.

Behaviour read from ostris/ai-toolkit 27a03a91, toolkit/samplers/custom_flowmatch_sampler.py. Like the
real class it subclasses diffusers' `FlowMatchEulerDiscreteScheduler` (the installed diffusers, a
test-time reference), so `sigma_min`, `sigma_max`, `shift`, `sigmas` and the config are diffusers' own.
- `add_noise`: `(1 - t/1000) x0 + t/1000 noise` with `t/1000` NOT reshaped: ai-toolkit relies on
  `BaseModel.add_noise` calling it one sample at a time ((1,) timesteps broadcast against (1, ...));
  a (B,) timestep tensor for B > 1 broadcasts against the LAST dim here, exactly as in ai-toolkit.
- `scale_model_input`: identity.
- `set_train_timesteps`: "linear" / "weighted" (linspace(1000, 1, n)), "sigmoid" (sorted
  (1 - sigmoid(randn(n))) * 1000) and "shift" / "flux_shift" / "lumina2_shift" (linspace of
  sigma_max..sigma_min on the 0..1000 scale, /1000, shifted by the static `shift`, or by
  `calculate_shift` of the latent size with `use_dynamic_shifting`; sigmas get a trailing 0).
  The karras / exponential / beta conversions and `invert_sigmas` are not used by a video_dit job and
  raise here instead of silently differing; so do the other timestep types.
"""

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler


def calculate_shift(image_seq_len, base_seq_len=256, max_seq_len=4096, base_shift=0.5, max_shift=1.16):
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + base_shift - m * base_seq_len


class CustomFlowMatchEulerDiscreteScheduler(FlowMatchEulerDiscreteScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.init_noise_sigma = 1.0
        self.timestep_type = "linear"

    def add_noise(self, original_samples, noise, timesteps):
        t_01 = (timesteps / 1000).to(original_samples.device)
        return (1.0 - t_01) * original_samples + t_01 * noise

    def scale_model_input(self, sample, timestep):
        return sample

    def set_train_timesteps(self, num_timesteps, device, timestep_type="linear", latents=None, patch_size=1):
        self.timestep_type = timestep_type
        if timestep_type in ("linear", "weighted"):
            self.timesteps = torch.linspace(1000, 1, num_timesteps, device=device)
            return self.timesteps
        if timestep_type == "sigmoid":
            t = torch.sigmoid(torch.randn((num_timesteps,), device=device))
            self.timesteps, _ = torch.sort((1 - t) * 1000, descending=True)
            return self.timesteps
        if timestep_type in ("flux_shift", "lumina2_shift", "shift"):
            cfg = self.config
            for key in ("shift_terminal", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                        "invert_sigmas"):
                if cfg.get(key):
                    raise NotImplementedError(f"stand-in scheduler: {key} with timestep_type {timestep_type!r}")
            timesteps = np.linspace(self._sigma_to_t(self.sigma_max), self._sigma_to_t(self.sigma_min), num_timesteps)
            sigmas = timesteps / cfg.num_train_timesteps
            if cfg.use_dynamic_shifting:
                if latents is None:
                    raise ValueError("latents is None")
                image_seq_len = latents.shape[2] * latents.shape[3] // (patch_size ** 2)
                mu = calculate_shift(image_seq_len, cfg.get("base_image_seq_len", 256),
                                     cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5),
                                     cfg.get("max_shift", 1.16))
                sigmas = self.time_shift(mu, 1.0, sigmas)
            else:
                sigmas = self.shift * sigmas / (1 + (self.shift - 1) * sigmas)
            sigmas = torch.from_numpy(sigmas).to(dtype=torch.float32, device=device)
            self.timesteps = sigmas * cfg.num_train_timesteps
            self.sigmas = torch.cat([sigmas, torch.zeros(1, device=sigmas.device)])
            return self.timesteps
        raise NotImplementedError(f"stand-in scheduler: timestep_type {timestep_type!r}")
