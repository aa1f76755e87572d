"""MiniMax H3: a joint video + audio DiT (MiniMaxAI/MiniMax-H3) with a causal-CNN / ViT video VAE
(`vae.py`), a DAC / BigVGAN audio VAE (`audio_vae.py`) and a Qwen3-VL conditioner (`encoders.py`)."""
