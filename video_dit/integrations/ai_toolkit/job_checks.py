"""What the arch checks of an ai-toolkit job before step 1: its previews and its datasets.

ai-toolkit builds the model from the `model` block alone; the first moment the arch sees the rest of the job
is when the trainer registers its per-preview hook, right after `load_model()` and before the network, the
data loader or any preview (BaseSDTrainProcess.run, ai-toolkit 27a03a91 L1806:
`self.sd.add_after_sample_image_hook(self.sample_step_hook)`, a bound method of the trainer, which holds
`sample_config`, `first_sample_config`, `train_config` and `dataset_configs`). There, as our DeepSpeed
trainer checks them before any rank starts and in its words (`video_dit.spec`):

  - previews: every sample of an image-to-video-only DiT needs its first frame (`ctrl_img`, or the UI's
    `ctrl_img_1`), of a first-last-frame DiT its last frame too (`ctrl_img_2`): one error naming every sample
    without one and the key (`spec.check_preview_frames`), instead of a crash at the first preview (before
    step 1, or at `sample_every` with skip_first_sample); refused, not rendered from some other frame;
  - datasets: an image-to-video-only DiT trains on `do_i2v` datasets only (`spec.check_dataset_i2v`), and a
    concat model's `do_i2v` dataset of one frame per item (the UI's "Add Dataset" writes `num_frames: 1`)
    would skip every item (`diffusion.conditioning.stills_skipped`): nothing would train; a `do_i2v` dataset on
    a model that builds no first-frame conditioning is refused in its family's words (`refuse_first_frame`).

`check_generation` checks the same of the previews ai-toolkit asks for at any time (`generate_images`),
for a trainer that registers no hook of its own. Nothing here imports ai-toolkit: the objects are read by
the attribute names of its `toolkit/config_modules.py` (27a03a91).
"""

from __future__ import annotations

from video_dit.diffusion.conditioning import stills_skipped
from video_dit.spec import check_dataset_i2v, check_preview_frames
from video_dit.typed_config import ConfigError


def _frames(item) -> tuple[bool, bool]:
    """(first frame, last frame) of a SampleItem or GenerateImageConfig: the UI's three control images write
    `ctrl_img_1` / `ctrl_img_2`, a plain sample `ctrl_img` (ai-toolkit copies it to ctrl_img_1)."""
    first = getattr(item, "ctrl_img", None) or getattr(item, "ctrl_img_1", None)
    return first is not None, getattr(item, "ctrl_img_2", None) is not None


def check_job(model, process) -> None:
    """The previews and datasets of ai-toolkit's trainer `process` (what `add_after_sample_image_hook` is
    given a bound method of); a hook of anything else (no `sample_config`) is not a job: nothing to check."""
    if process is None or not hasattr(process, "sample_config"):
        return
    train = getattr(process, "train_config", None)
    if not getattr(train, "disable_sampling", False):
        configs = [("sample.samples", process.sample_config)]
        if getattr(process, "has_first_sample_requested", False):
            configs.append(("first_sample.samples", process.first_sample_config))
        for key, config in configs:
            check_preview_frames(model.preset, model.i2v_mode, [_frames(s) for s in config.samples or []], key)
    skipping = stills_skipped(model.i2v_mode)
    for i, d in enumerate(getattr(process, "dataset_configs", None) or []):
        check_dataset_i2v(model.preset, bool(d.do_i2v), f"datasets[{i}].do_i2v")
        if d.do_i2v and model.conditioning is None:  # a model that builds no first-frame conditioning (MiniMax H3)
            model.refuse_first_frame(f"datasets[{i}].do_i2v")
        if skipping and d.do_i2v and d.num_frames == 1 and not getattr(d, "auto_frame_count", False):
            size = model.preset.sample_size
            raise ConfigError(f"datasets[{i}].num_frames",
                              f"1: every item of this do_i2v dataset ({d.folder_path}) is a single frame, which "
                              f"preset {model.preset.name!r} (i2v_mode {model.i2v_mode!r}) skips: nothing would "
                              "train; accepted: a clip length its VAE encodes" + (f", e.g. {size[0]}" if size else ""))


def check_generation(model, gen_configs) -> None:
    """The previews of one `generate_images` call (ai-toolkit's GenerateImageConfig list)."""
    check_preview_frames(model.preset, model.i2v_mode, [_frames(g) for g in gen_configs], "sample.samples")
