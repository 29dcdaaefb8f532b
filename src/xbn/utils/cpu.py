"""What this CPU computes fast, decided at run time (issue 28).

Machines differ: on one AMD EPYC with AVX512-BF16, a bfloat16 GEMM runs 3.6x faster than float32; on another with
AVX2 only, 8x slower. So no fixed choice is right, and every bf16 fast path asks two things first: does the CPU
have native bf16 dot products (`avx512_bf16` or AMX), and does a short probe on this machine measure bf16 faster.
The answers are cached per process; `XBN_CPU_BF16=0|1` forces either answer (tests pin both branches with it, and
a user can switch the fast path off without a code change).
"""

from __future__ import annotations

import functools
import os
import time

import torch

from xbn.utils.errors import EnvironmentSettingError

BF16_FLAGS = ("avx512_bf16", "amx_bf16")
FORCE_ENV = "XBN_CPU_BF16"  # "1": treat bf16 as fast, "0": as slow; unset: detect and probe
MARGIN = 1.2  # bf16 must be this much faster to be chosen: a near tie is not worth its rounding


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags from /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def has_native_bf16() -> bool:
    """Whether the CPU reports bf16 dot-product instructions (AVX512-BF16 or AMX)."""
    return any(flag in cpu_flags() for flag in BF16_FLAGS)


def forced_bf16() -> bool | None:
    """`XBN_CPU_BF16`: True/False when set to 1/0, None when unset; anything else is an error naming it."""
    value = os.environ.get(FORCE_ENV, "").strip()
    if not value:
        return None
    if value not in ("0", "1"):
        raise EnvironmentSettingError(f"{FORCE_ENV}={value!r}: use 1 (bf16 fast paths on), 0 (off), or leave it unset")
    return value == "1"


@functools.cache
def bf16_gemm_speedup(rows: int = 2048, dim: int = 512, repeats: int = 3) -> float:
    """How much faster a bfloat16 `a @ b.T` runs than a float32 one here (best of `repeats`, ~50 ms in all on a
    2-core AVX512-BF16 machine; longer where bf16 is emulated, which is what it finds out)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(rows, dim, generator=generator)
    b = torch.randn(rows, dim, generator=generator)

    def best(x, y) -> float:
        x @ y.T  # warm-up: kernel selection, page faults
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            x @ y.T
            times.append(time.perf_counter() - start)
        return min(times)

    with torch.no_grad():
        return best(a, b) / best(a.bfloat16(), b.bfloat16())


def bf16_gemm_is_fast() -> bool:
    """Whether bf16 matrix products should be used on this CPU: forced by `XBN_CPU_BF16`, else native bf16
    instructions and a measured speed-up of at least `MARGIN`."""
    forced = forced_bf16()
    if forced is not None:
        return forced
    return has_native_bf16() and bf16_gemm_speedup() >= MARGIN


__all__ = ["BF16_FLAGS", "FORCE_ENV", "bf16_gemm_is_fast", "bf16_gemm_speedup", "cpu_flags", "forced_bf16",
           "has_native_bf16"]
