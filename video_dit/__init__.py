"""video_dit: fine-tune Wan-class video diffusion transformers (t2v and i2v) under DeepSpeed.

Import-light on purpose: submodules are imported where used, so `import video_dit` stays fast and
never imports DeepSpeed, diffusers or ai-toolkit.
"""

__version__ = "0.1.0"
