"""The HTTP endpoint on a real uvicorn server on 127.0.0.1, called over HTTP with httpx."""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from serving_support import IMAGE_SIZE, install, local_source, running, wait_for
from tests_support import free_port

from xbn.serving.http import (
    Holder,
    RegistryModelSource,
    ServeConfig,
    create_app,
    token_from_env,
)
from xbn.serving.model import load_served_model
from xbn.serving.search import search_images

FAST = ServeConfig(poll_interval_s=0.2)


@pytest.fixture
def deployed(versions, tmp_path) -> Path:
    install(versions["a"], tmp_path / "served")
    return tmp_path / "served"


def upload(path: Path, name: str | None = None):
    return {"image": (name or path.name, path.read_bytes(), "image/png")}


def test_search_embed_health(deployed, image_root, served):
    query = image_root / "class3/img1.png"
    with running(create_app(local_source(deployed), FAST, token=None)) as client:
        health = client.get("/health")
        assert health.status_code == 200
        body = health.json()
        assert body["status"] == "ok" and body["model"] == "glyphs" and body["index_size"] == 24
        assert body["version"].startswith(served.sha256[:12]) and body["alias"] is None

        found = client.post("/search", files=upload(query), data={"k": "5"})
        assert found.status_code == 200, found.text
        assert found.json()["k"] == 5 and found.json()["version"] == body["version"]
        # The same neighbours as searching the file directly (what `xbn search` prints).
        from xbn.serving.index import CatalogueIndex

        direct = search_images(served, CatalogueIndex.load(deployed / "index"), [query], k=5)[0]["results"]
        got = found.json()["results"]
        assert [r["path"] for r in got] == [r["path"] for r in direct]
        assert [r["score"] for r in got] == pytest.approx([r["score"] for r in direct], abs=1e-5)
        assert got[0] == {
            "path": "class3/img1.png",
            "label": "class3",
            "score": pytest.approx(1.0, abs=1e-4),
            "rank": 1,
            "row": 13,
        }

        assert len(client.post("/search", files=upload(query)).json()["results"]) == 10  # default k

        embedded = client.post("/embed", files=upload(query))
        assert embedded.status_code == 200 and embedded.json()["dim"] == 16
        from xbn.serving.model import open_image

        np.testing.assert_allclose(
            embedded.json()["embedding"], served.embed_images([open_image(query)])[0], atol=1e-5
        )


def test_bad_input_gets_a_4xx_and_the_server_keeps_serving(deployed, image_root, broken_image):
    from PIL import Image

    big = io.BytesIO()
    Image.new("L", (3000, 2000), 9).save(big, format="PNG")  # a few kB of file, 6 Mpx of picture
    good = upload(image_root / "class1/img0.png")
    cfg = ServeConfig(poll_interval_s=0, max_upload_bytes=20_000, max_pixels=1_000_000, max_k=50)
    with running(create_app(local_source(deployed), cfg, token=None)) as client:
        cases = [
            (
                {"image": ("notes.txt", b"hello, not an image", "text/plain")},
                {},
                400,
                "cannot read upload 'notes.txt': not an image format PIL can identify",
            ),
            (upload(broken_image), {}, 400, "truncated"),
            ({"image": ("empty.png", b"", "image/png")}, {}, 400, "cannot read upload 'empty.png': it is empty"),
            (
                {"image": ("huge.png", b"\x89PNG" + b"0" * 30_000, "image/png")},
                {},
                413,
                "larger than the upload limit of 20000 bytes",
            ),
            (
                {"image": ("wide.png", big.getvalue(), "image/png")},
                {},
                413,
                "is 3000x2000 pixels, over the limit of 1000000",
            ),
            (None, {"k": "3"}, 422, "missing form field 'image'"),
            (good, {"k": "51"}, 422, "k: Input should be less than or equal to 50 (got '51')"),
            (good, {"k": "0"}, 422, "k: Input should be greater than or equal to 1"),
            (good, {"k": "many"}, 422, "k: Input should be a valid integer"),
        ]
        for files, data, status, message in cases:
            response = client.post("/search", files=files, data=data)
            assert response.status_code == status, (message, response.text)
            assert message in response.json()["detail"]
            assert client.get("/health").status_code == 200
        # A body far over the limit is refused from its Content-Length, before it is read.
        response = client.post(
            "/embed", content=b"x" * 200_000, headers={"content-type": "multipart/form-data; boundary=zz"}
        )
        assert response.status_code == 413
        chunked = client.post(
            "/search",
            content=iter([b"--zz\r\n"]),
            headers={"content-type": "multipart/form-data; boundary=zz"},
        )
        assert chunked.status_code == 411 and "Content-Length" in chunked.json()["detail"]
        ok = client.post("/search", files=good, data={"k": "50"})
        assert ok.status_code == 200 and len(ok.json()["results"]) == 24  # k beyond the catalogue: all of it


def test_bearer_token_guards_every_route_but_health(deployed, image_root):
    good = upload(image_root / "class1/img0.png")
    with running(create_app(local_source(deployed), FAST, token="s3cret-token")) as client:
        assert client.get("/health").status_code == 200
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "s3cret-token"},
            {"Authorization": "Basic s3cret-token"},
        ):
            response = client.post("/search", files=good, headers=headers)
            assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
            assert "Authorization: Bearer <token>" in response.json()["detail"]
        assert client.post("/embed", files=good).status_code == 401
        assert client.get("/docs").status_code == 401
        assert (
            client.post("/search", files=good, headers={"Authorization": "Bearer s3cret-token"}).status_code
            == 200
        )


def test_token_comes_from_the_environment_or_a_file(tmp_path):
    assert token_from_env({}) is None
    assert token_from_env({"XBN_SERVE_TOKEN": "abc"}) == "abc"
    (tmp_path / "token").write_text("from-file\n")
    assert token_from_env({"XBN_SERVE_TOKEN_FILE": str(tmp_path / "token")}) == "from-file"
    with pytest.raises(ValueError, match="not both"):
        token_from_env({"XBN_SERVE_TOKEN": "a", "XBN_SERVE_TOKEN_FILE": str(tmp_path / "token")})
    with pytest.raises(ValueError, match="cannot read the token file"):
        token_from_env({"XBN_SERVE_TOKEN_FILE": str(tmp_path / "missing")})
    (tmp_path / "empty").write_text("  \n")
    with pytest.raises(ValueError, match="the token file is empty"):
        token_from_env({"XBN_SERVE_TOKEN_FILE": str(tmp_path / "empty")})


def test_poll_follows_a_new_version_and_survives_a_broken_one(
    deployed, versions, image_root, other_model_path
):
    query = image_root / "class2/img2.png"
    with running(create_app(local_source(deployed), FAST, token=None)) as client:
        first = client.get("/health").json()["version"]
        before = client.post("/embed", files=upload(query)).json()["embedding"]
        install(versions["b"], deployed)  # a promotion: new checkpoint and its index
        second = wait_for(lambda: (v := client.get("/health").json()["version"]) != first and v)
        after = client.post("/embed", files=upload(query)).json()
        assert after["version"] == second
        from xbn.serving.model import open_image

        expected = load_served_model(other_model_path, IMAGE_SIZE).embed_images([open_image(query)])[0]
        np.testing.assert_allclose(after["embedding"], expected, atol=1e-5)
        assert not np.allclose(before, after["embedding"], atol=1e-3)

        (deployed / "model.pt").write_bytes(b"not a checkpoint")  # a broken deployment
        health = wait_for(lambda: (h := client.get("/health").json())["error"] and h)
        assert health["status"] == "ok" and health["version"] == second  # still serving the last good one
        assert "not an xbn embedder checkpoint" in health["error"]
        assert client.post("/search", files=upload(query)).status_code == 200


def test_no_model_answers_503_until_one_appears(tmp_path, versions):
    with running(create_app(local_source(tmp_path / "served"), FAST, token=None)) as client:
        assert client.get("/health").status_code == 503
        response = client.post("/search", files={"image": ("a.png", b"x", "image/png")})
        assert response.status_code == 503 and "no model loaded yet" in response.json()["detail"]
        install(versions["a"], tmp_path / "served")
        wait_for(lambda: client.get("/health").status_code == 200)


def test_registry_source_follows_the_alias(versions, tmp_path):
    """The registry here is a stand-in with the two methods the source calls (MLflow itself is tested in
    tests/tracking); what is checked is the alias following and the files it loads."""

    class Registry:
        name = "xbn-embedder"

        def __init__(self):
            self.champion = 1

        def by_alias(self, alias):
            assert alias == "champion"
            return SimpleNamespace(version=self.champion)

        def checkpoint(self, info, where):
            where.mkdir(parents=True, exist_ok=True)
            shutil.copy(versions["ab"[info.version - 1]] / "model.pt", where / "model.pt")
            return SimpleNamespace(path=where / "model.pt", image_size=IMAGE_SIZE)

    def fetch_index(info, where):
        shutil.copytree(versions["ab"[info.version - 1]] / "index", where / "index", dirs_exist_ok=True)
        return where / "index"

    registry = Registry()
    holder = Holder(RegistryModelSource(registry, fetch_index, tmp_path / "cache"))
    assert holder.refresh() and holder.current.version == "1" and holder.current.alias == "champion"
    assert not holder.refresh()  # unchanged alias: nothing reloaded
    registry.champion = 2  # a promotion
    assert holder.refresh() and holder.current.version == "2"
    assert holder.current.model.sha256 == holder.current.index.meta["model_sha256"]
    registry.champion = 1  # a rollback
    assert holder.refresh() and holder.current.version == "1"


def listening_addresses(pid: int, port: int) -> list[str]:
    """The addresses process `pid` listens on at `port`, read from the kernel's socket table (psutil): works on a
    machine with no other address, where asking another interface proves nothing."""
    import psutil

    return sorted(c.laddr.ip for c in psutil.Process(pid).net_connections(kind="inet")
                  if c.status == psutil.CONN_LISTEN and c.laddr.port == port)


def test_serve_binds_localhost_reads_a_token_file_and_reloads_on_sighup(
    deployed, versions, image_root, tmp_path
):
    port = free_port()
    (tmp_path / "token").write_text("file-token\n")
    script = textwrap.dedent(f"""
        from xbn.serving.http import LocalModelSource, ServeConfig, create_app, serve
        source = LocalModelSource({str(deployed / "model.pt")!r}, {str(deployed / "index")!r}, {IMAGE_SIZE})
        serve(create_app(source, ServeConfig(poll_interval_s=0)), port={port}, log_level="warning")
    """)
    env = {**os.environ, "XBN_SERVE_TOKEN_FILE": str(tmp_path / "token")}
    env.pop("XBN_SERVE_TOKEN", None)
    process = subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE, text=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:

            def health():
                try:
                    return client.get("/health")
                except httpx.TransportError:
                    assert process.poll() is None, process.stderr.read()
                    return None

            first = wait_for(health, timeout=60).json()["version"]
            query = upload(image_root / "class0/img1.png")
            assert client.post("/search", files=query).status_code == 401
            assert client.post(
                "/search", files=query, headers={"Authorization": "Bearer file-token"}
            ).is_success
            install(versions["b"], deployed)
            time.sleep(0.5)
            assert client.get("/health").json()["version"] == first  # no polling: only the signal reloads
            process.send_signal(signal.SIGHUP)
            wait_for(lambda: client.get("/health").json()["version"] != first)
            # Bound to loopback by default: no other interface of this host answers.
            assert listening_addresses(process.pid, port) == ["127.0.0.1"]
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_a_failing_reload_is_logged_once_per_distinct_failure(caplog):
    """The poll asks every few seconds: a registry with no challenger yet or a store that stays down must not
    repeat one line per poll, and a new failure or the recovery is still said."""

    class Flaky:
        def __str__(self):
            return "xbn-embedder@champion"

        def __init__(self):
            self.outcomes = [None, None, None, OSError("store down"), OSError("store down"), "7"]

        def version(self):
            outcome = self.outcomes.pop(0)
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        def load(self):
            return SimpleNamespace(version="7", name="xbn-embedder", index=SimpleNamespace(count=3))

    holder = Holder(Flaky())
    with caplog.at_level("DEBUG", logger="xbn.serving.http"):
        switched = [holder.refresh() for _ in range(6)]
    assert switched == [False] * 5 + [True] and holder.error is None and holder.current.version == "7"
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.levelno > 10]
    assert said == [
        ("WARNING", "model xbn-embedder@champion: nothing to load, serving nothing: LookupError: the model source "
                    "has no version to serve"),
        ("ERROR", "model xbn-embedder@champion: cannot load it, serving nothing: OSError: store down"),
        ("INFO", "serving xbn-embedder version 7 (index of 3) instead of nothing"),
    ]


class _StoreDown:
    """A registry source whose store refuses: its error names the store's URI, password included."""

    def version(self):
        raise ConnectionError("cannot reach postgresql://xbn:hunter2-secret@db.internal:5432/mlflow")

    def __str__(self):
        return "registry:xbn-embedder@champion"


def test_health_shows_a_failure_only_to_the_token_and_never_its_password():
    with running(create_app(_StoreDown(), FAST, token="s3cret-token")) as client:
        anonymous = wait_for(lambda: (h := client.get("/health")).json()["error"] and h)
        assert anonymous.status_code == 503 and "postgresql" not in anonymous.text
        assert anonymous.json()["error"].startswith("failing (details with the bearer token")
        shown = client.get("/health", headers={"Authorization": "Bearer s3cret-token"}).json()["error"]
        assert shown == "ConnectionError: cannot reach postgresql://xbn:***@db.internal:5432/mlflow"
