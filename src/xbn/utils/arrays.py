"""Numeric input checked once at the boundary: the right rank, finite, in the dtype the consumer needs."""

from __future__ import annotations

from typing import Any

import numpy as np


def finite_array(x: Any, name: str, ndim: int, shape_hint: str, dtype: type = np.float32) -> np.ndarray:
    """A contiguous numpy array of `dtype` from a numpy array or a torch tensor (detected by duck type, so torch
    is not imported here). Raises ValueError naming `name` for another rank or for NaN/inf."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    x = np.ascontiguousarray(x, dtype=dtype)
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {shape_hint}, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError(f"{name} contains NaN or inf")
    return x
