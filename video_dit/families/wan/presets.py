"""The Wan 2.1 / 2.2 presets: each model's DiT, VAE, text encoder (and for Wan 2.1 I2V / FLF2V the CLIP
image encoder) configs and the reference's sampling defaults. Numbers are those of the public Wan 2.1 /
2.2 releases (Wan2.1 wan/configs/, generate.py). Wan's generate.py defaults, which every Wan preset
starts from (`_WAN`): UniPC, 50 steps, shift 5, guidance 5, the shared negative prompt, train shift 3, 16 fps
(Wan2.1 generate.py lines 72-81, 231, 244)."""

from __future__ import annotations

from dataclasses import replace

from video_dit.families.contract import Preset, lookup_preset
from video_dit.families.wan.config import DiTConfig
from video_dit.families.wan.image_encoder import ImageEncoderConfig
from video_dit.families.wan.text_encoder import TextEncoderConfig
from video_dit.families.wan.vae import VAEConfig

# Wan 2.1 VAE latent statistics (16 channels), from the Wan 2.1 release.
WAN21_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
              0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
WAN21_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
             3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)

VAE_PRESETS: dict[str, VAEConfig] = {
    # 8x spatial, 4x temporal, 16 channels; trained by `video-dit train-vae` for the demo.
    "tiny": VAEConfig(dim=16, z_dim=16, dim_mult=(1, 2, 2, 2), num_res_blocks=1,
                    mean=(0.0,) * 16, std=(1.0,) * 16),
    # The embedded default's VAE: the same 8x spatial, 4x temporal, 16 channels, with Wan 2.2's 2x2
    # pixel patchify in front of two 2x levels (instead of three) and the Wan 2.1 blocks: its top
    # level runs at half the resolution, so a training step takes about half the time of `tiny`'s
    # (docs/demo_recipe.md).
    "tiny-p2": VAEConfig(dim=16, z_dim=16, dim_mult=(1, 2, 2), temperal_downsample=(True, True),
                       num_res_blocks=1, patch_size=2, mean=(0.0,) * 16, std=(1.0,) * 16),
    "wan2.1": VAEConfig(dim=96, z_dim=16, dim_mult=(1, 2, 4, 4), num_res_blocks=2,
                      mean=WAN21_MEAN, std=WAN21_STD),
    # 16x spatial (2x2 patchify + 8x), 48 channels, residual up/down blocks. Latent statistics
    # from the Wan 2.2 release (`Wan2_2_VAE` in wan/modules/vae2_2.py; diffusers' TI2V-5B vae config).
    "wan2.2": VAEConfig(
        dim=160, dec_dim=256, z_dim=48, dim_mult=(1, 2, 4, 4), num_res_blocks=2, is_residual=True, patch_size=2,
        mean=(-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
              -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
              -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
              -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
              -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
              0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667),
        std=(0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
             0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
             0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
             0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
             0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
             0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744)),
}

# Wan's default negative prompt: `sample_neg_prompt` of wan/configs/shared_config.py line 19 (Wan2.1 and
# Wan2.2, the same string). Wan's generate() uses it whenever the negative prompt is "" (text2video.py,
# image2video.py, textimage2video.py: `if n_prompt == "": n_prompt = self.sample_neg_prompt`).
WAN_NEGATIVE_PROMPT = "色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走"
# Wan 2.1 I2V-14B prepends "镜头晃动，" ("camera shake"; wan/configs/wan_i2v_14B.py line 11); Wan 2.2
# I2V-A14B does not (wan/configs/wan_i2v_A14B.py keeps the shared one).
WAN21_I2V_NEGATIVE_PROMPT = "镜头晃动，" + WAN_NEGATIVE_PROMPT
# Wan 2.1 FLF2V-14B prepends "镜头切换，" ("shot change") to the I2V one (wan/configs/__init__.py line 18).
WAN21_FLF2V_NEGATIVE_PROMPT = "镜头切换，" + WAN21_I2V_NEGATIVE_PROMPT

UMT5_XXL = TextEncoderConfig()
TINY_TE = TextEncoderConfig(vocab_size=384, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
                          text_len=64, tokenizer="byt5")
VIT_H_14 = ImageEncoderConfig()  # Wan 2.1 I2V / FLF2V: 257 tokens x 1280 per image
# 32 px, 8 px patches: 17 tokens x 32 per image (tests; random weights, seeded)
TINY_CLIP = ImageEncoderConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, image_size=32,
                             patch_size=8)
WAN21_I2V_DIT = DiTConfig(in_dim=36, out_dim=16, dim=5120, ffn_dim=13824, num_heads=40, num_layers=40,
                        image_dim=VIT_H_14.hidden_size, image_tokens=VIT_H_14.tokens)
TINY_CLIP_I2V_DIT = DiTConfig(in_dim=36, out_dim=16, dim=128, ffn_dim=384, freq_dim=64, text_dim=64, num_heads=4,
                            num_layers=4, text_len=64, image_dim=TINY_CLIP.hidden_size, image_tokens=TINY_CLIP.tokens)


def _wan(name: str, dit, vae, vae_name: str, text_encoder, **changes) -> Preset:
    """A Wan preset: Wan's generate.py defaults (`_WAN`) with the model's own `changes`."""
    return Preset(name, "wan", dit, vae, vae_name, text_encoder, **{**_WAN, **changes})


_WAN = dict(sample_solver="unipc", sample_steps=50, sample_shift=5.0, sample_guidance=5.0,
            sample_negative=WAN_NEGATIVE_PROMPT, train_shift=3.0, fps=16)

# The tiny presets' sampling defaults. No reference: Euler at 20 steps (the demo's previews were tuned
# with them), shift 3, guidance 5, no negative prompt (the text encoder is random: Wan's means nothing).
TINY_SAMPLING = dict(sample_solver="euler", sample_steps=20, sample_shift=3.0, sample_guidance=5.0, sample_negative="",
                   train_shift=3.0, sample_size=(17, 64, 64))

# Default sizes (frames, height, width). 480p: diffusers' WanPipeline / WanImageToVideoPipeline defaults
# (pipeline_wan.py lines 330-332, pipeline_wan_i2v.py lines 401-403 in diffusers 0.42.1: 81 frames, 480 x 832).
# 720p: Wan's '1280*720' size (wan/configs/__init__.py SIZE_CONFIGS; diffusers' WanPipeline example, line 68)
# at Wan's default 81 frames (generate.py `frame_num`). The tiny presets: the embedded demo's clips
# (`make-demo-data`: 17 frames of 64 x 64).
SIZE_480P, SIZE_720P = (81, 480, 832), (81, 720, 1280)


WAN_PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        _wan("tiny",
             DiTConfig(in_dim=16, dim=128, ffn_dim=384, freq_dim=64, text_dim=64, out_dim=16,
                       num_heads=4, num_layers=4, text_len=64),
             VAE_PRESETS["tiny"], "tiny", TINY_TE, **TINY_SAMPLING),
        # Wan2.1 generate.py: t2v 50 steps (line 72), shift 5.0 (line 77; 3.0 only for 480p i2v),
        # guidance 5.0 (line 244), unipc (line 231); the shared negative prompt.
        _wan("wan2.1-t2v-1.3b",
             DiTConfig(dim=1536, ffn_dim=8960, num_heads=12, num_layers=30),
             VAE_PRESETS["wan2.1"], "wan2.1", UMT5_XXL, sample_steps=50, sample_shift=5.0, sample_guidance=5.0,
             sample_size=SIZE_480P),  # Wan's SUPPORTED_SIZES['t2v-1.3B']: 480p only
        _wan("wan2.1-t2v-14b",
             DiTConfig(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40),
             VAE_PRESETS["wan2.1"], "wan2.1", UMT5_XXL, sample_steps=50, sample_shift=5.0, sample_guidance=5.0,
             sample_size=SIZE_720P),
        # Wan2.2 wan/configs/wan_ti2v_5B.py lines 32-35: fps 24, shift 5.0, 50 steps, guidance 5.0 (t2v
        # and i2v alike: generate.py lines 84-91 take them from the config); unipc (generate.py line 204).
        _wan("wan2.2-ti2v-5b",
             DiTConfig(in_dim=48, out_dim=48, dim=3072, ffn_dim=14336, num_heads=24, num_layers=30),
             VAE_PRESETS["wan2.2"], "wan2.2", UMT5_XXL, sample_steps=50, sample_shift=5.0,
             sample_guidance=5.0, train_shift=5.0, i2v_mode="replace", fps=24,
             sample_size=(121, 704, 1280)),  # wan_ti2v_5B.py frame_num 121; SUPPORTED_SIZES['ti2v-5B'] 1280*704
        # Wan 2.2 A14B: two experts of one 14B shape (diffusion/experts.py), Wan 2.1's VAE (wan/configs/
        # wan_t2v_A14B.py, wan_i2v_A14B.py: `vae_checkpoint = 'Wan2.1_VAE.pth'`), the shared negative prompt.
        # wan_t2v_A14B.py lines 34-37: shift 12.0, 40 steps, boundary 0.875, guidance (3.0, 4.0) for (low,
        # high) noise; wan_i2v_A14B.py lines 34-37: shift 5.0, 40 steps, boundary 0.900, guidance (3.5, 3.5).
        # Here sample_guidance is the high-noise expert's, sample_guidance_2 the low-noise one's (diffusers'
        # guidance_scale / guidance_scale_2). Train shift 5: ai-toolkit's for both (its wan22 14B models train
        # with wan22_5b_model.py's scheduler_config, shift 5.0); Wan publishes none.
        _wan("wan2.2-t2v-a14b",
             DiTConfig(dim=5120, ffn_dim=13824, num_heads=40, num_layers=40),
             VAE_PRESETS["wan2.1"], "wan2.1", UMT5_XXL, sample_steps=40, sample_shift=12.0,
             sample_guidance=4.0, sample_guidance_2=3.0, train_shift=5.0, boundary_ratio=0.875,
             sample_size=SIZE_720P),
        _wan("wan2.2-i2v-a14b",
             DiTConfig(in_dim=36, out_dim=16, dim=5120, ffn_dim=13824, num_heads=40, num_layers=40),
             VAE_PRESETS["wan2.1"], "wan2.1", UMT5_XXL, sample_steps=40, sample_shift=5.0,
             sample_guidance=3.5, sample_guidance_2=3.5, train_shift=5.0, i2v_mode="concat", boundary_ratio=0.9,
             sample_size=SIZE_720P),
        # Wan 2.1 I2V: channel concat (in_dim 36) + the first frame's CLIP features through the image
        # branch. 480P and 720P share the architecture. Wan2.1 generate.py samples i2v with 40 steps
        # (line 74) at shift 3 for 480p sizes, else 5 (lines 77-79), guidance 5.0 (line 244), and the
        # I2V negative prompt (wan/configs/wan_i2v_14B.py line 11).
        # Train shifts are ours (Wan publishes none): the sampling shift of the resolution.
        _wan("wan2.1-i2v-14b-480p", WAN21_I2V_DIT, VAE_PRESETS["wan2.1"], "wan2.1", UMT5_XXL,
             sample_steps=40, sample_shift=3.0, sample_guidance=5.0, sample_negative=WAN21_I2V_NEGATIVE_PROMPT,
             train_shift=3.0, i2v_mode="concat", image_encoder=VIT_H_14, sample_size=SIZE_480P),
        _wan("wan2.1-i2v-14b-720p", WAN21_I2V_DIT, VAE_PRESETS["wan2.1"], "wan2.1", UMT5_XXL,
             sample_steps=40, sample_shift=5.0, sample_guidance=5.0, sample_negative=WAN21_I2V_NEGATIVE_PROMPT,
             train_shift=5.0, i2v_mode="concat", image_encoder=VIT_H_14, sample_size=SIZE_720P),
        # Wan 2.1 FLF2V: the first and last frame (mask + VAE) and both frames' CLIP features (514 tokens,
        # + img_emb.emb_pos). Wan2.1 generate.py: 50 steps ("i2v" is not in "flf2v-14B", line 73), shift
        # 16 (line 81), guidance 5.0; its negative prompt (wan/configs/__init__.py line 18).
        _wan("wan2.1-flf2v-14b-720p", replace(WAN21_I2V_DIT, num_images=2), VAE_PRESETS["wan2.1"], "wan2.1",
             UMT5_XXL, sample_steps=50, sample_shift=16.0, sample_guidance=5.0,
             sample_negative=WAN21_FLF2V_NEGATIVE_PROMPT, train_shift=5.0, i2v_mode="concat",
             image_encoder=VIT_H_14, sample_size=SIZE_720P),
        # Tiny Wan 2.1-style I2V / FLF2V (random init, tests): tiny DiT widths, in_dim 36, a tiny CLIP;
        # the tiny preset's sampling defaults.
        _wan("tiny-clip-i2v", TINY_CLIP_I2V_DIT, VAE_PRESETS["tiny"], "tiny", TINY_TE, **TINY_SAMPLING,
             i2v_mode="concat", image_encoder=TINY_CLIP),
        # Tiny two-expert model (random init, tests): two tiny DiTs split at T2V-A14B's boundary.
        _wan("tiny-a14b",
             DiTConfig(in_dim=16, dim=128, ffn_dim=384, freq_dim=64, text_dim=64, out_dim=16,
                       num_heads=4, num_layers=4, text_len=64),
             VAE_PRESETS["tiny"], "tiny", TINY_TE, **TINY_SAMPLING, boundary_ratio=0.875),
        _wan("tiny-clip-flf2v", replace(TINY_CLIP_I2V_DIT, num_images=2), VAE_PRESETS["tiny"], "tiny", TINY_TE,
             **TINY_SAMPLING, i2v_mode="concat", image_encoder=TINY_CLIP),
    ]
}


def get_preset(name: str) -> Preset:
    """This family's preset called `name` (a KeyError naming the nearest and listing them otherwise)."""
    return lookup_preset(WAN_PRESETS, name)
