"""MiniMax H3 (MiniMax-AI/MiniMax-H3): the audio-video DiT over one packed sequence (`dit.py`, its layers
`layers.py`, its packed-sequence layout `packing.py`, its configuration `dit_config.py`, its checkpoint layouts
`convert.py`), the causal-CNN / ViT video VAE (`vae.py`), the DAC / BigVGAN audio VAE (`audio_vae.py`) and the
Qwen3-VL conditioner (`encoders.py`). Not yet a registered family (no `FAMILY` record)."""
