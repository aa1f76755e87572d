"""Stand-in `FileItemDTO` and `DataLoaderBatchDTO`: the attributes a video model reads from a batch.

Read from ostris/ai-toolkit 27a03a91, toolkit/data_transfer_object/data_loader.py: an item's `path`,
`dataset_config` and `is_video` (L59-68: a video file of a video dataset; an image of one is a
single-frame item), `loss_multiplier` (L187); a batch's `file_items`, `loss_multiplier_list`
(L376-378) and `dataset_config`, its first item's (L583-588). A batch built without items (the
tests' shorthand) carries a dataset config of `do_i2v`, `fps`, `num_frames` and `do_audio` alone.

The audio of a `do_audio` dataset (L233-267, L316-329, L555-562): `audio_data`, a list of each item's
{"waveform": (C, S), "sample_rate"} when the FIRST item has one (later ones may be None), `audio_latents`
(B, ...) from the latent cache (an item without a track filled with zeros), and what a model and the
trainer exchange: `audio_noise` (drawn once per step, reused by every pass), `audio_target`, `audio_pred`
(SDTrainer L1016-1021: loss += mse(audio_pred, audio_target) x train.audio_loss_multiplier), and the
secondary passes' slots (`audio_pred_slot`, `set_secondary_audio_pred`).
"""

import os
from types import SimpleNamespace

VIDEO_EXTENSIONS = ['.mp4', '.avi', '.mov', '.webm', '.mkv', '.wmv', '.m4v', '.flv']  # toolkit/data_loader.py L40


class FileItemDTO:
    def __init__(self, path="", dataset_config=None):
        self.path = path
        self.dataset_config = dataset_config
        dataset_is_video = dataset_config.num_frames > 1 or dataset_config.auto_frame_count
        self.is_video = dataset_is_video and os.path.splitext(path)[1].lower() in VIDEO_EXTENSIONS
        self.num_frames = dataset_config.num_frames if self.is_video else 1
        self.loss_multiplier = dataset_config.loss_multiplier


class DataLoaderBatchDTO:
    def __init__(self, tensor=None, latents=None, first_frame_latents=None, do_i2v=False, fps=24,
                 num_frames=1, control_tensor=None, mask_tensor=None, file_items=None, do_audio=False,
                 audio_data=None, audio_latents=None):
        self.tensor = tensor  # (B, T, 3, H, W) or (B, 3, H, W) float32 CPU in [-1, 1], or None
        self.latents = latents  # (B, C, T', h, w) once processed
        self.first_frame_latents = first_frame_latents  # (B, C, 1, h, w): cached latents + do_i2v only
        self.control_tensor = control_tensor
        self.mask_tensor = mask_tensor
        self.num_frames = num_frames
        self.file_items = file_items
        self.loss_multiplier_list = [x.loss_multiplier for x in file_items] if file_items else [1.0]
        self._dataset_config = SimpleNamespace(do_i2v=do_i2v, fps=fps, num_frames=num_frames, do_audio=do_audio)
        self.audio_data = audio_data  # [{"waveform": (C, S), "sample_rate": int} or None per item] or None
        self.audio_latents = audio_latents  # (B, ...) cached, zeros for an item without a track, or None
        self.audio_noise = self.audio_target = self.audio_pred = None
        self.audio_pred_uncond = self.audio_pred_prior = self.audio_pred_preservation = None
        self.audio_pred_slot = None

    def set_secondary_audio_pred(self, pred):
        """ai-toolkit L555-562: a secondary pass's audio prediction goes to its slot (never `audio_pred`)."""
        if self.audio_pred_slot is not None:
            setattr(self, self.audio_pred_slot, pred)

    @property
    def dataset_config(self):
        if self.file_items:
            return self.file_items[0].dataset_config
        return self._dataset_config
