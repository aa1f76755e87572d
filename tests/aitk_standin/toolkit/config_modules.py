"""Stand-in of ai-toolkit's `toolkit/config_modules.py` (ostris/ai-toolkit at 27a03a91): the config
classes a model extension meets, with ai-toolkit's REAL default values, so a test can build each from
its defaults and drive our arch with exactly what ai-toolkit would hand it.

The tables below are that commit's `self.<attribute> = kwargs.get(<key>, <default>)` lines of
`SampleItem`, `SampleConfig`, `TrainConfig` and `DatasetConfig`, in order (`SaveConfig` written out) (DERIVED: a default computed
from another value, set by the class as the real one does); `GenerateImageConfig` keeps the real
signature and defaults. Post-processing that changes a value a model sees is carried (seed -1, ext,
caption_ext, sizes rounded to 8, prompt-string flags); validation of unrelated features is not.
`ModelConfig` carries the fields the adapter reads, with their real defaults.
"""

import copy
import os
import random
import time
from types import SimpleNamespace

DERIVED = object()

# SampleItem.__init__ at 27a03a91: (attribute, key, default); DERIVED defaults are set in the class
SAMPLE_ITEM = (
    ('prompt', 'prompt', None),
    ('width', 'width', DERIVED),
    ('height', 'height', DERIVED),
    ('neg', 'neg', DERIVED),
    ('seed', 'seed', None),
    ('guidance_scale', 'guidance_scale', DERIVED),
    ('sample_steps', 'sample_steps', DERIVED),
    ('fps', 'fps', DERIVED),
    ('num_frames', 'num_frames', DERIVED),
    ('ctrl_img', 'ctrl_img', None),
    ('ctrl_idx', 'ctrl_idx', 0),
    ('ctrl_img_1', 'ctrl_img_1', DERIVED),
    ('ctrl_img_2', 'ctrl_img_2', None),
    ('ctrl_img_3', 'ctrl_img_3', None),
    ('network_multiplier', 'network_multiplier', DERIVED),
    ('do_cfg_norm', 'do_cfg_norm', False),
)

# SampleConfig.__init__ at 27a03a91: (attribute, key, default); DERIVED defaults are set in the class
SAMPLE_CONFIG = (
    ('sampler', 'sampler', 'ddpm'),
    ('sample_every', 'sample_every', 100),
    ('sample_start_step', 'sample_start_step', 0),
    ('width', 'width', 512),
    ('height', 'height', 512),
    ('neg', 'neg', False),
    ('seed', 'seed', 0),
    ('walk_seed', 'walk_seed', False),
    ('guidance_scale', 'guidance_scale', 7),
    ('sample_steps', 'sample_steps', 20),
    ('network_multiplier', 'network_multiplier', 1),
    ('guidance_rescale', 'guidance_rescale', 0.0),
    ('ext', 'format', 'jpg'),
    ('adapter_conditioning_scale', 'adapter_conditioning_scale', 1.0),
    ('refiner_start_at', 'refiner_start_at', 0.5),
    ('extra_values', 'extra_values', []),
    ('num_frames', 'num_frames', 1),
    ('fps', 'fps', 16),
    ('do_cfg_norm', 'do_cfg_norm', False),
)

# TrainConfig.__init__ at 27a03a91: (attribute, key, default); DERIVED defaults are set in the class
TRAIN_CONFIG = (
    ('noise_scheduler', 'noise_scheduler', 'ddpm'),
    ('content_or_style', 'content_or_style', 'balanced'),
    ('content_or_style_reg', 'content_or_style', 'balanced'),
    ('steps', 'steps', 1000),
    ('lr', 'lr', 1e-06),
    ('unet_lr', 'unet_lr', DERIVED),
    ('text_encoder_lr', 'text_encoder_lr', DERIVED),
    ('refiner_lr', 'refiner_lr', DERIVED),
    ('embedding_lr', 'embedding_lr', DERIVED),
    ('adapter_lr', 'adapter_lr', DERIVED),
    ('optimizer', 'optimizer', 'adamw'),
    ('optimizer_params', 'optimizer_params', {}),
    ('lr_scheduler', 'lr_scheduler', 'constant'),
    ('lr_scheduler_params', 'lr_scheduler_params', {}),
    ('min_denoising_steps', 'min_denoising_steps', 0),
    ('max_denoising_steps', 'max_denoising_steps', 999),
    ('batch_size', 'batch_size', 1),
    ('dtype', 'dtype', 'fp32'),
    ('xformers', 'xformers', False),
    ('sdp', 'sdp', False),
    ('attention_backend', 'attention_backend', 'native'),
    ('train_unet', 'train_unet', True),
    ('train_text_encoder', 'train_text_encoder', False),
    ('train_refiner', 'train_refiner', True),
    ('train_turbo', 'train_turbo', False),
    ('show_turbo_outputs', 'show_turbo_outputs', False),
    ('min_snr_gamma', 'min_snr_gamma', None),
    ('snr_gamma', 'snr_gamma', None),
    ('learnable_snr_gos', 'learnable_snr_gos', False),
    ('noise_offset', 'noise_offset', 0.0),
    ('skip_first_sample', 'skip_first_sample', False),
    ('force_first_sample', 'force_first_sample', False),
    ('gradient_checkpointing', 'gradient_checkpointing', True),
    ('weight_jitter', 'weight_jitter', 0.0),
    ('merge_network_on_save', 'merge_network_on_save', False),
    ('merge_network_on_save_strength', 'merge_network_on_save_strength', 1.0),
    ('max_grad_norm', 'max_grad_norm', 1.0),
    ('start_step', 'start_step', None),
    ('free_u', 'free_u', False),
    ('adapter_assist_name_or_path', 'adapter_assist_name_or_path', None),
    ('adapter_assist_type', 'adapter_assist_type', 't2i'),
    ('noise_multiplier', 'noise_multiplier', 1.0),
    ('target_noise_multiplier', 'target_noise_multiplier', 1.0),
    ('random_noise_multiplier', 'random_noise_multiplier', 0.0),
    ('do_signal_correction_noise', 'do_signal_correction_noise', False),
    ('do_batch_noise_correction', 'do_batch_noise_correction', False),
    ('batch_noise_correction_scale', 'batch_noise_correction_scale', 0.1),
    ('do_signal_amplification', 'do_signal_amplification', False),
    ('signal_amplification_strength', 'signal_amplification_strength', 0.5),
    ('signal_correction_noise_scale', 'signal_correction_noise_scale', 1.0),
    ('random_noise_shift', 'random_noise_shift', 0.0),
    ('img_multiplier', 'img_multiplier', 1.0),
    ('noisy_latent_multiplier', 'noisy_latent_multiplier', 1.0),
    ('latent_multiplier', 'latent_multiplier', 1.0),
    ('negative_prompt', 'negative_prompt', None),
    ('max_negative_prompts', 'max_negative_prompts', 1),
    ('reg_weight', 'reg_weight', 1.0),
    ('num_train_timesteps', 'num_train_timesteps', 1000),
    ('adaptive_scaling_factor', 'adaptive_scaling_factor', False),
    ('prompt_dropout_prob', 'prompt_dropout_prob', 0.0),
    ('match_noise_norm', 'match_noise_norm', False),
    ('gradient_accumulation_steps', 'gradient_accumulation_steps', 1),
    ('gradient_accumulation', 'gradient_accumulation', 1),
    ('short_and_long_captions', 'short_and_long_captions', False),
    ('short_and_long_captions_encoder_split', 'short_and_long_captions_encoder_split', False),
    ('single_item_batching', 'single_item_batching', False),
    ('match_adapter_chance', 'match_adapter_chance', 0.0),
    ('loss_target', 'loss_target', 'noise'),
    ('inverted_mask_prior', 'inverted_mask_prior', False),
    ('inverted_mask_prior_multiplier', 'inverted_mask_prior_multiplier', 0.5),
    ('diff_output_preservation', 'diff_output_preservation', False),
    ('diff_output_preservation_multiplier', 'diff_output_preservation_multiplier', 1.0),
    ('diff_output_preservation_class', 'diff_output_preservation_class', ''),
    ('blank_prompt_preservation', 'blank_prompt_preservation', False),
    ('blank_prompt_preservation_multiplier', 'blank_prompt_preservation_multiplier', 1.0),
    ('standardize_images', 'standardize_images', False),
    ('standardize_latents', 'standardize_latents', False),
    ('dynamic_noise_offset', 'dynamic_noise_offset', False),
    ('do_cfg', 'do_cfg', False),
    ('do_random_cfg', 'do_random_cfg', False),
    ('cfg_scale', 'cfg_scale', 1.0),
    ('max_cfg_scale', 'max_cfg_scale', DERIVED),
    ('cfg_rescale', 'cfg_rescale', None),
    ('correct_pred_norm', 'correct_pred_norm', False),
    ('correct_pred_norm_multiplier', 'correct_pred_norm_multiplier', 1.0),
    ('loss_type', 'loss_type', 'mse'),
    ('t0_loss_target', 't0_loss_target', False),
    ('t0_velocity_equiv_weight', 't0_velocity_equiv_weight', False),
    ('do_fft_loss', 'do_fft_loss', False),
    ('do_fft_velocity_equiv_weight', 'do_fft_velocity_equiv_weight', False),
    ('pred_scaler', 'pred_scaler', 1.0),
    ('prompt_saturation_chance', 'prompt_saturation_chance', 0.0),
    ('do_prior_divergence', 'do_prior_divergence', False),
    ('target_norm_std', 'target_norm_std', None),
    ('target_norm_std_value', 'target_norm_std_value', 1.0),
    ('timestep_type', 'timestep_type', 'sigmoid'),
    ('next_sample_timesteps', 'next_sample_timesteps', 8),
    ('linear_timesteps', 'linear_timesteps', False),
    ('linear_timesteps2', 'linear_timesteps2', False),
    ('disable_sampling', 'disable_sampling', False),
    ('unload_text_encoder', 'unload_text_encoder', False),
    ('cache_text_embeddings', 'cache_text_embeddings', False),
    ('do_paramiter_swapping', 'do_paramiter_swapping', False),
    ('paramiter_swapping_factor', 'paramiter_swapping_factor', 0.1),
    ('bypass_guidance_embedding', 'bypass_guidance_embedding', False),
    ('latent_feature_extractor_path', 'latent_feature_extractor_path', None),
    ('latent_feature_loss_weight', 'latent_feature_loss_weight', 1.0),
    ('diffusion_feature_extractor_path', 'diffusion_feature_extractor_path', DERIVED),
    ('diffusion_feature_extractor_weight', 'diffusion_feature_extractor_weight', DERIVED),
    ('optimal_noise_pairing_samples', 'optimal_noise_pairing_samples', 1),
    ('force_consistent_noise', 'force_consistent_noise', False),
    ('blended_blur_noise', 'blended_blur_noise', False),
    ('do_guidance_loss', 'do_guidance_loss', False),
    ('guidance_loss_target', 'guidance_loss_target', 3.0),
    ('do_guidance_loss_cfg_zero', 'do_guidance_loss_cfg_zero', False),
    ('guidance_loss_schedule', 'guidance_loss_schedule', 'constant'),
    ('unconditional_prompt', 'unconditional_prompt', ''),
    ('do_differential_guidance', 'do_differential_guidance', False),
    ('differential_guidance_scale', 'differential_guidance_scale', 3.0),
    ('switch_boundary_every', 'switch_boundary_every', 1),
    ('do_blank_stabilization', 'do_blank_stabilization', False),
    ('audio_loss_multiplier', 'audio_loss_multiplier', 1.0),
    ('max_loss_debug', 'max_loss_debug', False),
    ('max_loss', 'max_loss', None),
)

# DatasetConfig.__init__ at 27a03a91: (attribute, key, default); DERIVED defaults are set in the class
DATASET_CONFIG = (
    ('batch_size', 'batch_size', None),
    ('type', 'type', 'image'),
    ('folder_path', 'folder_path', None),
    ('dataset_path', 'dataset_path', None),
    ('default_caption', 'default_caption', None),
    ('trigger_word', 'trigger_word', None),
    ('diff_output_preservation', 'diff_output_preservation', False),
    ('diff_output_preservation_class', 'diff_output_preservation_class', ''),
    ('random_triggers_max', 'random_triggers_max', 1),
    ('caption_ext', 'caption_ext', '.txt'),
    ('random_scale', 'random_scale', False),
    ('random_crop', 'random_crop', False),
    ('resolution', 'resolution', 512),
    ('scale', 'scale', 1.0),
    ('buckets', 'buckets', True),
    ('bucket_tolerance', 'bucket_tolerance', 64),
    ('is_reg', 'is_reg', False),
    ('prior_reg', 'prior_reg', False),
    ('network_weight', 'network_weight', 1.0),
    ('token_dropout_rate', 'token_dropout_rate', 0.0),
    ('shuffle_tokens', 'shuffle_tokens', False),
    ('caption_dropout_rate', 'caption_dropout_rate', 0.0),
    ('keep_tokens', 'keep_tokens', 0),
    ('flip_x', 'flip_x', False),
    ('flip_y', 'flip_y', False),
    ('augments', 'augments', []),
    ('control_path', 'control_path', None),
    ('control_from_same_folder', 'control_from_same_folder', False),
    ('num_controls_from_same_folder', 'num_controls_from_same_folder', 1),
    ('control_transparent_color', 'control_transparent_color', [0, 0, 0]),
    ('inpaint_path', 'inpaint_path', None),
    ('full_size_control_images', 'full_size_control_images', True),
    ('alpha_mask', 'alpha_mask', False),
    ('mask_path', 'mask_path', None),
    ('unconditional_path', 'unconditional_path', None),
    ('invert_mask', 'invert_mask', False),
    ('mask_min_value', 'mask_min_value', 0.0),
    ('poi', 'poi', None),
    ('use_short_captions', 'use_short_captions', False),
    ('num_repeats', 'num_repeats', 1),
    ('cache_latents', 'cache_latents', False),
    ('cache_latents_to_disk', 'cache_latents_to_disk', False),
    ('cache_tensors_to_disk', 'cache_tensors_to_disk', False),
    ('cache_clip_vision_to_disk', 'cache_clip_vision_to_disk', False),
    ('cache_text_embeddings', 'cache_text_embeddings', False),
    ('load_image_when_caching_latents', 'load_image_when_caching_latents', False),
    ('standardize_images', 'standardize_images', False),
    ('augmentations', 'augmentations', None),
    ('shuffle_augmentations', 'shuffle_augmentations', False),
    ('guidance_type', 'guidance_type', 'targeted'),
    ('clip_image_path', 'clip_image_path', None),
    ('clip_image_from_same_folder', 'clip_image_from_same_folder', False),
    ('clip_image_augmentations', 'clip_image_augmentations', None),
    ('clip_image_shuffle_augmentations', 'clip_image_shuffle_augmentations', False),
    ('replacements', 'replacements', []),
    ('loss_multiplier', 'loss_multiplier', 1.0),
    ('num_workers', 'num_workers', 2),
    ('prefetch_factor', 'prefetch_factor', 2),
    ('cache_latents_num_workers', 'cache_latents_num_workers', DERIVED),
    ('extra_values', 'extra_values', []),
    ('square_crop', 'square_crop', False),
    ('replay_transforms', 'replay_transforms', True),
    ('num_frames', 'num_frames', 1),
    ('shrink_video_to_frames', 'shrink_video_to_frames', True),
    ('fps', 'fps', 24),
    ('auto_frame_count', 'auto_frame_count', False),
    ('trim_auto_frame_count_tail', 'trim_auto_frame_count_tail', True),
    ('debug', 'debug', False),
    ('controls', 'controls', []),
    ('fast_image_size', 'fast_image_size', False),
    ('do_i2v', 'do_i2v', False),
    ('do_audio', 'do_audio', False),
    ('audio_preserve_pitch', 'audio_preserve_pitch', False),
    ('audio_normalize', 'audio_normalize', False),
)


def _fill(obj, table, kwargs, derived):
    """Set each attribute from `kwargs[key]`, else its default (DERIVED: `derived[attribute](obj)`)."""
    for attr, key, default in table:
        if key in kwargs:
            value = kwargs[key]
        elif default is DERIVED:
            value = derived[attr](obj)
        else:
            value = copy.deepcopy(default)
        setattr(obj, attr, value)


class SaveConfig:
    def __init__(self, **kwargs):
        self.save_every = kwargs.get("save_every", 1000)
        self.dtype = kwargs.get("dtype", "float16")
        self.max_step_saves_to_keep = kwargs.get("max_step_saves_to_keep", 5)
        self.save_format = kwargs.get("save_format", "safetensors")
        if self.save_format not in ["safetensors", "diffusers"]:
            raise ValueError(f"save_format must be safetensors or diffusers, got {self.save_format}")
        self.push_to_hub = kwargs.get("push_to_hub", False)
        self.hf_repo_id = kwargs.get("hf_repo_id", None)
        self.hf_private = kwargs.get("hf_private", False)


class SampleItem:
    def __init__(self, sample_config, **kwargs):
        sc = sample_config
        _fill(self, SAMPLE_ITEM, kwargs, {
            "width": lambda s: sc.width, "height": lambda s: sc.height, "neg": lambda s: sc.neg,
            "guidance_scale": lambda s: sc.guidance_scale, "sample_steps": lambda s: sc.sample_steps,
            "fps": lambda s: sc.fps, "num_frames": lambda s: sc.num_frames, "ctrl_img_1": lambda s: s.ctrl_img,
            "network_multiplier": lambda s: sc.network_multiplier})
        if isinstance(self.network_multiplier, str):
            try:
                self.network_multiplier = float(self.network_multiplier)
            except ValueError:
                self.network_multiplier = 1.0


class SampleConfig:
    def __init__(self, **kwargs):
        _fill(self, SAMPLE_CONFIG, kwargs, {})
        if self.num_frames > 1 and self.ext not in ["webp"]:
            self.ext = "webp"  # the real one prints "Changing sample extention to animated webp"
        prompts = kwargs.get("prompts", [])
        raw_samples = kwargs.get("samples", [{"prompt": p} for p in prompts])
        self.samples = [SampleItem(self, **item) for item in raw_samples]

    @property
    def prompts(self):
        return [sample.prompt for sample in self.samples if sample.prompt is not None]


class TrainConfig:
    def __init__(self, **kwargs):
        lr = lambda s: s.lr  # noqa: E731
        _fill(self, TRAIN_CONFIG, kwargs, {
            "unet_lr": lr, "text_encoder_lr": lr, "refiner_lr": lr, "embedding_lr": lr, "adapter_lr": lr,
            "max_cfg_scale": lambda s: s.cfg_scale,
            "diffusion_feature_extractor_path": lambda s: s.latent_feature_extractor_path,
            "diffusion_feature_extractor_weight": lambda s: s.latent_feature_loss_weight})
        self.orig_batch_size = self.batch_size
        if self.gradient_accumulation > 1 and self.gradient_accumulation_steps != 1:
            raise ValueError("gradient_accumulation and gradient_accumulation_steps are mutually exclusive")
        if self.cfg_rescale is None:
            self.cfg_rescale = self.cfg_scale
        ema = kwargs.get("ema_config", None)
        ema = {**ema, "use_ema": True} if ema is not None and ema.get("use_ema", False) else {"use_ema": False}
        self.ema_config = SimpleNamespace(**{"ema_decay": 0.999, "use_feedback": False, "param_multiplier": 1.0,
                                             **ema})
        self.validation_config = None
        if kwargs.get("validation_config") is not None:
            v = kwargs["validation_config"]
            self.validation_config = SimpleNamespace(
                validation_items=v.get("validation_items", []), resolution=v.get("resolution", 512),
                validate_every_n_steps=v.get("validate_every_n_steps", 10),
                validation_sigmas=v.get("validation_sigmas", [1.0, 0.75, 0.5, 0.25]))


class DatasetConfig:
    def __init__(self, **kwargs):
        _fill(self, DATASET_CONFIG, kwargs, {"cache_latents_num_workers": lambda s: min(6, os.cpu_count() or 1)})
        self.random_triggers = kwargs.get("random_triggers", [])
        if self.caption_ext and not self.caption_ext.startswith("."):
            self.caption_ext = "." + self.caption_ext
        if self.control_path == "":
            self.control_path = None
        paths = [p for p in (kwargs.get(f"control_path_{i}") for i in (1, 2, 3)) if p]
        if paths:
            self.control_path = paths
        if self.poi is not None:
            raise ValueError("poi is deprecated and is no longer supported")
        if (len(self.augments) > 0 or self.augmentations) and (self.cache_latents or self.cache_latents_to_disk):
            self.cache_latents = self.cache_latents_to_disk = False
        if kwargs.get("caption_type", None):
            self.caption_ext = kwargs["caption_type"]
        self.caption_type = self.caption_ext
        if isinstance(self.controls, str):
            self.controls = [self.controls]
        self.controls = [c for c in self.controls if c.strip() != ""]


class ModelConfig:
    def __init__(self, **kwargs):
        self.name_or_path = kwargs.get("name_or_path", None)
        if self.name_or_path is None:
            raise ValueError("name_or_path must be specified")
        self.dtype = kwargs.get("dtype", "float16")
        self.vae_path = kwargs.get("vae_path", None)
        self.te_name_or_path = kwargs.get("te_name_or_path", None)
        self.vae_dtype = kwargs.get("vae_dtype", self.dtype)
        self.te_dtype = kwargs.get("te_dtype", self.dtype)
        self.quantize = kwargs.get("quantize", False)
        self.quantize_te = kwargs.get("quantize_te", self.quantize)
        self.qtype = kwargs.get("qtype", "qfloat8")
        self.qtype_te = kwargs.get("qtype_te", "qfloat8")
        self.low_vram = kwargs.get("low_vram", False)
        self.layer_offloading = kwargs.get("layer_offloading", kwargs.get("auto_memory", False))
        if self.layer_offloading and self.qtype == "qfloat8":
            self.qtype = "float8"
        if self.layer_offloading and self.qtype_te == "qfloat8":
            self.qtype_te = "float8"
        self.latent_space_version = kwargs.get("latent_space_version", None)
        self.model_kwargs = kwargs.get("model_kwargs", {})
        self.is_v_pred = kwargs.get("is_v_pred", False)
        self.use_text_encoder_1 = kwargs.get("use_text_encoder_1", True)
        self.use_text_encoder_2 = kwargs.get("use_text_encoder_2", True)
        self.arch = kwargs.get("arch", None)
        if self.arch is not None and ":" in self.arch:  # the UI passes arch:tag
            self.arch = self.arch.split(":")[0]


class GenerateImageConfig:
    def __init__(self, prompt="", prompt_2=None, width=512, height=512, num_inference_steps=50, guidance_scale=7.5,
                 negative_prompt="", negative_prompt_2=None, seed=-1, network_multiplier=1.0, guidance_rescale=0.0,
                 output_path=None, output_folder=None, output_ext="jpg", output_tail="", add_prompt_file=False,
                 adapter_image_path=None, adapter_conditioning_scale=1.0, latents=None, extra_kwargs=None,
                 refiner_start_at=0.5, extra_values=None, logger=None, ctrl_img=None, ctrl_img_1=None,
                 ctrl_img_2=None, ctrl_img_3=None, num_frames=1, fps=15, ctrl_idx=0, do_cfg_norm=False):
        # the real default of output_ext is the `ImgExt` Literal type itself; every caller passes one
        self.width, self.height = width, height
        self.num_inference_steps, self.guidance_scale = num_inference_steps, guidance_scale
        self.guidance_rescale = guidance_rescale
        self.prompt, self.prompt_2 = prompt, prompt_2
        self.negative_prompt, self.negative_prompt_2 = negative_prompt, negative_prompt_2
        self.latents = latents
        self.output_path = output_path
        self.seed = seed if seed != -1 else random.randint(0, 2 ** 32 - 1)
        self.network_multiplier = network_multiplier
        self.output_folder, self.output_ext = output_folder, output_ext
        self.add_prompt_file, self.output_tail = add_prompt_file, output_tail
        self.gen_time = int(time.time() * 1000)
        self.adapter_image_path, self.adapter_conditioning_scale = adapter_image_path, adapter_conditioning_scale
        self.extra_kwargs = extra_kwargs if extra_kwargs is not None else {}
        self.refiner_start_at = refiner_start_at
        self.extra_values = extra_values if extra_values is not None else []
        self.num_frames, self.fps = num_frames, fps
        self.ctrl_img, self.ctrl_idx = ctrl_img, ctrl_idx
        if ctrl_img_1 is None and ctrl_img is not None:
            ctrl_img_1 = ctrl_img
        self.ctrl_img_1, self.ctrl_img_2, self.ctrl_img_3 = ctrl_img_1, ctrl_img_2, ctrl_img_3
        self._process_prompt_string()
        if negative_prompt_2 is None:
            self.negative_prompt_2 = negative_prompt
        if prompt_2 is None:
            self.prompt_2 = self.prompt
        if self.output_path is None and self.output_folder is None:
            raise ValueError("output_path or output_folder must be specified")
        elif self.output_path is not None:
            self.output_folder = os.path.dirname(self.output_path)
            self.output_ext = os.path.splitext(self.output_path)[1][1:]
            self.output_filename_no_ext = os.path.splitext(os.path.basename(self.output_path))[0]
        else:
            self.output_filename_no_ext = "[time]_[count]"
            if len(self.output_tail) > 0:
                self.output_filename_no_ext += "_" + self.output_tail
            self.output_path = os.path.join(self.output_folder, self.output_filename_no_ext + "." + self.output_ext)
        self.height = max(64, self.height - self.height % 8)  # rounded down to multiples of 8
        self.width = max(64, self.width - self.width % 8)
        self.logger = logger
        self.do_cfg_norm = do_cfg_norm

    # sd-scripts style flags inside the prompt ("a cat --n blurry --w 512 --steps 20"), as the real one
    _FLAGS = {"p2": ("prompt_2", str), "n": ("negative_prompt", str), "n2": ("negative_prompt_2", str),
              "w": ("width", int), "h": ("height", int), "d": ("seed", int), "seed": ("seed", int),
              "l": ("guidance_scale", float), "cfg": ("guidance_scale", float), "s": ("num_inference_steps", int),
              "steps": ("num_inference_steps", int), "m": ("network_multiplier", float),
              "network_multiplier": ("network_multiplier", float), "gr": ("guidance_rescale", float),
              "a": ("adapter_conditioning_scale", float), "ref": ("refiner_start_at", float),
              "frames": ("num_frames", int), "num_frames": ("num_frames", int), "fps": ("fps", int),
              "ctrl_img": ("ctrl_img", str), "ctrl_idx": ("ctrl_idx", int)}

    def _process_prompt_string(self):
        if self.prompt is None or len(self.prompt) == 0:
            return
        parts = self.prompt.strip().split("--")
        self.prompt = parts[0].strip()
        for part in parts[1:]:
            flag = part.split(" ")[0].strip()
            content = part[len(flag):].strip()
            if flag in ("ev", "extra_values"):
                self.extra_values = [float(v) for v in content.split(",")]
            elif flag in self._FLAGS:
                attr, cast = self._FLAGS[flag]
                setattr(self, attr, cast(content))

    def set_gen_time(self, gen_time=None):
        self.gen_time = gen_time if gen_time is not None else int(time.time() * 1000)

    def get_image_path(self, count=0, max_count=0):
        name = self.output_filename_no_ext.replace("[time]", str(self.gen_time))
        name = name.replace("[count]", str(count).zfill(len(str(max_count))))
        ext = self.output_ext if self.output_ext.startswith(".") else "." + self.output_ext
        return os.path.join(self.output_folder, name + ext)

    def save_image(self, image, count=0, max_count=0):
        os.makedirs(self.output_folder, exist_ok=True)
        if isinstance(image, list):  # the real writer: animated WebP through PIL, nothing else
            if self.num_frames == 1:
                raise ValueError(f"Expected 1 img but got a list {len(image)}")
            self.output_ext = "webp"
            image[0].save(self.get_image_path(count, max_count), format="WEBP", append_images=image[1:],
                          save_all=True, duration=1000 // self.fps, loop=0, quality=80)
        else:
            image.save(self.get_image_path(count, max_count))

    def save_image_atomic(self, image, count=0, max_count=0):
        # as the real one: write into a hidden tmp folder through (a possibly replaced) save_image,
        # then move every file written there into place
        real_folder = self.output_folder
        tmp_folder = os.path.join(real_folder, ".tmp")
        os.makedirs(tmp_folder, exist_ok=True)
        self.output_folder = tmp_folder
        try:
            self.save_image(image, count, max_count)
        finally:
            self.output_folder = real_folder
        for file in os.listdir(tmp_folder):
            os.replace(os.path.join(tmp_folder, file), os.path.join(real_folder, file))

    def log_image(self, image, count=0, max_count=0):
        self.logged = getattr(self, "logged", 0) + 1
