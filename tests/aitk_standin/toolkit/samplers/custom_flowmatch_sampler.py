"""Stand-in `CustomFlowMatchEulerDiscreteScheduler`: the training surface the trainer calls."""

import torch


class CustomFlowMatchEulerDiscreteScheduler:
    def __init__(self, num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False, **kwargs):
        self.config = dict(num_train_timesteps=num_train_timesteps, shift=shift,
                           use_dynamic_shifting=use_dynamic_shifting, **kwargs)
        self.timesteps = torch.linspace(1000, 1, num_train_timesteps)

    def set_train_timesteps(self, num_timesteps, device, timestep_type="linear", latents=None, patch_size=1):
        if timestep_type not in ("linear", "weighted"):
            raise NotImplementedError(f"stand-in scheduler: timestep_type {timestep_type!r}")
        self.timesteps = torch.linspace(1000, 1, num_timesteps, device=device)
        return self.timesteps

    def add_noise(self, original_samples, noise, timesteps):
        t_01 = (timesteps / 1000).to(original_samples.device)
        while t_01.ndim < original_samples.ndim:  # the real one broadcasts per sample the same way
            t_01 = t_01.unsqueeze(-1)
        return (1.0 - t_01) * original_samples + t_01 * noise

    def scale_model_input(self, sample, timestep):
        return sample
