"""glibc's mmap and trim thresholds are fixed once per process (`xbn.utils.allocator`): torch's activation buffers
stay on the heap instead of a fresh mmap a batch (3x slower embedding on a Dask worker, whose nanny sets
MALLOC_TRIM_THRESHOLD_; 1.4-1.5x in a plain process at 64 px). A user's own setting wins. Run in fresh
interpreters: glibc reads the variables at start-up, and the setting is once per process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests_support import ROOT

PROBE = "from xbn.utils.allocator import fix_malloc_thresholds as f; print(f(), f())"
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")


def run(extra_env: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "XBN_MALLOC"))} | extra_env
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.parametrize("env", [{}, {"MALLOC_TRIM_THRESHOLD_": "65536"}], ids=["plain", "dask-worker"])
def test_the_thresholds_are_fixed_once_per_process(env):
    assert run(env) == "True True"  # cached: the second call reports the first's answer without a second mallopt


@pytest.mark.parametrize("env", [{"XBN_MALLOC": "default"}, {"MALLOC_MMAP_THRESHOLD_": "131072"}],
                         ids=["opt-out", "users-own-threshold"])
def test_a_users_choice_is_left_alone(env):
    assert run(env) == "False False"
