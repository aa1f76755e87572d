"""Stand-in `BaseModel`: the constructor, the instance attributes it assigns (which shadow class
attributes of the same name), `add_noise` and `predict_noise`.

Read from ostris/ai-toolkit 27a03a91, toolkit/models/base_model.py (`__init__` L102-205, `add_noise`
L800-824, `predict_noise` L826-1019). What a model extension sees is kept: per-sample `add_noise`,
the text batch size read from `text_embeds`, CFG when the text batch is twice the latent batch, the
timestep repeats (including the rank-2 `repeat(B, 0)` ai-toolkit does), per-sample
`scale_model_input` under no_grad, the model moved to `device_torch` and CAST to `torch_dtype`
whenever `unet.dtype` differs, and `batch` / `guidance_embedding_scale` / `bypass_guidance_embedding`
passed only when `get_noise_prediction` names them. Left out (a video_dit job never sets them):
t2i-adapter and controlnet residuals, `rescale_cfg`, `guidance_rescale`.
"""

import inspect

import torch

from toolkit.prompt_utils import concat_prompt_embeds

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}


def get_torch_dtype(name):
    return name if isinstance(name, torch.dtype) else _DTYPES[name]


class BaseModel:
    arch = None

    def __init__(self, device, model_config, dtype="fp16", custom_pipeline=None, noise_scheduler=None,
                 **kwargs):
        self.custom_pipeline = custom_pipeline
        self.device = device
        self.dtype = dtype
        self.torch_dtype = get_torch_dtype(dtype)
        self.device_torch = torch.device(device)
        self.vae_device_torch = torch.device(device)
        self.vae_torch_dtype = get_torch_dtype(model_config.vae_dtype)
        self.te_device_torch = torch.device(device)
        self.te_torch_dtype = get_torch_dtype(model_config.te_dtype)
        self.model_config = model_config
        self.noise_scheduler = noise_scheduler
        self.pipeline = self.vae = self.model = self.text_encoder = self.tokenizer = None
        self.network = None
        self.arch = model_config.arch
        self.is_flow_matching = False
        self.is_transformer = False
        self.low_vram = model_config.low_vram
        self.is_multistage = False
        self.encode_control_in_text_embeddings = False
        self.use_old_lokr_format = True  # shadows a class attribute: subclasses set it after super()
        self.latent_space_version = None
        self.do_masked_loss = True
        self.x0_pred = False
        self.sample_prompts_cache = None
        self._after_sample_img_hooks = []
        self.generated = []  # the stand-in's generate_images records its configs (see there)

    @property
    def unet(self):
        return self.model

    @unet.setter
    def unet(self, value):
        self.model = value

    @property
    def transformer(self):
        return self.model

    @transformer.setter
    def transformer(self, value):
        self.model = value

    @property
    def text_embedding_space_version(self):
        return self.arch

    def print_and_status_update(self, status):
        print(status)

    def add_after_sample_image_hook(self, func):
        """As ai-toolkit (L381-382): appended; BaseSDTrainProcess.run calls it with its bound
        `sample_step_hook` right after `load_model()` (L1806)."""
        self._after_sample_img_hooks.append(func)

    def generate_images(self, image_configs, sampler=None, pipeline=None):
        """Stand-in: records the GenerateImageConfig list (the real one, L396-753, renders each through
        `generate_single_image`; tests/test_aitk_real.py runs it)."""
        self.generated.append(list(image_configs))

    def get_model_has_grad(self):
        raise NotImplementedError("get_model_has_grad must be implemented in child classes")

    def get_te_has_grad(self):
        raise NotImplementedError("get_te_has_grad must be implemented in child classes")

    def encode_prompt(self, prompt, **kwargs):
        return self.get_prompt_embeds(prompt if isinstance(prompt, list) else [prompt])

    def add_noise(self, original_samples, noise, timesteps, **kwargs):
        """ai-toolkit adds noise ONE SAMPLE AT A TIME through the scheduler (whose add_noise does not
        reshape t): (B,) timesteps become B calls with (1,) timesteps; one timestep serves them all."""
        x_chunks = torch.chunk(original_samples, original_samples.shape[0], dim=0)
        noise_chunks = torch.chunk(noise, noise.shape[0], dim=0)
        t_chunks = torch.chunk(timesteps, timesteps.shape[0], dim=0)
        if len(t_chunks) == 1 and len(t_chunks) != len(x_chunks):
            t_chunks = [t_chunks[0]] * len(x_chunks)
        return torch.cat([self.noise_scheduler.add_noise(x_chunks[i], noise_chunks[i], t_chunks[i])
                          for i in range(original_samples.shape[0])], dim=0)

    def predict_noise(self, latents, text_embeddings=None, timestep=1, guidance_scale=7.5, guidance_rescale=0,
                      add_time_ids=None, conditional_embeddings=None, unconditional_embeddings=None,
                      is_input_scaled=False, detach_unconditional=False, rescale_cfg=None,
                      return_conditional_pred=False, guidance_embedding_scale=1.0, bypass_guidance_embedding=False,
                      batch=None, **kwargs):
        if text_embeddings is None and conditional_embeddings is None:
            raise ValueError("Either text_embeddings or conditional_embeddings must be specified")
        if text_embeddings is None and unconditional_embeddings is not None:
            text_embeddings = concat_prompt_embeds([unconditional_embeddings, conditional_embeddings])
        elif text_embeddings is None:
            text_embeddings = conditional_embeddings
        if guidance_rescale or (rescale_cfg is not None and rescale_cfg != guidance_scale):
            raise NotImplementedError("stand-in predict_noise: guidance_rescale / rescale_cfg")
        te = text_embeddings.text_embeds
        if isinstance(te, list):
            te_batch_size = len(te) if te[0].ndim == 2 else te[0].shape[0]
        else:
            te_batch_size = te.shape[0]
        if latents.shape[0] == te_batch_size:
            cfg = False
        elif latents.shape[0] * 2 == te_batch_size:
            cfg = True
        else:
            raise ValueError("Batch size of latents must be the same or half the batch size of text embeddings")
        latents = latents.to(self.device_torch)
        text_embeddings = text_embeddings.to(self.device_torch)
        timestep = timestep.to(self.device_torch)
        if timestep.ndim == 0:
            timestep = timestep.unsqueeze(0)
        if timestep.shape[0] == 1 and latents.shape[0] > 1:
            # as ai-toolkit: rank 1 repeats to (B,); rank 2 calls repeat(B, 0), which gives (B, 0)
            timestep = timestep.repeat(latents.shape[0]) if timestep.ndim == 1 else timestep.repeat(latents.shape[0], 0)

        def scale_model_input(model_input, timestep_tensor):
            if is_input_scaled:
                return model_input
            mi = torch.chunk(model_input, model_input.shape[0], dim=0)
            ts = torch.chunk(timestep_tensor, timestep_tensor.shape[0], dim=0)
            out = []
            for i in range(model_input.shape[0]):
                if hasattr(self.noise_scheduler, "_step_index"):
                    self.noise_scheduler._step_index = None
                out.append(self.noise_scheduler.scale_model_input(mi[i], ts[i]))
            return torch.cat(out, dim=0)

        with torch.no_grad():
            if cfg:
                latent_model_input = torch.cat([latents] * 2, dim=0)
                timestep = torch.cat([timestep] * 2)
            else:
                latent_model_input = latents
            latent_model_input = scale_model_input(latent_model_input, timestep)
            if isinstance(timestep, torch.Tensor) and timestep.ndim > 1 and timestep.shape[0] != latent_model_input.shape[0]:
                if timestep.shape[0] == 1:
                    timestep = torch.cat([timestep] * latent_model_input.shape[0])
                elif timestep.shape[0] * 2 == latent_model_input.shape[0]:
                    timestep = torch.cat([timestep] * 2, dim=0)
                else:
                    raise ValueError(f"Batch size of latents {latent_model_input.shape[0]} must be the same or half "
                                     f"the batch size of timesteps {timestep.shape[0]}")
        if self.unet.device != self.device_torch:
            try:
                self.unet.to(self.device_torch)
            except Exception:  # as ai-toolkit (a model that cannot move is left where it is)
                pass
        if self.unet.dtype != self.torch_dtype:
            self.unet = self.unet.to(dtype=self.torch_dtype)
        signature = inspect.signature(self.get_noise_prediction).parameters
        if "guidance_embedding_scale" in signature:
            kwargs["guidance_embedding_scale"] = guidance_embedding_scale
        if "bypass_guidance_embedding" in signature:
            kwargs["bypass_guidance_embedding"] = bypass_guidance_embedding
        if "batch" in signature:
            kwargs["batch"] = batch
        noise_pred = self.get_noise_prediction(latent_model_input=latent_model_input, timestep=timestep,
                                               text_embeddings=text_embeddings, **kwargs)
        conditional_pred = noise_pred
        if cfg:
            uncond, cond = noise_pred.chunk(2, dim=0)
            conditional_pred = cond
            if detach_unconditional:
                uncond = uncond.detach()
            noise_pred = uncond + guidance_scale * (cond - uncond)
        if return_conditional_pred:
            return noise_pred, conditional_pred
        return noise_pred
