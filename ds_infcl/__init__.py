"""ds_infcl: exact contrastive losses at near-infinite batch size on DeepSpeed."""

__version__ = "0.1.0"
