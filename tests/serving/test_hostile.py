"""The search endpoint under hostile input (issue 27): malformed and foreign image files, decompression bombs,
stalled uploads, floods, foreign Host headers, a tampered index and a registry without a challenger. Real
files written by PIL (or byte by byte where PIL would not write them), a real uvicorn server on 127.0.0.1 and
raw sockets where a well-behaved client could not misbehave."""

from __future__ import annotations

import io
import json
import logging
import shutil
import socket
import struct
import time
import zlib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import yaml
from PIL import Image
from serving_support import IMAGE_SIZE, install, local_source, running, wait_for

from xbn.config import Params, ServeConfig
from xbn.data import DatasetError
from xbn.serving import http
from xbn.serving.http import Holder, RegistryModelSource, create_app
from xbn.serving.index import CatalogueIndex
from xbn.serving.search import search_images
from xbn.serving.sources import read_source

# The example: a PPM header PIL accepts, then a ValueError while decoding.
BAD_PPM = b"P6\n3x 32\n255\n" + bytes(3072)


def encoded(fmt: str, size=(40, 30), mode="RGB", **options) -> bytes:
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (size[1], size[0], 4), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGBA").convert(mode)
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height RGBA pixels, with one tiny (wrong) data chunk."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 6, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + \
        chunk(b"IEND", b"")


def post(client, data: bytes, name: str = "q.bin", route: str = "/search", **kw):
    return client.post(route, files={"image": (name, data, "application/octet-stream")}, **kw)


@pytest.fixture
def deployed(versions, tmp_path) -> Path:  # noqa: F811
    install(versions["a"], tmp_path / "served")
    return tmp_path / "served"


# ---------------------------------------------------------------------------------------------------------
# 1. Decode safely


def test_foreign_and_malformed_formats_get_415_or_400_not_500(deployed, image_root):
    foreign = {"PPM": BAD_PPM, "TIFF": encoded("TIFF"), "ICO": encoded("ICO", size=(32, 32)),
               "TGA": encoded("TGA")}
    with running(create_app(local_source(deployed), ServeConfig(poll_interval_s=0), token=None)) as client:
        for fmt, data in foreign.items():
            response = post(client, data, f"x.{fmt.lower()}")
            assert response.status_code == 415, (fmt, response.text)
            detail = response.json()["detail"]
            assert f"{fmt} images are not accepted" in detail and "JPEG, PNG, WEBP, GIF, BMP" in detail
        for fmt in ("JPEG", "PNG", "WEBP", "GIF", "BMP"):
            assert post(client, encoded(fmt), f"x.{fmt.lower()}").status_code == 200, fmt
        # A PNG whose pixel data is garbage: PIL fails on it while decoding.
        response = post(client, png_header(64, 64), "bad.png")
        assert response.status_code == 400 and "cannot read upload 'bad.png'" in response.json()["detail"]
        assert client.get("/health").status_code == 200
    # Configurable: a server that accepts PPM reads a good one, and says what is wrong with the bad one.
    cfg = ServeConfig(poll_interval_s=0, allowed_formats=["PNG", "PPM"])
    with running(create_app(local_source(deployed), cfg, token=None)) as client:
        assert post(client, encoded("PPM"), "good.ppm").status_code == 200
        response = post(client, BAD_PPM, "bad.ppm")
        assert response.status_code == 400 and "cannot read upload 'bad.ppm'" in response.json()["detail"]
        assert post(client, encoded("JPEG"), "x.jpg").status_code == 415


def test_allowed_formats_are_checked_when_the_config_is_read():
    with pytest.raises(ValueError, match="serve.allowed_formats: 'JPG' is not an image format PIL reads"):
        ServeConfig(allowed_formats=["JPG"])
    assert ServeConfig(allowed_formats=["png", "jpeg"]).allowed_formats == ["PNG", "JPEG"]


def test_search_and_embed_report_a_malformed_file_and_go_on(served, image_root, tmp_path):
    """`xbn search` and `xbn embed` read images through the same opening as the server: one error per image."""
    bad = tmp_path / "bad.ppm"
    bad.write_bytes(BAD_PPM)
    good = image_root / "class1/img0.png"
    frame, root = read_source(image_root / "manifest.csv")
    index = CatalogueIndex.build(served.embed_frame(frame, root).embeddings, frame, _index_config(), served.sha256)
    first, second = search_images(served, index, [bad, good], k=3)
    assert first["query"] == str(bad) and first["error"].startswith(f"cannot read image {bad}: ")
    assert "results" not in first and len(second["results"]) == 3

    shutil.copy(bad, root / "bad.ppm")
    rows = pd.DataFrame({"path": ["bad.ppm", "class1/img0.png"], "label": [None, "class1"]})
    try:
        embedded = served.embed_frame(rows, root)
    finally:
        (root / "bad.ppm").unlink()
    assert embedded.kept == [1] and embedded.skipped == ["bad.ppm"]


def _index_config():
    from xbn.config import IndexConfig

    return IndexConfig(type="flat")


def test_a_decompression_bomb_gets_the_same_413_as_an_oversized_image(deployed):
    cfg = ServeConfig(poll_interval_s=0, max_pixels=1_000_000)
    with running(create_app(local_source(deployed), cfg, token=None)) as client:
        for width, height in ((2000, 2000), (30_000, 30_000)):  # over max_pixels; over PIL's own bomb limit
            response = post(client, png_header(width, height), "bomb.png")
            assert response.status_code == 413, response.text
            detail = response.json()["detail"]
            assert "over the limit of 1000000 pixels" in detail and "decompression bomb" not in detail


def mutations(seed: int, cases: int):
    """(name, bytes): valid files of each allowed format, and headers of other formats, with bytes flipped,
    cut short, spliced or duplicated."""
    seeds = {
        "jpg": encoded("JPEG"), "png": encoded("PNG", mode="RGBA"), "webp": encoded("WEBP"),
        "gif": encoded("GIF", mode="P"), "bmp": encoded("BMP"), "png8": encoded("PNG", mode="P"),
        "ppm": BAD_PPM[:200], "tif": encoded("TIFF")[:300], "sgi": encoded("SGI")[:300],
        "im": encoded("IM")[:600], "dds": encoded("DDS")[:300], "qoi": encoded("QOI")[:300],
        "pcx": encoded("PCX")[:300], "ico": encoded("ICO", size=(16, 16))[:300],
    }
    rng = np.random.default_rng(seed)
    names = sorted(seeds)
    for i in range(cases):
        name = names[i % len(names)]
        data = bytearray(seeds[name])
        for _ in range(int(rng.integers(1, 6))):
            op = rng.integers(0, 4)
            at = int(rng.integers(0, len(data)))
            if op == 0:  # flip a byte, more often in the header where the parsers branch
                at = int(rng.integers(0, min(len(data), 64))) if rng.random() < 0.6 else at
                data[at] = int(rng.integers(0, 256))
            elif op == 1:
                del data[at:]
            elif op == 2:
                data[at:at] = data[int(rng.integers(0, len(data))):][: int(rng.integers(1, 64))]
            else:
                data[at : at + 4] = struct.pack(">I", int(rng.choice([0, 1, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF])))
            if not data:
                data = bytearray(b"\0")
        yield f"{i}.{name}", bytes(data)


def test_fuzz_mutated_images_never_give_a_5xx(deployed):
    """2 000 mutated files through the decoding the server runs, then a sample of them over HTTP."""
    from xbn.data.images import UnreadableImage, open_rgb

    cfg = ServeConfig(poll_interval_s=0, max_pixels=4_000_000)
    start = time.monotonic()
    outcomes: dict[str, int] = {}
    for name, data in mutations(seed=27, cases=2000):
        try:
            image = open_rgb(data, f"upload {name!r}", formats=cfg.allowed_formats, max_pixels=cfg.max_pixels,
                             min_side=64)
            assert image.mode == "RGB"
            outcomes["ok"] = outcomes.get("ok", 0) + 1
        except UnreadableImage as exc:
            outcomes[exc.kind] = outcomes.get(exc.kind, 0) + 1
            assert str(exc).startswith(f"cannot read upload {name!r}: ") or exc.kind != "unreadable"
    assert outcomes.get("ok", 0) > 50 and outcomes.get("unreadable", 0) > 200 and outcomes.get("unsupported")
    with running(create_app(local_source(deployed), cfg, token=None)) as client:
        for name, data in mutations(seed=28, cases=200):
            response = post(client, data, name, route="/embed")
            assert response.status_code in (200, 400, 413, 415), (name, response.status_code, response.text)
    assert time.monotonic() - start < 60


# ---------------------------------------------------------------------------------------------------------
# 2. Bound the resources


def test_a_large_image_is_decoded_at_reduced_size_and_embeds_as_at_full_size(served, tmp_path):
    from xbn.data.images import open_rgb

    rng = np.random.default_rng(3)
    small = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)
    big = Image.fromarray(small).resize((3200, 2400), Image.BILINEAR)
    for fmt, mode in (("JPEG", "RGB"), ("PNG", "RGBA")):
        buf = io.BytesIO()
        big.convert(mode).save(buf, format=fmt, quality=95)
        reduced = open_rgb(buf.getvalue(), "big", min_side=served.decode_side)
        assert reduced.mode == "RGB" and served.decode_side <= min(reduced.size) < 1000, (fmt, reduced.size)
        full = open_rgb(buf.getvalue(), "big")
        assert full.size == (3200, 2400)
        a, b = served.embed_images([reduced])[0], served.embed_images([full])[0]
        assert float(a @ b) > 0.999, fmt


def test_excess_concurrent_requests_get_503_with_retry_after(deployed, image_root):
    cfg = ServeConfig(poll_interval_s=0, max_concurrency=1, body_timeout_s=10)
    good = (image_root / "class1/img0.png").read_bytes()
    with running(create_app(local_source(deployed), cfg, token=None)) as client:
        port = client.base_url.port
        with stalled_upload(port):  # holds the one slot: its body never arrives
            time.sleep(0.3)
            response = post(client, good, "q.png")
            assert response.status_code == 503 and response.headers["retry-after"] == "1"
            assert "busy" in response.json()["detail"]
            assert client.get("/health").status_code == 200  # a probe is never turned away
        wait_for(lambda: post(client, good, "q.png").status_code == 200)


def test_the_decode_budget_turns_away_what_would_not_fit():
    budget = http.PixelBudget(100)
    with budget.hold(80):
        with pytest.raises(http.Busy):
            with budget.hold(30):
                pass
        with budget.hold(20):
            pass
    with budget.hold(500):  # alone, anything under max_pixels is decoded: the budget only orders them
        pass
    assert budget.used == 0


class stalled_upload:
    """A raw connection that announces a 1 MB multipart body, sends 30 bytes of it and stops."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)

    def __enter__(self):
        self.sock.sendall(b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1048576\r\n"
                          b"Content-Type: multipart/form-data; boundary=zz\r\n\r\n" + b"--zz\r\n" + b"x" * 24)
        return self.sock

    def __exit__(self, *exc):
        self.sock.close()


def test_a_stalled_upload_is_cut_off(deployed):
    cfg = ServeConfig(poll_interval_s=0, body_timeout_s=1.0)
    with running(create_app(local_source(deployed), cfg, token=None)) as client:
        start = time.monotonic()
        with stalled_upload(client.base_url.port) as sock:
            answer = b""
            while chunk := sock.recv(4096):  # until the server closes the connection
                answer += chunk
        took = time.monotonic() - start
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
        assert b"did not arrive within 1.0 s" in answer and 0.9 < took < 10
        assert client.get("/health").status_code == 200


def answer_to_headers(port: int, request: bytes) -> tuple[bytes, bool]:
    """Send a request's headers on a raw connection and read the answer that comes before any body is sent;
    then try to send 2.4 MB of chunks: whether the server still took them (False: it closed the connection)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
        chunk = b"x" * 60000
        try:
            for _ in range(40):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sock.shutdown(socket.SHUT_WR)
            taken = sock.recv(4096) != b""
        except OSError:  # reset or broken pipe: the server closed the connection
            taken = False
    return answer, taken


@pytest.mark.parametrize("framing", [b"Transfer-Encoding: chunked\r\n",
                                     b"Content-Length: 100\r\nTransfer-Encoding: chunked\r\n"],
                         ids=["chunked", "chunked_with_a_content_length"])
def test_a_chunked_upload_is_refused_before_it_is_read(deployed, framing, monkeypatch):
    # h11 reads the chunks and ignores a Content-Length beside them, so a size checked against the header alone
    # let a multipart part of any size be spooled to disk. Refused whole, before any route (or parser) runs.
    reached = []
    monkeypatch.setattr(http, "open_image", lambda *a, **k: reached.append(1))
    with running(create_app(local_source(deployed), ServeConfig(poll_interval_s=0), token=None)) as client:
        answer, taken = answer_to_headers(client.base_url.port, b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\n" +
                                          framing + b"Content-Type: multipart/form-data; boundary=zz\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 411 "), answer[:300]
        assert b"Content-Length" in answer and not reached and not taken
        assert client.get("/health").status_code == 200


def test_the_body_limit_counts_the_bytes_that_arrive_not_the_bytes_announced():
    import asyncio

    from starlette.exceptions import HTTPException

    from xbn.serving.limits import Limits

    async def app(scope, receive, send):  # reads the whole body, as a form parser would
        while (await receive()).get("more_body"):
            pass

    async def scenario(declared: bytes | None):
        parts = iter([b"a" * 600, b"b" * 600, b""])

        async def receive():
            body = next(parts)
            return {"type": "http.request", "body": body, "more_body": bool(body)}

        headers = [(b"content-length", declared)] if declared else []
        await Limits(app, max_concurrency=4, body_timeout_s=5, max_body_bytes=1000)(
            {"type": "http", "path": "/search", "headers": headers}, receive, lambda m: asyncio.sleep(0))

    for declared in (None, b"100", b"5000"):  # none, an understatement, an overstatement past the limit
        with pytest.raises(HTTPException) as refused:
            asyncio.run(scenario(declared))
        assert refused.value.status_code == 413, declared


# ---------------------------------------------------------------------------------------------------------
# 3. No open door by accident


def test_without_a_token_a_public_host_is_refused_with_exit_2(tmp_path, monkeypatch, capsys):
    from xbn.cli import main

    monkeypatch.chdir(tmp_path)
    for var in ("XBN_SERVE_TOKEN", "XBN_SERVE_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    Path("params.yaml").write_text(yaml.safe_dump(Params().model_dump(mode="json"), sort_keys=False))
    assert main(["serve", "--local", "--host", "0.0.0.0", "--port", "0", "--params", "params.yaml"]) == 2
    err = capsys.readouterr().err
    assert "0.0.0.0 is not a loopback address" in err and "XBN_SERVE_TOKEN" in err
    # With a token, a public address also needs its names in serve.allowed_hosts (else every request is a 400).
    monkeypatch.setenv("XBN_SERVE_TOKEN", "t0ken")
    assert main(["serve", "--local", "--host", "0.0.0.0", "--port", "0", "--params", "params.yaml"]) == 2
    assert "serve.allowed_hosts" in capsys.readouterr().err


def test_an_open_server_says_so_every_interval(deployed, monkeypatch, caplog):
    monkeypatch.setattr(http, "OPEN_WARNING_INTERVAL_S", 0.2)
    with caplog.at_level(logging.WARNING, logger="xbn.serving.http"):
        with running(create_app(local_source(deployed), ServeConfig(poll_interval_s=0), token=None)):
            wait_for(lambda: sum("unauthenticated" in r.getMessage() for r in caplog.records) >= 3)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="xbn.serving.http"):
        with running(create_app(local_source(deployed), ServeConfig(poll_interval_s=0), token="t")):
            time.sleep(0.5)
    assert not any("unauthenticated" in r.getMessage() for r in caplog.records)


def test_the_host_header_is_checked_and_responses_are_not_sniffed(deployed):
    with running(create_app(local_source(deployed), ServeConfig(poll_interval_s=0), token=None)) as client:
        for host in ("evil.example", "evil.example:8000", "10.0.0.1"):  # DNS rebinding: another site's name
            response = client.get("/health", headers={"Host": host})
            assert response.status_code == 400, host
        for host in ("localhost", "127.0.0.1:8000", "[::1]:8000"):
            assert client.get("/health", headers={"Host": host}).status_code == 200, host
        assert client.get("/health").headers["x-content-type-options"] == "nosniff"
        page = client.get("/")
        assert page.headers["x-content-type-options"] == "nosniff"
        policy = page.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "script-src 'self'" in policy and "unsafe-inline" not in policy
        assert "<script>" not in page.text and "<style>" not in page.text and "style=" not in page.text
        for asset, kind in (("/page.js", "javascript"), ("/page.css", "text/css")):
            response = client.get(asset)
            assert response.status_code == 200 and kind in response.headers["content-type"]
    cfg = ServeConfig(poll_interval_s=0, allowed_hosts=["search.example.org"])
    with running(create_app(local_source(deployed), cfg, token=None)) as client:
        assert client.get("/health", headers={"Host": "search.example.org"}).status_code == 200
        assert client.get("/health").status_code == 400


# ---------------------------------------------------------------------------------------------------------
# 4. Paths stay in the catalogue


def test_a_tampered_index_row_outside_the_catalogue_is_404_and_logged(deployed, image_root, tmp_path, caplog):
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0")
    catalogue = tmp_path / "catalogue"
    shutil.copytree(image_root, catalogue)
    ids = pd.read_parquet(deployed / "index/ids.parquet")
    ids.loc[2, "path"] = "../secret.txt"
    ids.loc[3, "path"] = str(secret)  # absolute: joining would drop the root
    ids.to_parquet(deployed / "index/ids.parquet")
    # Tampered consistently, as whoever can edit the folder can: index.json records the new file's sha256.
    from xbn.utils.io import file_digest

    meta = json.loads((deployed / "index/index.json").read_text())
    meta["sha256"]["ids.parquet"] = file_digest(deployed / "index/ids.parquet")
    (deployed / "index/index.json").write_text(json.dumps(meta))
    app = create_app(local_source(deployed), ServeConfig(poll_interval_s=0), token=None, catalogue_root=catalogue)
    with caplog.at_level(logging.WARNING, logger="xbn.serving.http"), running(app) as client:
        assert client.get("/catalogue/0").status_code == 200
        for row in (2, 3):
            response = client.get(f"/catalogue/{row}")
            assert response.status_code == 404 and "root:x" not in response.text
    assert sum("the index was tampered with" in r.getMessage() for r in caplog.records) == 2


def test_index_refuses_rows_outside_the_catalogue(tmp_path):
    """Already so before issue 27 (`read_manifest` checks every path): kept as the guarantee the server's
    check relies on."""
    (tmp_path / "cat").mkdir()
    csv = tmp_path / "cat/manifest.csv"
    for bad in ("../outside.png", "/etc/passwd", "a/../../b.png"):
        pd.DataFrame({"path": ["ok.png", bad], "label": ["a", "b"], "split": ["test", "test"]}).to_csv(csv, index=False)
        with pytest.raises(DatasetError, match="paths must (stay inside|be relative to) the dataset root"):
            read_source(csv)


# ---------------------------------------------------------------------------------------------------------
# 5. The truth about the challenger


class OneVersionRegistry:
    """A registry stand-in with a champion and no challenger (MLflow itself is tested in tests/tracking)."""

    name = "xbn-embedder"

    def __init__(self, version_dir: Path) -> None:
        self.version_dir = version_dir

    def by_alias(self, alias):
        return SimpleNamespace(version=1) if alias == "champion" else None

    def checkpoint(self, info, where):
        where.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.version_dir / "model.pt", where / "model.pt")
        return SimpleNamespace(path=where / "model.pt", image_size=IMAGE_SIZE)

    def fetch_index(self, info, where):
        shutil.copytree(self.version_dir / "index", where / "index", dirs_exist_ok=True)
        return where / "index"


def test_compare_without_a_challenger_is_404_before_any_search(versions, tmp_path, caplog):  # noqa: F811
    registry = OneVersionRegistry(versions["a"])
    champion = RegistryModelSource(registry, registry.fetch_index, tmp_path / "cache")
    challenger = RegistryModelSource(registry, registry.fetch_index, tmp_path / "cache", alias="challenger")
    app = create_app(champion, ServeConfig(poll_interval_s=0), token=None, challenger=challenger)
    with caplog.at_level(logging.INFO, logger="xbn.serving.http"), running(app) as client:
        # Not an image at all: a 404 for it shows that nothing was decoded or searched first.
        response = post(client, b"not an image", "q.png", route="/compare")
        assert response.status_code == 404, response.text
        assert response.json()["detail"].startswith("no challenger in the registry")
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("challenger xbn-embedder@challenger: nothing to load") for m in said), said
    assert not any("still serving nothing" in m and "challenger" not in m for m in said), said


def test_the_start_up_log_names_the_model_that_failed_and_why(deployed, caplog):
    (deployed / "model.pt").write_bytes(b"not a checkpoint")
    source = local_source(deployed)
    holder = Holder(source, "model")
    with caplog.at_level(logging.WARNING, logger="xbn.serving.http"):
        holder.refresh()
    (message,) = [r.getMessage() for r in caplog.records if r.name == "xbn.serving.http"]
    assert message.startswith(f"model {source}: cannot load it, serving nothing: ValueError: ")
    assert "is not an xbn embedder checkpoint" in message
