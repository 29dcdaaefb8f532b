"""Untrusted artifacts: a registered checkpoint altered in the artifact store is refused at load time (checked
against the version's tag in the tracking store), and a local models/model.pt altered after training is refused
by every stage that loads it (checked against its sidecar)."""

from __future__ import annotations

import logging
from pathlib import Path

import mlflow
import numpy as np
import pytest
import yaml

from xbn.cli import main
from xbn.models import load_embedder
from xbn.stages.register import register
from xbn.tracking import Registry, file_digest
from xbn.utils.errors import EXIT_DATA, IntegrityError
from xbn.utils.integrity import verify_file

from .helpers import run_pipeline, write_eval, write_model


def _stored_checkpoints(root: Path) -> list[Path]:
    return sorted(p for p in (root / "mlruns").rglob("model.pt") if p.is_file())


def test_a_tampered_registered_checkpoint_is_refused_naming_file_and_hashes(params, tmp_path):
    report = run_pipeline(params, seed=0)
    uri = f"models:/{params.registry.model_name}@champion"
    recorded = mlflow.MlflowClient(params.tracking.uri).get_model_version(
        params.registry.model_name, str(report["version"])).tags["model_sha256"]
    assert recorded == file_digest("models/model.pt")
    batch = np.zeros((2, 3, 32, 32), dtype=np.float32)
    assert mlflow.pyfunc.load_model(uri).unwrap_python_model().embed_tensors(batch).shape == (2, 8)

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


def test_a_registry_load_trusts_the_version_tag_not_the_artifacts_own_record(params, tmp_path):
    # Whoever can write the artifact store can edit the file and the hash its MLmodel records, both; the
    # version's model_sha256 tag lives in the tracking store and still holds the registered bytes' hash.
    report = run_pipeline(params, seed=0)
    registered = file_digest("models/model.pt")
    [stored] = _stored_checkpoints(tmp_path)
    stored.write_bytes(stored.read_bytes() + b"\0")
    tampered = file_digest(stored)
    mlmodel = stored.parents[1] / "MLmodel"
    text = mlmodel.read_text()
    assert f"checkpoint_sha256: {registered}" in text
    mlmodel.write_text(text.replace(registered, tampered))

    name = params.registry.model_name
    with pytest.raises(IntegrityError) as caught:
        mlflow.pyfunc.load_model(f"models:/{name}@champion")
    message = str(caught.value)
    assert f"the checkpoint of {name} v{report['version']}" in message and str(stored.name) in message
    assert f"its sha256 is {tampered} but {registered} was recorded when it was registered" in message
    registry = Registry(params)
    with pytest.raises(IntegrityError, match=f"{tampered} but {registered}"):
        registry.checkpoint(registry.get(report["version"]), tmp_path / "download")


def test_an_altered_image_size_in_the_mlmodel_is_refused_as_a_served_version_is_loaded(params, tmp_path):
    # Issue 54 item 10: the MLmodel's fields are in the artifact store and hashed nowhere; the image size a
    # server preprocesses at must be the one the (verified) checkpoint was trained at.
    from xbn.models import build_embedder, save_embedder
    from xbn.tracking import pipeline_run

    embedder, data_config = build_embedder(params.model)  # as the trainer saves it: with its params
    save_embedder(Path(params.train.checkpoint_dir) / "model.pt", embedder, params.model, data_config,
                  {"epoch": 1, "params": params.model_dump(mode="json")})
    write_eval(params)
    with pipeline_run(params, "train", new=True):
        pass
    registry = Registry(params)
    info = registry.get(register(params)["version"])
    assert registry.checkpoint(info, tmp_path / "before").image_size == params.data.image_size
    [stored] = _stored_checkpoints(tmp_path)
    mlmodel = stored.parents[1] / "MLmodel"
    text = mlmodel.read_text()
    assert f"image_size: {params.data.image_size}\n" in text
    mlmodel.write_text(text.replace(f"image_size: {params.data.image_size}\n", "image_size: 224\n"))
    with pytest.raises(IntegrityError, match=f"MLmodel gives image_size 224, but its verified checkpoint was "
                                             f"trained at {params.data.image_size}"):
        registry.checkpoint(info, tmp_path / "after")  # what serving, promote, rollback and repair load


def test_a_flipped_byte_in_model_pt_is_refused_by_evaluate_and_register_naming_the_file(params, capsys, caplog):
    write_model(params, seed=0)
    model = Path("models/model.pt")
    sidecar = Path("models/model.pt.sha256")
    written = file_digest(model)
    assert sidecar.read_text() == f"{written}  model.pt\n"  # `sha256sum -c models/model.pt.sha256` format
    load_embedder(model)  # as written: loads
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x01
    model.write_bytes(bytes(data))

    Path("params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json")))
    assert main(["evaluate"]) == EXIT_DATA
    err = capsys.readouterr().err
    assert err.startswith(f"xbn evaluate: refusing to load checkpoint {model}: its sha256 is {file_digest(model)} "
                          f"but {written} is recorded in {sidecar}") and "Traceback" not in err
    write_eval(params)
    with pytest.raises(IntegrityError, match=str(model)):
        register(params)  # never registers bytes other than those training wrote

    # A checkpoint from before sidecars: loads, with a warning naming it.
    write_model(params, seed=1)
    sidecar.unlink()
    with caplog.at_level(logging.WARNING, logger="xbn.utils.integrity"):
        load_embedder(model)
    assert f"{model} has no model.pt.sha256 sidecar" in caplog.text
