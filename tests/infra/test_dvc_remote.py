"""The DVC remote round trip (compose's is s3://dvc on MinIO; here a local directory, the same protocol for
DVC): `dvc add` a data folder, push it to a default remote, lose the cache and the data, pull them back."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

DVC = str(Path(sys.executable).parent / "dvc")


def run(cmd: list[str], cwd: Path, env: dict[str, str]) -> str:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout + out.stderr


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_dvc_push_then_pull_restores_the_data_byte_identical(tmp_path):
    repo, remote = tmp_path / "repo", tmp_path / "remote"
    repo.mkdir()
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "DVC_SITE_CACHE_DIR": str(tmp_path / "site-cache"),
           "DVC_GLOBAL_CONFIG_DIR": str(tmp_path / "dvc-global"), "GIT_CONFIG_GLOBAL": os.devnull,
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    run(["git", "init", "-q"], repo, env)
    run([DVC, "init", "-q"], repo, env)
    run(["git", "commit", "-qm", "dvc init"], repo, env)

    data = repo / "data"
    (data / "images/a").mkdir(parents=True)
    (data / "images/b").mkdir(parents=True)
    (data / "labels.csv").write_text("path,label,split\nimages/a/0.bin,a,train\nimages/b/0.bin,b,test\n")
    (data / "images/a/0.bin").write_bytes(bytes(range(256)) * 8)
    (data / "images/b/0.bin").write_bytes(os.urandom(4096))
    (data / "images/b/empty").write_bytes(b"")
    before = snapshot(data)

    run([DVC, "add", "-q", "data"], repo, env)
    run([DVC, "remote", "add", "-d", "local", str(remote)], repo, env)
    run(["git", "add", "data.dvc", ".gitignore", ".dvc/config"], repo, env)
    run(["git", "commit", "-qm", "track data"], repo, env)
    run([DVC, "push"], repo, env)
    assert any(p.is_file() for p in remote.rglob("*")), "nothing reached the remote"
    assert "in sync" in run([DVC, "status", "--cloud"], repo, env)

    shutil.rmtree(repo / ".dvc/cache")
    shutil.rmtree(data)
    run([DVC, "pull"], repo, env)
    assert snapshot(data) == before
    assert "in sync" in run([DVC, "status", "--cloud"], repo, env)
