"""Stand-in `BaseModel`: the constructor, the instance attributes it assigns (which shadow class
attributes of the same name) and the `predict_noise` dispatch of ai-toolkit's base_model.py."""

import inspect

import torch

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

    @property
    def unet(self):
        return self.model

    @unet.setter
    def unet(self, value):
        self.model = value

    @property
    def transformer(self):
        return self.model

    @property
    def text_embedding_space_version(self):
        return self.arch

    def print_and_status_update(self, status):
        print(status)

    def get_model_has_grad(self):
        raise NotImplementedError("get_model_has_grad must be implemented in child classes")

    def get_te_has_grad(self):
        raise NotImplementedError("get_te_has_grad must be implemented in child classes")

    def encode_prompt(self, prompt, **kwargs):
        return self.get_prompt_embeds(prompt if isinstance(prompt, list) else [prompt])

    def predict_noise(self, latents, text_embeddings=None, timestep=1, batch=None, **kwargs):
        """The parts of the real `predict_noise` a model sees: the text batch size read from
        `text_embeds` (a list of 2D tensors = one per prompt), CFG when the text batch is twice
        the latent batch, and `batch` passed only when `get_noise_prediction` names it."""
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
            timestep = timestep.repeat(latents.shape[0])
        if cfg:
            latents, timestep = torch.cat([latents] * 2), torch.cat([timestep] * 2)
        call_kwargs = {}
        if "batch" in inspect.signature(self.get_noise_prediction).parameters:
            call_kwargs["batch"] = batch
        pred = self.get_noise_prediction(latent_model_input=latents, timestep=timestep,
                                         text_embeddings=text_embeddings, **call_kwargs)
        if cfg:
            uncond, cond = pred.chunk(2)
            pred = uncond + kwargs.get("guidance_scale", 1.0) * (cond - uncond)
        return pred
