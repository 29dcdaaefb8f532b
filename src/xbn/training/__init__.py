"""The training loop (`fit`), its criterion, batches and drift diagnostics."""

from xbn.training.trainer import EpochCallback, Trainer, fit

__all__ = ["EpochCallback", "Trainer", "fit"]
