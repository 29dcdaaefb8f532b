"""A DVC snapshot of the data a run trains on: its content fingerprint, and the way back to its images.

`snapshot` tracks `data.root` with DVC through its Python API (`dvc add` for a folder of one's own, `dvc commit`
for a folder that a dvc.yaml stage already outputs, such as the generated glyph set) and pushes its objects to
the DVC remote, so the images outlive the folder. The fingerprint is DVC's md5 of the folder (a `.dir` object
listing every file's md5): DVC's state database keys each file's hash on inode, size and mtime, so an unchanged
folder is not read again, and an image replaced under the same path changes it. No second hasher here.

What a run records (the stage writes it, the tracking layer logs it, the registry tags the version with it):
- `reports/data.json`: the folder's `.dvc` record (md5, size, nfiles, path), the manifest's md5 (paths, labels,
  splits) and the remote it was pushed to;
- `reports/data_files.parquet`: one row per manifest image (path, label, split, md5): what the registry diffs
  between the champion's data and a challenger's (classes and images added, removed or changed).

`restore` brings a recorded snapshot back into a folder from the remote (DVC's own filesystem API).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from xbn.config import ConfigError, Params
from xbn.data.dvc_files import repair_dvc_files
from xbn.data.errors import DatasetError
from xbn.data.manifest import read_manifest
from xbn.utils.errors import ServiceUnavailableError
from xbn.utils.io import atomic_path, file_digest, write_json
from xbn.utils.secrets import mask_secrets

log = logging.getLogger(__name__)

DATA_RECORD = Path("reports/data.json")
DATA_FILES = Path("reports/data_files.parquet")
FILE_COLUMNS = ["path", "label", "split", "md5"]


@dataclass(frozen=True)
class DataSnapshot:
    """What a run trained on. `md5` is DVC's hash of data.root (None when `data.version: none`)."""

    version: str  # "dvc" or "none"
    root: str
    manifest_md5: str
    md5: str | None = None
    size: int | None = None
    nfiles: int | None = None
    path: str | None = None  # data.root relative to the DVC project (the `.dvc` record's `path`)
    remote: str | None = None  # where the objects were pushed (URL with any credentials masked)

    @property
    def fingerprint(self) -> str:
        """Content and manifest together: equal only if the same bytes are read with the same labels/splits."""
        return f"{self.md5 or 'unversioned'}+{self.manifest_md5}"

    def dvc_record(self) -> dict[str, Any] | None:
        """The `.dvc` file's content for this folder (what `restore` writes back)."""
        if self.md5 is None:
            return None
        return {"outs": [{"md5": self.md5, "size": self.size, "nfiles": self.nfiles, "hash": "md5",
                          "path": Path(self.path or self.root).name}]}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def read_record(path: str | Path = DATA_RECORD) -> DataSnapshot | None:
    path = Path(path)
    if not path.exists():
        return None
    return DataSnapshot(**json.loads(path.read_text()))


def current_record(params: Params) -> DataSnapshot | None:
    """`reports/data.json` if it describes the data of `params` now (same root, same manifest bytes); None when
    there is none, or it is another run's (a stale record never labels a model trained on other data)."""
    found = read_record()
    manifest = Path(params.data.manifest)
    if found is None or not manifest.exists() or found.root != str(params.data.root):
        return None
    return found if found.manifest_md5 == file_digest(manifest, "md5") else None


def check_versioning(params: Params) -> None:
    """What `snapshot` needs, checked in a second before any work (the retrain flow's first step): with
    data.version: dvc, a DVC project around the working directory, data.root inside it, a reachable remote."""
    if params.data.version == "none":
        return
    with _project(params.data.root) as repo:
        _reachable_remote(repo)
        _require_inside(repo, Path(params.data.root).resolve())


def snapshot(params: Params, push: bool = True) -> DataSnapshot:
    """Fingerprint (and, with `data.version: dvc`, version and push) the data of `params`; writes
    `reports/data.json` and `reports/data_files.parquet`. Raises ConfigError for a data.root DVC cannot track,
    ServiceUnavailableError (exit 4) when there is no reachable remote to push to."""
    manifest_path = Path(params.data.manifest)
    if not manifest_path.exists():
        raise FileNotFoundError(f"{manifest_path} not found: run `xbn prepare` first")
    manifest_md5 = file_digest(manifest_path, "md5")
    root = Path(params.data.root)
    if not root.is_dir():
        raise DatasetError(f"data.root {root} is not a folder")
    if params.data.version == "none":
        found = DataSnapshot("none", str(root), manifest_md5)
        _write(found, _files(params, {}))
        return found
    with _project(root) as repo:
        remote = _reachable_remote(repo)
        out = _track(repo, root.resolve())
        # DVC uploads a folder's `.dir` object only after every file in it (dvc_data's transfer): when the
        # remote has it, the snapshot is complete there, and a push would only re-check every file.
        if push and not repo.cloud.get_remote_odb().exists(out.hash_info.value):
            # Only this folder's objects: the snapshot must outlive the folder, whatever else the project holds.
            # By its `.dvc` (or dvc.yaml) file: a path would be looked up in an index built before the add.
            repo.push(targets=[out.stage.path if out.stage.is_data_source else str(root.resolve())])
        found = DataSnapshot("dvc", str(root), manifest_md5, md5=out.hash_info.value, size=out.meta.size,
                             nfiles=out.meta.nfiles, path=str(root.resolve().relative_to(repo.root_dir)),
                             remote=remote)
        digests = {"/".join(key): hash_info.value for key, _, hash_info in out.get_obj()}
    _write(found, _files(params, digests))
    log.info("data %s: %s files, %s bytes, md5 %s (DVC), on the remote %s", root, found.nfiles, found.size, found.md5,
             remote)
    return found


# What DVC writes as a folder's or a file's md5: 32 hex digits, `.dir` for a folder (its listing object).
DVC_MD5 = re.compile(r"[0-9a-f]{32}(\.dir)?")


def checked_output(record: Any) -> dict[str, Any]:
    """The one output of a `.dvc` record read back from a run, as DVC would have written it, or DatasetError
    naming the field. The record is untrusted input: anyone who may log to the run can rewrite it, and its
    `md5` and `path` become paths on this machine (an md5 of `../../x.dir` once made `restore` delete `..`)."""
    outs = record.get("outs") if isinstance(record, Mapping) else None
    if not isinstance(outs, list) or len(outs) != 1 or not isinstance(outs[0], Mapping):
        raise DatasetError("the data record is not a DVC record of one folder ('outs' with one entry)")
    out = outs[0]
    md5, path = out.get("md5"), out.get("path")
    if not isinstance(md5, str) or not DVC_MD5.fullmatch(md5):
        raise DatasetError(f"the data record's md5 {md5!r} is not one DVC writes (32 hex digits, optionally "
                           "'.dir'): refusing to restore it")
    if (not isinstance(path, str) or path in ("", ".", "..") or "/" in path or "\\" in path
            or not path.isprintable()):  # a lone surrogate is not printable: no file can be named so
        raise DatasetError(f"the data record's path {path!r} is not a folder name (printable UTF-8, no "
                           "separators, not '.' or '..'): refusing to restore it")
    for key in ("size", "nfiles"):
        value = out.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise DatasetError(f"the data record's {key} {value!r} is not a count: refusing to restore it")
    # A count the record leaves out (or null) is left out: DVC's schema takes a missing one, not a null.
    counts = {key: out[key] for key in ("size", "nfiles") if out.get(key) is not None}
    return {"md5": md5, **counts, "hash": "md5", "path": path}


def restore(record: Mapping[str, Any], destination: str | Path) -> int:
    """Bring the folder of a `.dvc` record (`dvc_record()`) back into `destination` from the DVC remote of the
    project in the working directory (or its cache); returns the number of files. Refuses a destination that
    exists with other contents (nothing is overwritten); an interrupted restore leaves no partial folder.
    Deletes only the folders it created itself, whatever the record says."""
    from dvc.api import DVCFileSystem
    from dvc_data.index import DataIndexError

    out = checked_output(record)
    destination = Path(destination)
    if destination.is_symlink():
        raise FileExistsError(f"{destination} is a symbolic link: restore into a new or empty folder")
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise FileExistsError(f"{destination} exists and is not empty: restore into a new or empty folder")
    destination.parent.mkdir(parents=True, exist_ok=True)
    with _project() as repo:
        _reachable_remote(repo)
        # A `.dvc` file in the project, for DVC to resolve; removed afterwards (it records nothing new).
        holder = Path(tempfile.mkdtemp(prefix=".xbn-restore-", dir=repo.root_dir))
        try:
            # YAML is a superset of JSON, but not of its \\ud83d-style surrogate pairs: characters written as such.
            (holder / f"{out['path']}.dvc").write_text(json.dumps({"outs": [out]}, ensure_ascii=False),
                                                       encoding="utf-8")
            # Beside the destination, so that the final rename stays on one filesystem.
            staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.restoring-", dir=destination.parent))
            try:
                fs = DVCFileSystem(repo=repo)
                try:
                    fs.get(str((holder / out["path"]).relative_to(repo.root_dir)), str(staging / "data"),
                           recursive=True)
                except DataIndexError as exc:  # DataIndexDirError: the remote lacks the folder's listing
                    raise DatasetError(f"snapshot {out['md5']} is neither in the DVC remote nor in the cache of "
                                       f"{repo.root_dir} ({type(exc).__name__}): was it pushed to this "
                                       "project's remote?") from None
                count = sum(len(files) for *_, files in os.walk(staging / "data"))
                # DVC does not hash what a remote sends back (its `verify` is off by default): anyone who can
                # write the remote could swap an image. The folder's digest, as DVC computes it, must be the record's.
                if out.get("hash") == "md5" and (found := folder_md5(staging / "data")) != out["md5"]:
                    raise DatasetError(f"the files the DVC remote sent back for snapshot {out['path']} hash to "
                                       f"{found}, not {out['md5']}: the remote (or this project's cache) holds "
                                       "altered data; nothing was restored")
                try:
                    if destination.exists():
                        destination.rmdir()  # empty, checked above
                    (staging / "data").rename(destination)
                except OSError as exc:  # another restore (or a user) filled it in the meantime
                    raise FileExistsError(f"{destination} was created while restoring ({exc.strerror}): "
                                          "restore into a new or empty folder") from None
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        finally:
            shutil.rmtree(holder, ignore_errors=True)
    return count


def folder_md5(folder: Path) -> str:
    """DVC's md5 of a folder (`<md5>.dir`: the md5 of its sorted listing of files and their md5), computed with
    dvc_data's own Tree from the bytes on disk."""
    from dvc_data.hashfile.hash_info import HashInfo
    from dvc_data.hashfile.tree import Tree

    tree = Tree()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        with path.open("rb") as file:
            md5 = hashlib.file_digest(file, "md5").hexdigest()
        tree.add(path.relative_to(folder).parts, None, HashInfo("md5", md5))
    tree.digest()
    assert tree.hash_info is not None and tree.hash_info.value is not None
    return tree.hash_info.value


@contextlib.contextmanager
def _project(data_root: str | Path | None = None) -> Iterator[Any]:
    """The DVC project the working directory belongs to, after the repair of what a killed DVC write left
    behind in it (`xbn.data.dvc_files`; `data_root`: the data folder whose `.dvc` record is checked too)."""
    from dvc.exceptions import NotDvcRepoError
    from dvc.repo import Repo


    try:
        root = Repo.find_root()
        repair_dvc_files(root, data_root)
        repo = Repo(root)
    except NotDvcRepoError:
        raise ConfigError(f"data.version: dvc needs a DVC project, and {Path.cwd()} is not in one: run "
                          "`dvc init` (and `dvc remote add -d NAME URL`) there, or set data.version: none to "
                          "train without data versions") from None
    try:
        yield repo
    finally:
        repo.close()


def _reachable_remote(repo) -> str:
    """The default remote's URL (masked), or ServiceUnavailableError: a snapshot nobody can restore is none."""
    from dvc.config import NoRemoteError

    try:
        remote = repo.cloud.get_remote()
    except NoRemoteError:
        raise ServiceUnavailableError(
            f"data.version: dvc, but the DVC project at {repo.root_dir} has no default remote to push the data "
            "snapshot to: `dvc remote add -d NAME URL`, or set data.version: none") from None
    url = mask_secrets(str(remote.config.get("url", remote.path)))
    try:
        if remote.fs.protocol in ("local", "file"):
            remote.fs.makedirs(remote.path, exist_ok=True)  # DVC creates a local remote on first push
        remote.fs.exists(remote.path)
    except Exception as exc:  # noqa: BLE001 - every filesystem fails in its own way (OSError, botocore, ...)
        raise ServiceUnavailableError(f"the DVC remote {url} cannot be reached ({type(exc).__name__}: {exc}): "
                                      "the data snapshot cannot be pushed") from None
    return url


def _require_inside(repo, root: Path) -> None:
    if not root.is_relative_to(repo.root_dir):
        raise ConfigError(f"data.root {root} is outside the DVC project {repo.root_dir}, and DVC versions only "
                          "folders inside it: move or link the data into the project, or set data.version: none")


def _track(repo, root: Path):
    """`dvc add` the folder, or `dvc commit` it when a dvc.yaml stage outputs it; returns its DVC output."""
    from dvc.exceptions import OutputNotFoundError

    _require_inside(repo, root)
    try:
        (out,) = repo.find_outs_by_path(str(root), strict=True)
    except OutputNotFoundError:
        # A `.dvc` record git ignores is one DVC cannot find again (`dvc add` refuses some, not all, of them);
        # without git (NoSCM) nothing is ignored.
        record = root.parent / f"{root.name}.dvc"
        if repo.scm.is_ignored(str(record)):
            raise ConfigError(f"DVC will not track data.root {root}: its record {record.name} would be ignored by "
                              f"git; un-ignore it in .gitignore (e.g. '!/{root.parent.relative_to(repo.root_dir)}"
                              f"/*.dvc'), or set data.version: none") from None
        (stage,) = repo.add(str(root), relink=False)
        return stage.outs[0]
    if out.stage.is_data_source:
        # A `.dvc` file of its own: re-add records the folder as it is now. relink=False: the files stay as
        # they are (DVC would otherwise re-link every one from the cache, the cost of a full checkout).
        (stage,) = repo.add(str(root), relink=False)
        return stage.outs[0]
    repo.commit(str(root), force=True)  # a stage's output (data/glyphs): record it as it is now
    (out,) = repo.find_outs_by_path(str(root), strict=True)
    out.save()
    return out


def _files(params: Params, digests: Mapping[str, str]) -> pd.DataFrame:
    frame = read_manifest(params.data.manifest)[["path", "label", "split"]].drop_duplicates("path").copy()
    frame["label"] = frame["label"].astype(str)
    frame["md5"] = frame["path"].map(digests).astype("string") if digests else pd.NA
    return frame[FILE_COLUMNS].reset_index(drop=True)


def _write(found: DataSnapshot, files: pd.DataFrame) -> None:
    with atomic_path(DATA_FILES) as tmp:
        files.to_parquet(tmp, index=False)
    write_json(DATA_RECORD, found.as_dict())


def diff_files(before: pd.DataFrame, after: pd.DataFrame, examples: int = 5) -> dict[str, Any]:
    """What changed between two `data_files` tables: classes added/removed, images added/removed/changed
    (same path, other bytes; unknown without md5s), with counts and the first few of each."""
    old, new = before.set_index("path"), after.set_index("path")
    added, removed = new.index.difference(old.index), old.index.difference(new.index)
    common = new.index.intersection(old.index)
    changed = pd.Index([])
    if old["md5"].notna().all() and new["md5"].notna().all():
        changed = common[(old.loc[common, "md5"] != new.loc[common, "md5"]).to_numpy()]
    relabelled = common[(old.loc[common, "label"] != new.loc[common, "label"]).to_numpy()]
    old_classes, new_classes = set(old["label"]), set(new["label"])

    def part(values) -> dict[str, Any]:
        values = sorted(map(str, values))
        return {"count": len(values), "examples": values[:examples]}

    return {"classes_added": part(new_classes - old_classes), "classes_removed": part(old_classes - new_classes),
            "images_added": part(added), "images_removed": part(removed), "images_changed": part(changed),
            "images_relabelled": part(relabelled), "content_compared": bool(len(common) == 0 or
                                                                            old["md5"].notna().all() and
                                                                            new["md5"].notna().all())}


def diff_line(diff: Mapping[str, Any]) -> str:
    """One line for people: '+3 classes (a, b, c), +60 images, 2 changed'."""
    labels = [("classes_added", "+{} classes"), ("classes_removed", "-{} classes"), ("images_added", "+{} images"),
              ("images_removed", "-{} images"), ("images_changed", "{} changed"),
              ("images_relabelled", "{} relabelled")]
    parts = []
    for key, text in labels:
        if n := diff[key]["count"]:
            shown = ", ".join(diff[key]["examples"][:3]) + (", …" if n > 3 else "")
            parts.append(f"{text.format(n)} ({shown})")
    return "; ".join(parts) if parts else "no change"


__all__ = ["DATA_FILES", "DATA_RECORD", "DataSnapshot", "check_versioning", "current_record", "diff_files", "diff_line", "read_record", "restore",
           "snapshot"]
