"""Stand-in `FileItemDTO` and `DataLoaderBatchDTO`: the attributes a video model reads from a batch.

Read from ostris/ai-toolkit 27a03a91, toolkit/data_transfer_object/data_loader.py: an item's `path`,
`dataset_config` and `is_video` (L59-68: a video file of a video dataset; an image of one is a
single-frame item), `loss_multiplier` (L187); a batch's `file_items`, `loss_multiplier_list`
(L376-378) and `dataset_config`, its first item's (L583-588). A batch built without items (the
tests' shorthand) carries a dataset config of `do_i2v`, `fps` and `num_frames` alone.
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
                 num_frames=1, control_tensor=None, mask_tensor=None, file_items=None):
        self.tensor = tensor  # (B, T, 3, H, W) or (B, 3, H, W) float32 CPU in [-1, 1], or None
        self.latents = latents  # (B, C, T', h, w) once processed
        self.first_frame_latents = first_frame_latents  # (B, C, 1, h, w): cached latents + do_i2v only
        self.control_tensor = control_tensor
        self.mask_tensor = mask_tensor
        self.num_frames = num_frames
        self.file_items = file_items
        self.loss_multiplier_list = [x.loss_multiplier for x in file_items] if file_items else [1.0]
        self._dataset_config = SimpleNamespace(do_i2v=do_i2v, fps=fps, num_frames=num_frames)

    @property
    def dataset_config(self):
        if self.file_items:
            return self.file_items[0].dataset_config
        return self._dataset_config
