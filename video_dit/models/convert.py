"""State-dict key conversion between the native (original Wan checkpoint) names and diffusers'
names, both ways, for the DiT and the VAE. Pure functions over dicts of tensors."""

from __future__ import annotations

import torch

# ---------------------------------------------------------------- DiT (issue 2)

# ---------------------------------------------------------------- VAE (issue 3)
