"""The HTTP endpoint: `POST /search`, `POST /embed`, `GET /health` over a model and its catalogue index.

What is served comes from a `ModelSource`: `version()` says cheaply which version it would serve now, `load()`
loads it (model and index). The app loads at start-up and then follows the source, polling every
`poll_interval_s` and on SIGHUP (when the server runs in the main thread), so a promotion or a rollback of the
registry alias is picked up without a restart. A load that fails leaves the previous version serving.
`LocalModelSource` serves a checkpoint file and an index folder; `RegistryModelSource` follows an alias of the
model registry.

For people: `GET /` is one static page over this API (drop an image, see the top-k thumbnails with labels and
scores). With a `challenger` source it also answers `POST /compare`, the champion's and the challenger's top-k
for the same image, which the page shows side by side for registry review. `GET /catalogue/{row}` returns a
catalogue image (only rows of the served index, read under `catalogue_root`).

Access: with a token configured (environment variable `XBN_SERVE_TOKEN`, or a file named by
`XBN_SERVE_TOKEN_FILE`; never a command-line argument, which `ps` shows), every route but `/health` answers
401 without `Authorization: Bearer <token>`. `serve` binds 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import EllipsisType
from typing import Any, Protocol

import uvicorn
from fastapi import FastAPI, File, Form, HTTPException, Request, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse

from xbn.config import ServeConfig
from xbn.serving.index import CatalogueIndex
from xbn.serving.model import ServedModel, UnreadableImage, decode_image, load_served_model
from xbn.serving.search import neighbours
from xbn.utils.io import file_digest

log = logging.getLogger(__name__)

TOKEN_ENV, TOKEN_FILE_ENV = "XBN_SERVE_TOKEN", "XBN_SERVE_TOKEN_FILE"
# Reachable without the token: a load balancer's probe has none, and the page holds no data (it asks for the
# token and sends it with each API call).
OPEN_PATHS = frozenset({"/health", "/"})
PAGE = Path(__file__).with_name("static") / "index.html"
_FORM_OVERHEAD = 64 * 1024  # multipart boundaries and the k field around the image bytes


@dataclass(frozen=True)
class Loaded:
    """One version being served."""

    version: str
    model: ServedModel
    index: CatalogueIndex
    name: str
    alias: str | None = None


class ModelSource(Protocol):
    def version(self) -> str | None:
        """The version `load` would return now (cheap: it is asked every poll); None when there is none."""

    def load(self) -> Loaded:
        """Load the current version's model and index."""


class LocalModelSource:
    """A checkpoint file and an index folder on disk; their content is the version, so replacing either file
    (atomically, as `xbn train` and `xbn index` write them) is picked up by the next poll."""

    def __init__(
        self,
        model_path: str | Path,
        index_dir: str | Path,
        image_size: int,
        name: str = "local",
        device: str = "cpu",
    ) -> None:
        self.model_path, self.index_dir = Path(model_path), Path(index_dir)
        self.image_size, self.name, self.device = image_size, name, device

    def version(self) -> str | None:
        try:
            return f"{file_digest(self.model_path)[:12]}-{file_digest(self.index_dir / 'index.json')[:12]}"
        except FileNotFoundError:
            return None

    def load(self) -> Loaded:
        # Versioned before loading: if a file is replaced meanwhile, the next poll sees a new version and
        # loads again, rather than this load being recorded under the newer name.
        version = self.version()
        if version is None:
            raise FileNotFoundError(f"no model at {self.model_path} or no index at {self.index_dir}")
        return _loaded(
            version,
            load_served_model(self.model_path, self.image_size, self.device),
            CatalogueIndex.load(self.index_dir),
            self.name,
            None,
        )


class RegistryModelSource:
    """The version of `registry` (an `xbn.tracking.Registry`: `name`, `by_alias`, `get`, `checkpoint`) that
    holds `alias`, or the fixed version `pinned`. `fetch_index(version_info, directory) -> index folder`
    downloads the version's index artifact; it is passed in so that this module needs no MLflow. Files go to
    `cache_dir/v<version>/`."""

    def __init__(
        self,
        registry: Any,
        fetch_index: Callable[[Any, Path], Path],
        cache_dir: str | Path,
        alias: str = "champion",
        image_size: int | None = None,
        device: str = "cpu",
        pinned: int | None = None,
    ) -> None:
        self.registry, self.fetch_index, self.cache_dir = registry, fetch_index, Path(cache_dir)
        self.alias, self.image_size, self.device, self.pinned = alias, image_size, device, pinned

    def info(self) -> Any:
        """The registry's record of the version to serve now; None when the alias is on no version."""
        return self.registry.get(self.pinned) if self.pinned is not None else self.registry.by_alias(self.alias)

    def version(self) -> str | None:
        info = self.info()
        return None if info is None else str(info.version)

    def load_model(self) -> tuple[Any, ServedModel]:
        """(version info, its embedder), without the index (what the batch embedding job needs)."""
        info = self.info()
        if info is None:
            raise LookupError(f"{self.registry.name} has no version with alias '{self.alias}'")
        checkpoint = self.registry.checkpoint(info, self._dir(info))  # sha256-verified against the store
        size = self.image_size or checkpoint.image_size
        if size is None:
            raise ValueError(f"{self.registry.name} v{info.version} records no image size: pass image_size")
        return info, load_served_model(checkpoint.path, size, self.device)

    def load(self) -> Loaded:
        info, model = self.load_model()
        return _loaded(
            str(info.version),
            model,
            CatalogueIndex.load(self.fetch_index(info, self._dir(info))),
            self.registry.name,
            None if self.pinned is not None else self.alias,
        )

    def _dir(self, info: Any) -> Path:
        return self.cache_dir / f"v{info.version}"


def _loaded(version: str, model: ServedModel, index: CatalogueIndex, name: str, alias: str | None) -> Loaded:
    index.check_model(model.sha256)  # never serve an index with a model that did not embed it
    return Loaded(version, model, index, name, alias)


class Holder:
    """The version being served, swapped whole (one reference) when the source moves on."""

    def __init__(self, source: ModelSource) -> None:
        self.source = source
        self.current: Loaded | None = None
        self.error: str | None = None
        self._lock = threading.Lock()  # one load at a time (poll and SIGHUP may coincide)

    def refresh(self) -> bool:
        """Load the source's version if it differs from the one served; True when it switched."""
        with self._lock:
            try:
                version = self.source.version()
                if version is None:
                    raise LookupError("the model source has no version to serve")
                if self.current is not None and version == self.current.version:
                    return False
                loaded = self.source.load()
            except Exception as exc:  # noqa: BLE001 -- any failure: keep serving what is loaded, /health shows it
                error = f"{type(exc).__name__}: {exc}"
                # Once per distinct failure: the poll must not repeat it every few seconds (a store down for an
                # hour, a registry with no challenger yet). No version at all is a state, not a fault.
                level = (logging.DEBUG if error == self.error
                         else logging.WARNING if isinstance(exc, LookupError) else logging.ERROR)
                self.error = error
                log.log(level, "model reload failed, still serving %s: %s",
                        self.current.version if self.current else "nothing", error)
                return False
            before, self.current, self.error = self.current, loaded, None
        log.info(
            "serving %s version %s (index of %d) instead of %s",
            loaded.name,
            loaded.version,
            loaded.index.count,
            before.version if before else "nothing",
        )
        return True

    def require(self) -> Loaded:
        current = self.current
        if current is None:
            raise HTTPException(503, f"no model loaded yet ({self.error or 'loading'})")
        return current


def token_from_env(environ: Mapping[str, str] = os.environ) -> str | None:
    """The configured bearer token, or None when access is open. A token file that is named but missing or
    empty is an error: failing closed beats serving openly by accident."""
    token, file = environ.get(TOKEN_ENV), environ.get(TOKEN_FILE_ENV)
    if token is not None and file is not None:
        raise ValueError(f"set {TOKEN_ENV} or {TOKEN_FILE_ENV}, not both")
    if file is not None:
        try:
            token = Path(file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"{TOKEN_FILE_ENV}={file}: cannot read the token file ({exc})") from exc
        if not token:
            raise ValueError(f"{TOKEN_FILE_ENV}={file}: the token file is empty")
    elif token is not None and not token.strip():
        raise ValueError(f"{TOKEN_ENV} is set but empty")
    return token.strip() if token else None


def create_app(
    model_source: ModelSource,
    config: ServeConfig | None = None,
    *,
    token: str | None | EllipsisType = ...,
    challenger: ModelSource | None = None,
    catalogue_root: str | Path | None = None,
) -> FastAPI:
    """The FastAPI app serving `model_source`. `token`: the bearer token, None for open access; by default
    read from the environment (`token_from_env`). `challenger`: a second source `POST /compare` answers with
    (the registry's challenger). `catalogue_root`: where the index's relative paths are, for thumbnails."""
    cfg = config or ServeConfig()  # its validator keeps default_k <= max_k
    secret = token_from_env() if token is ... else token
    holder = Holder(model_source)
    rival = Holder(challenger) if challenger is not None else None
    holders = [h for h in (holder, rival) if h is not None]

    def refresh_all() -> None:
        for h in holders:
            h.refresh()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await run_in_threadpool(refresh_all)
        background: set[asyncio.Task] = set()
        if cfg.poll_interval_s > 0:
            background.update(asyncio.create_task(_poll(h, cfg.poll_interval_s)) for h in holders)
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(
                signal.SIGHUP, lambda: _spawn(background, run_in_threadpool(refresh_all))
            )
            hup = True
        except (ValueError, RuntimeError, NotImplementedError, AttributeError):  # not the main thread
            hup = False
            log.info("SIGHUP reload unavailable here (server not in the main thread); polling only")
        yield
        if hup:
            loop.remove_signal_handler(signal.SIGHUP)
        for task in background:
            task.cancel()

    app = FastAPI(title="xbn image search", lifespan=lifespan)
    app.state.holder = holder

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if secret is not None and request.url.path not in OPEN_PATHS and not _authorised(request, secret):
            return JSONResponse(
                {"detail": "missing or wrong bearer token: send 'Authorization: Bearer <token>'"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        if request.method == "POST":
            # The size is checked before the body is read, so a body must say its size: a chunked upload
            # would be spooled to disk whole before any handler could refuse it.
            length = request.headers.get("content-length", "")
            if not length.isdigit():
                return JSONResponse({"detail": "a Content-Length header is required"}, status_code=411)
            if int(length) > cfg.max_upload_bytes + _FORM_OVERHEAD:
                return JSONResponse({"detail": _too_large(cfg)}, status_code=413)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return JSONResponse({"detail": "; ".join(_explain(e) for e in exc.errors())}, status_code=422)

    async def picture(image: UploadFile):
        data = await image.read(cfg.max_upload_bytes + 1)
        if len(data) > cfg.max_upload_bytes:
            raise HTTPException(413, _too_large(cfg))
        try:
            return await run_in_threadpool(decode_image, data, f"upload {image.filename!r}", cfg.max_pixels)
        except UnreadableImage as exc:
            raise HTTPException(413 if exc.too_large else 400, str(exc)) from None

    async def embedding(image: UploadFile, served: Holder = holder) -> tuple[Loaded, Any]:
        loaded = served.require()
        decoded = await picture(image)
        return loaded, await run_in_threadpool(loaded.model.embed_images, [decoded])

    # The faiss search runs in a worker thread, like the embedding: on the event loop, concurrent searches would
    # queue behind each other (the serving benchmark saw it). Parameter defaults, not Annotated: with postponed
    # annotations FastAPI would evaluate an Annotated hint in the module's globals, where `cfg` does not exist.
    @app.post("/search")
    async def search(
        image: UploadFile = File(..., description="the query image"),  # noqa: B008
        k: int = Form(cfg.default_k, ge=1, le=cfg.max_k),
    ) -> dict[str, Any]:
        loaded, emb = await embedding(image)
        found = await run_in_threadpool(neighbours, loaded.index, emb, k)
        return {**_about(loaded), "k": k, "results": found[0]}

    @app.post("/compare")
    async def compare(
        image: UploadFile = File(..., description="the query image"),  # noqa: B008
        k: int = Form(cfg.default_k, ge=1, le=cfg.max_k),
    ) -> dict[str, Any]:
        if rival is None:
            raise HTTPException(404, "no challenger is configured on this server: /compare needs one")
        decoded = await picture(image)
        answer = {}
        for side, served in (("champion", holder), ("challenger", rival)):
            loaded = served.require()
            emb = await run_in_threadpool(loaded.model.embed_images, [decoded])
            found = await run_in_threadpool(neighbours, loaded.index, emb, k)
            answer[side] = {**_about(loaded), "results": found[0]}
        return {"k": k, **answer}

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text())

    @app.get("/catalogue/{row}")
    async def catalogue(row: int) -> FileResponse:
        loaded = holder.require()
        if catalogue_root is None:
            raise HTTPException(404, "this server was started without the catalogue's image folder")
        if not 0 <= row < loaded.index.count:
            raise HTTPException(404, f"row {row} is not in the catalogue (0..{loaded.index.count - 1})")
        # Only a path the index holds, under the catalogue root: never a path taken from the request.
        path = Path(catalogue_root) / str(loaded.index.ids["path"].iloc[row])
        if not path.is_file():
            raise HTTPException(404, f"catalogue image {path.name} of row {row} is missing on this server")
        return FileResponse(path)

    @app.post("/embed")
    async def embed(image: UploadFile = File(..., description="the image to embed")) -> dict[str, Any]:  # noqa: B008
        loaded, emb = await embedding(image)
        return {**_about(loaded), "dim": int(emb.shape[1]), "embedding": emb[0].tolist()}

    @app.get("/health")
    async def health():
        current = holder.current
        if current is None:
            return JSONResponse({"status": "unavailable", "error": holder.error}, status_code=503)
        other = rival.current if rival is not None else None
        return {
            "status": "ok",
            **_about(current),
            "index_size": current.index.count,
            "index_type": current.index.meta.get("type"),
            "embedding_dim": current.model.embedding_dim,
            "max_k": cfg.max_k,
            "challenger": _about(other) if other is not None else None,
            "error": holder.error,
        }

    return app


def make_server(
    app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"
) -> uvicorn.Server:
    """A uvicorn server for `app` (port 0: any free port, see `bound_port`)."""
    return uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    )


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run `app` under uvicorn until SIGINT/SIGTERM (SIGHUP reloads the model)."""
    make_server(app, host, port, log_level).run()


def bound_port(server: uvicorn.Server) -> int:
    return server.servers[0].sockets[0].getsockname()[1]


async def _poll(holder: Holder, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        await run_in_threadpool(holder.refresh)


def _spawn(tasks: set[asyncio.Task], coroutine) -> None:
    task = asyncio.ensure_future(coroutine)
    tasks.add(task)  # a task nobody references can be garbage-collected before it runs
    task.add_done_callback(tasks.discard)


def _authorised(request: Request, secret: str) -> bool:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    # compare_digest: the time taken does not tell how much of the token was right
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), secret.encode())


def _about(loaded: Loaded) -> dict[str, Any]:
    return {"model": loaded.name, "version": loaded.version, "alias": loaded.alias}


def _too_large(cfg: ServeConfig) -> str:
    return f"the image is larger than the upload limit of {cfg.max_upload_bytes} bytes"


def _explain(error: Mapping[str, Any]) -> str:
    """A validation error as one readable phrase: which field, what was wrong, what was sent."""
    where = ".".join(str(p) for p in error.get("loc", ()) if p not in ("body", "query"))
    if error.get("type") == "missing":
        return f"missing form field '{where}'"
    sent = error.get("input")
    shown = f" (got {sent!r})" if isinstance(sent, (str, int, float)) else ""
    return f"{where}: {error.get('msg', 'invalid')}{shown}"
