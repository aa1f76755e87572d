"""Stand-in `ModelConfig` and `GenerateImageConfig` (the fields a video model reads)."""

import os
import time


class ModelConfig:
    def __init__(self, **kwargs):
        self.name_or_path = kwargs.get("name_or_path", None)
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
        self.latent_space_version = kwargs.get("latent_space_version", None)
        self.model_kwargs = kwargs.get("model_kwargs", {})
        self.is_v_pred = kwargs.get("is_v_pred", False)
        self.use_text_encoder_1 = True
        self.use_text_encoder_2 = True
        self.arch = kwargs.get("arch", None)
        if self.arch is not None and ":" in self.arch:  # the UI passes arch:tag
            self.arch = self.arch.split(":")[0]


class GenerateImageConfig:
    def __init__(self, prompt="", width=512, height=512, num_inference_steps=50, guidance_scale=7.5,
                 negative_prompt="", seed=-1, network_multiplier=1.0, output_path=None,
                 output_folder=None, output_ext="jpg", latents=None, ctrl_img=None, num_frames=1,
                 fps=15, ctrl_idx=0):
        self.prompt, self.negative_prompt = prompt, negative_prompt
        self.num_inference_steps, self.guidance_scale = num_inference_steps, guidance_scale
        self.seed, self.network_multiplier, self.latents = seed, network_multiplier, latents
        self.ctrl_img, self.ctrl_idx, self.num_frames, self.fps = ctrl_img, ctrl_idx, num_frames, fps
        self.output_folder, self.output_ext = output_folder, output_ext
        self.gen_time = int(time.time() * 1000)
        if output_path is not None:
            self.output_folder = os.path.dirname(output_path)
            self.output_ext = os.path.splitext(output_path)[1][1:]
            self.output_filename_no_ext = os.path.splitext(os.path.basename(output_path))[0]
        elif output_folder is not None:
            self.output_filename_no_ext = "[time]_[count]"
        else:
            raise ValueError("output_path or output_folder must be specified")
        self.height = max(64, height - height % 8)  # the real config rounds down to multiples of 8
        self.width = max(64, width - width % 8)

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
