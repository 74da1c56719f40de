"""Data: webdataset pipelines for image + caption shards, the shard writer, the built-in digits.

Imports torch and webdataset (and PIL for images); never the loss, never deepspeed.
"""

from ds_infcl.data.image_text import (
    BadSampleTally,
    ImageTextShards,
    expand_shard_urls,
    image_text_loader,
    read_captions,
)
from ds_infcl.data.shards import (
    ShardList,
    ShardReport,
    iter_shard_samples,
    read_manifest,
    resolve_shards,
    sample_key,
    write_image_text_shards,
)
from ds_infcl.data.transforms import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ImageTransform

__all__ = [
    "BadSampleTally",
    "ImageTextShards",
    "ImageTransform",
    "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD",
    "ShardList",
    "ShardReport",
    "expand_shard_urls",
    "image_text_loader",
    "iter_shard_samples",
    "read_captions",
    "read_manifest",
    "resolve_shards",
    "sample_key",
    "write_image_text_shards",
]
