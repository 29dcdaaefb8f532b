"""The HTTP endpoint: `POST /search`, `POST /embed`, `GET /health` over a model and its catalogue index.

What is served comes from a `ModelSource`: `version()` says cheaply which version it would serve now, `load()`
loads it (model and index). The app loads at start-up and then follows the source, polling every
`poll_interval_s` and on SIGHUP (when the server runs in the main thread), so a promotion or a rollback of the
registry alias is picked up without a restart. A load that fails leaves the previous version serving.
`LocalModelSource` serves a checkpoint file and an index folder; `RegistryModelSource` follows an alias of the
model registry; its `revision()` is the version with the index attached to it, so an index attached anew to the
same version (`xbn catalogue`) is loaded as a new version is.

For people: `GET /` is one static page over this API (drop an image, see the top-k thumbnails with labels and
scores). With a `challenger` source it also answers `POST /compare`, the champion's and the challenger's top-k
for the same image, which the page shows side by side for registry review. `GET /catalogue/{row}` returns a
catalogue image (only rows of the served index, read under `catalogue_root`).

Access: with a token configured (environment variable `XBN_SERVE_TOKEN`, or a file named by
`XBN_SERVE_TOKEN_FILE`; never a command-line argument, which `ps` shows), every route but `/health` and the
page answers 401 without `Authorization: Bearer <token>` (`/health` then shows a failure's text, masked, only to the
token). `serve` binds 127.0.0.1 unless told otherwise, and
without a token refuses any other address (`check_exposure`) and says every minute that it is open.

Hostile input (issue 27): uploads are opened by `xbn.data.images` (allowed formats, 415; any decoding failure,
400; over `max_pixels` or a bomb, 413), decoded at reduced size and under a pixel budget (`limits.PixelBudget`);
`limits.Limits` caps requests in flight and the time a body may take; the Host header is checked
(`serve.allowed_hosts`); catalogue rows stay under the catalogue root.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
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
from starlette.middleware.trustedhost import TrustedHostMiddleware

from xbn.config import ConfigError, ServeConfig
from xbn.data.images import decode, open_image
from xbn.evaluation.engine import forced_onnxruntime
from xbn.serving.index import CatalogueIndex
from xbn.serving.limits import RETRY_AFTER_S, Busy, Limits, PixelBudget
from xbn.serving.model import ServedModel, UnreadableImage, load_served_model
from xbn.serving.search import neighbours
from xbn.serving.sources import inside
from xbn.utils.io import file_digest
from xbn.utils.secrets import mask_error, mask_secrets

log = logging.getLogger(__name__)

TOKEN_ENV, TOKEN_FILE_ENV = "XBN_SERVE_TOKEN", "XBN_SERVE_TOKEN_FILE"
# Reachable without the token: a load balancer's probe has none, and the page holds no data (it asks for the
# token and sends it with each API call).
OPEN_PATHS = frozenset({"/health", "/", "/page.js", "/page.css"})
STATIC = Path(__file__).with_name("static")
PAGE = STATIC / "index.html"
# The page's own script and style only (no inline code, no other origin); thumbnails are blob: URLs.
PAGE_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; "
               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
OPEN_WARNING_INTERVAL_S = 60.0  # how often a server without a token says so
LOOPBACK_NAMES = frozenset({"localhost"})
STATUS = {"unreadable": 400, "too_large": 413, "unsupported": 415}
_FORM_OVERHEAD = 64 * 1024  # multipart boundaries and the k field around the image bytes


@dataclass(frozen=True)
class Loaded:
    """One version being served."""

    version: str
    model: ServedModel
    index: CatalogueIndex
    name: str
    alias: str | None = None
    revision: str | None = None  # the source's `revision()` it was loaded at (None: `version` says it all)


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
        inference: dict[str, Any] | None = None,
    ) -> None:
        self.model_path, self.index_dir = Path(model_path), Path(index_dir)
        self.image_size, self.name, self.device = image_size, name, device
        self.inference = inference or {}  # `inference` params: precision, channels_last

    def __str__(self) -> str:
        return f"{self.model_path} with the index {self.index_dir}"

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
            load_served_model(self.model_path, self.image_size, self.device, **self.inference),
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
        inference: dict[str, Any] | None = None,
    ) -> None:
        self.registry, self.fetch_index, self.cache_dir = registry, fetch_index, Path(cache_dir)
        self.alias, self.image_size, self.device, self.pinned = alias, image_size, device, pinned
        self.inference = inference or {}  # `inference` params: precision, channels_last

    def __str__(self) -> str:
        return f"{self.registry.name} v{self.pinned}" if self.pinned is not None else \
            f"{self.registry.name}@{self.alias}"

    def info(self) -> Any:
        """The registry's record of the version to serve now; None when the alias is on no version."""
        return self.registry.get(self.pinned) if self.pinned is not None else self.registry.by_alias(self.alias)

    def version(self) -> str | None:
        info = self.info()
        return None if info is None else str(info.version)

    def revision(self) -> str | None:
        """The version and the index attached to it: a catalogue re-indexed for the same version (`xbn
        catalogue`) is a new revision, which the holder loads as it loads a new version."""
        info = self.info()
        return None if info is None else self._revision(info)

    def _revision(self, info: Any) -> str:
        digest = getattr(self.registry, "index_digest", lambda _: None)(info)
        return f"{info.version}/{digest}" if digest else str(info.version)

    def load_model(self) -> tuple[Any, ServedModel]:
        """(version info, its embedder), without the index (what the batch embedding job needs)."""
        info = self.info()
        if info is None:
            raise LookupError(f"{self.registry.name} has no version with alias '{self.alias}'")
        checkpoint = self.registry.checkpoint(info, self._dir(info))  # sha256-verified against the store
        size = self.image_size or checkpoint.image_size
        if size is None:
            raise ValueError(f"{self.registry.name} v{info.version} records no image size: pass image_size")
        return info, load_served_model(checkpoint.path, size, self.device, **self.inference,
                                       onnx_graph=self._onnx_graph(info))

    def _onnx_graph(self, info: Any) -> Path | None:
        """The version's own ONNX graph (sha256-verified against its tag) when `inference.engine` may run
        ONNX Runtime on the CPU; None (a graph is exported and cached instead) when it has none."""
        fetch = getattr(self.registry, "fetch_onnx", None)
        engine = self.inference.get("engine", "auto")
        if (fetch is None or engine == "torch" or self.device != "cpu"
                or (engine == "auto" and forced_onnxruntime() is False)):
            return None
        return fetch(info, self._dir(info))

    def load(self) -> Loaded:
        info, model = self.load_model()
        return _loaded(
            str(info.version),
            model,
            CatalogueIndex.load(self.fetch_index(info, self._dir(info))),
            self.registry.name,
            None if self.pinned is not None else self.alias,
            self._revision(info),
        )

    def _dir(self, info: Any) -> Path:
        return self.cache_dir / f"v{info.version}"


def _loaded(version: str, model: ServedModel, index: CatalogueIndex, name: str, alias: str | None,
            revision: str | None = None) -> Loaded:
    index.check_model(model.sha256)  # never serve an index with a model that did not embed it
    return Loaded(version, model, index, name, alias, revision)


class Holder:
    """The version being served, swapped whole (one reference) when the source moves on. `role` names it in
    the log ("model", "challenger"), with the source. `absent`: the source has no version at all (a registry
    with no challenger), as opposed to one that failed to load."""

    def __init__(self, source: ModelSource, role: str = "model") -> None:
        self.source, self.role = source, role
        self.current: Loaded | None = None
        self.error: str | None = None
        self.absent = False
        self._lock = threading.Lock()  # one load at a time (poll and SIGHUP may coincide)

    def refresh(self) -> bool:
        """Load the source's version if it differs from the one served; True when it switched."""
        with self._lock:
            self.absent = False
            try:
                # A source with revisions (the registry: version and attached index) is compared by them.
                version = getattr(self.source, "revision", self.source.version)()
                self.absent = version is None
                if version is None:
                    raise LookupError("the model source has no version to serve")
                if self.current is not None and version == (self.current.revision or self.current.version):
                    return False
                loaded = self.source.load()
            except Exception as exc:  # noqa: BLE001 -- any failure: keep serving what is loaded, /health shows it
                error = mask_error(exc, limit=1000)
                # Once per distinct failure: the poll must not repeat it every few seconds (a store down for an
                # hour, a registry with no challenger yet). No version at all is a state, not a fault.
                level = (logging.DEBUG if error == self.error
                         else logging.WARNING if isinstance(exc, LookupError) else logging.ERROR)
                self.error = error
                what = "nothing to load" if self.absent else "cannot load it"
                log.log(level, "%s %s: %s, serving %s: %s", self.role, self.source, what,
                        f"version {self.current.version}" if self.current else "nothing", error)
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
    holder = Holder(model_source, "model")
    rival = Holder(challenger, "challenger") if challenger is not None else None
    budget = PixelBudget(cfg.max_decode_pixels)
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
        if secret is None:
            background.add(asyncio.create_task(_warn_open()))
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
    app.state.holder, app.state.config, app.state.open = holder, cfg, secret is None
    # Added last, so outermost: a foreign Host or a flood is answered before anything else runs.
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=cfg.allowed_hosts, www_redirect=False)
    app.add_middleware(Limits, max_concurrency=cfg.max_concurrency, body_timeout_s=cfg.body_timeout_s,
                       exempt={"/health"}, max_body_bytes=cfg.max_upload_bytes + _FORM_OVERHEAD)

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

    def decoded(data: bytes, name: str, min_side: int):
        image = open_image(data, name, formats=cfg.allowed_formats, max_pixels=cfg.max_pixels, min_side=min_side)
        with image, budget.hold(image.width * image.height):  # the size after a JPEG's draft
            return decode(image, name, min_side)

    async def picture(image: UploadFile, min_side: int):
        data = await image.read(cfg.max_upload_bytes + 1)
        if len(data) > cfg.max_upload_bytes:
            raise HTTPException(413, _too_large(cfg))
        try:
            return await run_in_threadpool(decoded, data, f"upload {image.filename!r}", min_side)
        except UnreadableImage as exc:
            raise HTTPException(STATUS[exc.kind], str(exc)) from None
        except Busy as exc:
            raise HTTPException(503, f"the server is busy decoding other images ({exc}): retry in "
                                f"{RETRY_AFTER_S} s", headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    async def embedding(image: UploadFile, served: Holder = holder) -> tuple[Loaded, Any]:
        loaded = served.require()
        query = await picture(image, loaded.model.decode_side)
        return loaded, await run_in_threadpool(loaded.model.embed_images, [query])

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
        # Both sides are checked before the upload is even read: no search runs for an answer that cannot be.
        if rival is None:
            raise HTTPException(404, "no challenger: this server serves one model (/compare needs the registry's)")
        if rival.current is None and rival.absent:
            raise HTTPException(404, f"no challenger in the registry ({rival.source} is on no version)")
        sides = {"champion": holder.require(), "challenger": rival.require()}
        if sides["challenger"].version == sides["champion"].version:  # an alias an EDIT account could not remove
            raise HTTPException(404, "no challenger: the registry's challenger is the champion itself")
        query = await picture(image, max(loaded.model.decode_side for loaded in sides.values()))
        answer = {}
        for side, loaded in sides.items():
            emb = await run_in_threadpool(loaded.model.embed_images, [query])
            found = await run_in_threadpool(neighbours, loaded.index, emb, k)
            answer[side] = {**_about(loaded), "results": found[0]}
        return {"k": k, **answer}

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text(), headers={"Content-Security-Policy": PAGE_POLICY})

    @app.get("/page.js")
    async def page_script() -> FileResponse:
        return FileResponse(STATIC / "page.js", media_type="text/javascript")

    @app.get("/page.css")
    async def page_style() -> FileResponse:
        return FileResponse(STATIC / "page.css", media_type="text/css")

    @app.get("/catalogue/{row}")
    async def catalogue(row: int) -> FileResponse:
        loaded = holder.require()
        if catalogue_root is None:
            raise HTTPException(404, "this server was started without the catalogue's image folder")
        if not 0 <= row < loaded.index.count:
            raise HTTPException(404, f"row {row} is not in the catalogue (0..{loaded.index.count - 1})")
        # Only a path the index holds, under the catalogue root: never a path taken from the request. A row
        # that leads outside the root (an absolute path, "..") is a tampered index; `xbn index` writes none.
        stored = str(loaded.index.ids["path"].iloc[row])
        path = inside(catalogue_root, stored)
        if path is None:
            log.warning("row %d of %s v%s points outside the catalogue root (%r): refused; the index was "
                        "tampered with", row, loaded.name, loaded.version, stored)
            raise HTTPException(404, f"row {row} is not in the catalogue")
        if not path.is_file():
            raise HTTPException(404, f"catalogue image {path.name} of row {row} is missing on this server")
        return FileResponse(path)

    @app.post("/embed")
    async def embed(image: UploadFile = File(..., description="the image to embed")) -> dict[str, Any]:  # noqa: B008
        loaded, emb = await embedding(image)
        return {**_about(loaded), "dim": int(emb.shape[1]), "embedding": emb[0].tolist()}

    def shown_error(request: Request) -> str | None:
        # /health answers without the token (a probe has none): the failure's text, which may name a store or a
        # path, only to a caller with the token (or on an open server), and masked in any case.
        if holder.error is None:
            return None
        if secret is None or _authorised(request, secret):
            return mask_secrets(holder.error)
        return "failing (details with the bearer token, or in the server's log)"

    @app.get("/health")
    async def health(request: Request):
        current = holder.current
        if current is None:
            return JSONResponse({"status": "unavailable", "error": shown_error(request)}, status_code=503)
        other = rival.current if rival is not None else None
        other = None if other is not None and other.version == current.version else other
        return {
            "status": "ok",
            **_about(current),
            "index_size": current.index.count,
            "index_type": current.index.meta.get("type"),
            "embedding_dim": current.model.embedding_dim,
            "max_k": cfg.max_k,
            "challenger": _about(other) if other is not None else None,
            "error": shown_error(request),
        }

    return app


def check_exposure(app: FastAPI, host: str) -> None:
    """Refuse (ConfigError) to serve `app` on `host` when that would open a door: without a token, any host but
    a loopback one; with one, a public host while serve.allowed_hosts holds only loopback names (every request
    would get 400)."""
    cfg: ServeConfig = app.state.config
    if app.state.open and not is_loopback(host):
        raise ConfigError(f"--host {host}: {host} is not a loopback address and no token is set, so anyone who "
                          f"can reach it could search and read the catalogue: set {TOKEN_ENV} or "
                          f"{TOKEN_FILE_ENV}, or serve on 127.0.0.1")
    if not is_loopback(host) and all(is_loopback(h.strip("[]")) for h in cfg.allowed_hosts):
        raise ConfigError(f"--host {host}: serve.allowed_hosts ({', '.join(cfg.allowed_hosts)}) names only "
                          "loopback hosts, so every request from elsewhere would be refused: list the names "
                          "clients use to reach this server")


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def make_server(
    app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"
) -> uvicorn.Server:
    """A uvicorn server for `app` (port 0: any free port, see `bound_port`)."""
    return uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    )


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Run `app` under uvicorn until SIGINT/SIGTERM (SIGHUP reloads the model); `check_exposure` first."""
    check_exposure(app, host)
    make_server(app, host, port, log_level).run()


def bound_port(server: uvicorn.Server) -> int:
    return server.servers[0].sockets[0].getsockname()[1]


async def _warn_open() -> None:
    while True:
        log.warning("serving without a token: every route is unauthenticated (set %s or %s to require one)",
                    TOKEN_ENV, TOKEN_FILE_ENV)
        await asyncio.sleep(OPEN_WARNING_INTERVAL_S)


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
