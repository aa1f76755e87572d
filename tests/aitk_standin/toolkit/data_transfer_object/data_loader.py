"""Stand-in `DataLoaderBatchDTO`: the attributes a video model reads from a batch."""

from types import SimpleNamespace


class DataLoaderBatchDTO:
    def __init__(self, tensor=None, latents=None, first_frame_latents=None, do_i2v=False, fps=24,
                 num_frames=1, control_tensor=None, mask_tensor=None):
        self.tensor = tensor  # (B, T, 3, H, W) or (B, 3, H, W) float32 CPU in [-1, 1], or None
        self.latents = latents  # (B, C, T', h, w) once processed
        self.first_frame_latents = first_frame_latents  # (B, C, 1, h, w): cached latents + do_i2v only
        self.control_tensor = control_tensor
        self.mask_tensor = mask_tensor
        self.num_frames = num_frames
        self._dataset_config = SimpleNamespace(do_i2v=do_i2v, fps=fps, num_frames=num_frames)

    @property
    def dataset_config(self):
        return self._dataset_config
