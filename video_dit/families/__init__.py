"""Model families: one folder per family (`wan/`: Wan 2.1 / 2.2; `hunyuan15/`: HunyuanVideo 1.5; `ltx2/`:
LTX-2, 2.3, 2.5, with sound; `minimax_h3/`: MiniMax H3, with sound), each
building its `Family` record (the contract, `contract.py`: loaders, pipeline, conditioning, memory model,
LoRA keys, checkpoint detection); the registry (`registry.py`) lists them and their presets and knows
no family's internals. Importing this package registers the built-in families, then those named in
`VIDEO_DIT_FAMILIES` (`registry.load_plugins`). Shared code asks these names, never a family module.
How to add a family: docs/models.md, "Adding a family".
"""

from video_dit.families import hunyuan15, ltx2, minimax_h3, wan
from video_dit.families.contract import AudioPath, DiTArch, Family, MemoryModel, Preset, Training, with_dit
from video_dit.families.registry import (
    FAMILIES,
    PRESETS,
    UnknownFamily,
    family_of,
    get_family,
    get_preset,
    identify,
    load_plugins,
    register,
    scheduler_classes,
    vae_family,
)

for _family in (wan.FAMILY, hunyuan15.FAMILY, ltx2.FAMILY, minimax_h3.FAMILY):
    register(_family)
load_plugins()

__all__ = ["AudioPath", "DiTArch", "FAMILIES", "Family", "MemoryModel", "PRESETS", "Preset", "Training", "UnknownFamily",
           "family_of", "get_family", "get_preset", "identify", "load_plugins", "register", "scheduler_classes", "vae_family", "with_dit"]
