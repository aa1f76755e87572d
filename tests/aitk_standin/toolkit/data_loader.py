"""Stand-in for which files of a dataset folder ai-toolkit makes items: the listing of
`AiToolkitDataset.__init__`, and nothing else of it (sizes, buckets, caching and loading are not here).

Read from ostris/ai-toolkit 27a03a91, toolkit/data_loader.py: the extension lists (L39-40), `is_video`
(L396: num_frames > 1 or auto_frame_count) and the listing (L427-454), kept line for line: a video
dataset takes videos and images, an image dataset images only; `os.walk` down every sub-folder but
those whose name starts with "." (pruned), files matched by lower-cased extension and not starting
with "."; files directly in a folder named `_controls` dropped; then `num_repeats` copies. A
`dataset_path` that is a JSON caption file is not kept (a video_dit test never writes one).
"""

import os

from toolkit.data_transfer_object.data_loader import FileItemDTO

image_extensions = ['.jpg', '.jpeg', '.png', '.webp']
video_extensions = ['.mp4', '.avi', '.mov', '.webm', '.mkv', '.wmv', '.m4v', '.flv']


class AiToolkitDataset:
    def __init__(self, dataset_config, batch_size=1, sd=None):
        self.dataset_config = dataset_config
        if sd is not None:
            self.dataset_config.bucket_tolerance = sd.get_bucket_divisibility()
        self.is_video = dataset_config.num_frames > 1 or dataset_config.auto_frame_count
        self.dataset_path = dataset_config.dataset_path
        if self.dataset_path is None:
            self.dataset_path = dataset_config.folder_path
        if not os.path.isdir(self.dataset_path):
            raise NotImplementedError(f"{self.dataset_path}: the stand-in lists folders only (ai-toolkit also "
                                      "reads a JSON caption file here)")
        extensions = image_extensions
        if self.is_video:
            extensions = video_extensions + image_extensions
        file_list = []
        for root, dirs, files in os.walk(self.dataset_path):
            dirs[:] = [d for d in dirs if not d.startswith('.')]
            file_list.extend(os.path.join(root, file) for file in files
                             if file.lower().endswith(tuple(extensions)) and not file.startswith('.'))
        file_list = [x for x in file_list if not os.path.basename(os.path.dirname(x)) == "_controls"]
        if self.dataset_config.num_repeats > 1:
            file_list = file_list * self.dataset_config.num_repeats
        self.file_list = [FileItemDTO(path=file, dataset_config=dataset_config) for file in file_list]

    def __len__(self):
        return len(self.file_list)
