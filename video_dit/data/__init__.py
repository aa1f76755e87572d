"""Dataset folders -> shape-consistent batches of cached latents and text embeds, for any number of ranks.

    folder --scan_dataset--> ScanResult(items: DataItem with caption, bucket (F, H, W), frames)
           --build_cache(encode_fn, text_fn)--> <root>/_latent_cache, <root>/_text_cache (safetensors)
           --CachedDataset + BucketBatchSampler + collate--> {"latents": (B, C, F', h, w), "text_embeds": [ (Lt, D) ] ...}

`dataset.py` config and scan, `frames.py` frame selection and pixel reading, `buckets.py` bucket
sizes, `sampler.py` the resumable distributed sampler, `cache.py` the caches, `demo.py` the demo data.
"""

from video_dit.data.buckets import bucket_size
from video_dit.data.cache import CachedDataset, CacheReport, build_cache, collate
from video_dit.data.dataset import (
                                    DataError,
                                    DataItem,
                                    DatasetConfig,
                                    DataWarning,
                                    ScanResult,
                                    scan_dataset,
                                    scan_datasets,
)
from video_dit.data.frames import select_frames, snap_num_frames
from video_dit.data.sampler import BucketBatchSampler

__all__ = ["BucketBatchSampler", "CacheReport", "CachedDataset", "DataError", "DataItem", "DataWarning",
           "DatasetConfig", "ScanResult", "bucket_size", "build_cache", "collate", "scan_dataset", "scan_datasets",
           "select_frames", "snap_num_frames"]
