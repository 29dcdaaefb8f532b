"""Identities of what a run used: the data (DVC's md5 of the manifest), the params, the model file, the code.

No MLflow here: the register stage and the tests compute the same fingerprints the runs are tagged with.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

from xbn.config import Params, flatten
from xbn.utils.io import file_digest


def data_hash(params: Params) -> str | None:
    """md5 of the manifest, the same value DVC records for it; None before `prepare` has written one."""
    manifest = Path(params.data.manifest)
    return file_digest(manifest, "md5") if manifest.exists() else None


def params_hash(params: Params) -> str:
    """sha256 of the flattened params as sorted JSON: equal params hash equally whatever the YAML layout."""
    text = json.dumps(flatten(params), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def git_commit(cwd: str | Path = ".") -> str | None:
    """The checked-out commit, or None outside a git repository (a read-only query)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None
