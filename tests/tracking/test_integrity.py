"""Untrusted artifacts: a registered checkpoint altered in the artifact store is refused at load time."""

from __future__ import annotations

from pathlib import Path

import mlflow
import numpy as np
import pytest

from xbn.tracking import file_digest
from xbn.tracking.integrity import IntegrityError, verify_file

from .helpers import run_pipeline


def _stored_checkpoints(root: Path) -> list[Path]:
    return sorted(p for p in (root / "mlruns").rglob("model.pt") if p.is_file())


def test_a_tampered_registered_checkpoint_is_refused_naming_file_and_hashes(params, tmp_path):
    report = run_pipeline(params, seed=0)
    uri = f"models:/{params.registry.model_name}@champion"
    recorded = mlflow.MlflowClient(params.tracking.uri).get_model_version(
        params.registry.model_name, str(report["version"])).tags["model_sha256"]
    assert recorded == file_digest("models/model.pt")
    batch = np.zeros((2, 3, 32, 32), dtype=np.float32)
    assert mlflow.pyfunc.load_model(uri).predict(batch).shape == (2, 8)

    stored = _stored_checkpoints(tmp_path)
    assert len(stored) == 1, stored
    data = bytearray(stored[0].read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the middle of the weights
    stored[0].write_bytes(bytes(data))
    tampered = file_digest(stored[0])

    with pytest.raises(IntegrityError) as caught:
        mlflow.pyfunc.load_model(uri)
    message = str(caught.value)
    assert recorded in message and tampered in message and "model.pt" in message


def test_the_gate_loads_the_champion_only_if_its_checkpoint_is_the_registered_one(params, tmp_path):
    # The gate embeds the val split with the champion: a champion altered in the artifact store is refused
    # before torch.load sees it, and the challenger is held for review instead of compared with it.
    run_pipeline(params, seed=0, blind=True)
    stored = _stored_checkpoints(tmp_path)
    stored[0].write_bytes(stored[0].read_bytes() + b"\0")
    held = run_pipeline(params, seed=1)
    assert held["decision"] == "held" and held["alias"] == "challenger" and held["champion_version"] == 1
    assert held["reason"].startswith("champion v1 cannot be compared: refusing to load the checkpoint of ")
    assert "not promoted automatically" in held["reason"] and held["gate"] is None


def test_verify_file_accepts_the_recorded_hash_only(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"weights")
    digest = file_digest(path)
    assert verify_file(path, digest.upper()) == digest
    with pytest.raises(IntegrityError, match=rf"{path}.*{file_digest(path)}.*{'0' * 64}"):
        verify_file(path, "0" * 64)
