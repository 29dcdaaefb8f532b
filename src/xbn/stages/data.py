"""`xbn data snapshot|restore`: the data a run trains on, versioned with DVC (`xbn.data.snapshot`).

`snapshot` is the retrain flow's first task (after `prepare`): it tracks data.root with DVC, pushes it to the
DVC remote and writes `reports/data.json`, which the train stage logs on the MLflow run and `register` tags the
version with (`data_md5`). `restore` brings the images a registered version (or a run) trained on back into a
folder, from the `.dvc` record its run logged and the DVC remote of the project in the working directory.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from xbn.config import Params
from xbn.data.errors import DatasetError
from xbn.data.snapshot import DataSnapshot, restore, snapshot
from xbn.utils.errors import RegistryError

log = logging.getLogger(__name__)


def snapshot_data(params: Params) -> dict:
    found: DataSnapshot = snapshot(params)
    if found.version == "none":
        log.info("data %s: not versioned (data.version: none); manifest md5 %s", found.root, found.manifest_md5)
    return found.as_dict()


def restore_data(params: Params, destination: str | Path, version: int | None = None,
                 run_id: str | None = None) -> dict:
    """Restore the data of registry version `version` (of registry.model_name) or of MLflow run `run_id`."""
    from xbn.tracking import Registry

    registry = Registry(params)
    if version is not None:
        try:
            run_id = registry.get(version).run_id
        except ValueError as exc:
            raise RegistryError(str(exc)) from None
    what = f"v{version}" if version is not None else f"run {run_id}"
    with tempfile.TemporaryDirectory() as tmp:
        found = registry.data_snapshot(run_id, tmp)
    if found is None:
        raise RegistryError(f"{what} recorded no data snapshot (trained before xbn took them, or outside the "
                            "retrain flow): its images cannot be restored")
    try:  # read back from the run: untrusted, checked field by field in `restore`
        record = DataSnapshot(**found[0])
    except TypeError as exc:
        raise DatasetError(f"{what}'s data record (data/data.json) is not one xbn writes: {exc}") from None
    if (dvc := record.dvc_record()) is None:  # no md5
        raise RegistryError(f"{what} trained on unversioned data (data.version: none): nothing to restore")
    count = restore(dvc, destination)
    log.info("restored %d files of %s (DVC md5 %s) into %s", count, what, record.md5, destination)
    return {"restored": str(destination), "files": count, "md5": record.md5, "from": what}


__all__ = ["restore_data", "snapshot_data"]
