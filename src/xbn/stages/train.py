"""Stage `train`: see `xbn.training.trainer`."""

from xbn.training.trainer import train

__all__ = ["train"]
