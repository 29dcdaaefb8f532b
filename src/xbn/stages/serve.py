"""What serves a model: `xbn search`, `xbn serve` and `xbn embed`, over the registry's champion by default.

The model (and its catalogue index) comes from one of three places: the registry version holding
`serve.alias` (`models:/<registry.model_name>@champion`, with the index `xbn index` attached to it), a named
version (`--model-version`), or the local `models/model.pt` with `index.output` (`--local`). Registry files
are downloaded (sha256-verified) under `serve.cache_dir/v<N>/`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from xbn.config import ConfigError, Params
from xbn.serving.http import Loaded, LocalModelSource, RegistryModelSource, create_app
from xbn.serving.http import serve as run_server
from xbn.serving.model import ServedModel, load_served_model
from xbn.serving.search import search_images
from xbn.serving.sources import source_root
from xbn.utils.errors import RegistryError
from xbn.utils.runtime import resolve_device

log = logging.getLogger(__name__)


def model_source(params: Params, version: int | None = None, local: bool = False, long_running: bool = False):
    """The `ModelSource` of the command line's choice (see the module docstring); `long_running`: for `xbn
    serve` (`inference.compile: auto` compiles its models)."""
    device = str(resolve_device(params.train.device))
    inference = {**params.inference.model_dump(), "long_running": long_running}
    if local:
        if version is not None:
            raise ConfigError("--local serves models/model.pt: it cannot be combined with --model-version")
        return LocalModelSource(Path(params.train.checkpoint_dir) / "model.pt", params.index.output,
                                params.data.image_size, device=device, inference=inference)
    if not params.tracking.enabled:
        raise ConfigError("tracking.enabled is false, so there is no registry to serve from: pass --local "
                          "(models/model.pt with the index at index.output)")
    from xbn.tracking import Registry

    registry = Registry(params)
    return RegistryModelSource(registry, registry.fetch_index, params.serve.cache_dir, alias=params.serve.alias,
                               device=device, pinned=version, inference=inference)


def _registry_failure(source, exc: Exception) -> RegistryError:
    what = f"v{source.pinned}" if source.pinned is not None else f"'{source.alias}'"
    return RegistryError(f"cannot serve {source.registry.name} {what}: {exc}")


def _require_version(source) -> None:
    """Fail in one line when the registry has nothing to serve (no champion yet, an unknown version)."""
    if isinstance(source, LocalModelSource):
        return
    try:
        found = source.version()
    except ValueError as exc:  # Registry.get: no such version
        raise RegistryError(str(exc)) from None
    if found is None:
        raise RegistryError(f"{source.registry.name} has no version with alias '{source.alias}': register one "
                            "(`xbn register`, `xbn registry promote`), or pass --model-version N or --local")


def load(params: Params, version: int | None = None, local: bool = False) -> Loaded:
    """The model and its index, as the command line chose them."""
    source = model_source(params, version, local)
    _require_version(source)
    try:
        return source.load()
    except LookupError as exc:  # the version has no index attached
        raise _registry_failure(source, exc) from None


def load_model(params: Params, version: int | None = None, local: bool = False) -> ServedModel:
    """Only the model (the batch embedding job needs no index)."""
    source = model_source(params, version, local)
    if isinstance(source, LocalModelSource):
        if not source.model_path.exists():
            raise FileNotFoundError(f"no trained model at {source.model_path}: run `xbn train` first")
        return load_served_model(source.model_path, source.image_size, source.device, **source.inference)
    _require_version(source)
    return source.load_model()[1]


def search(params: Params, images: list[str], k: int | None = None, *, version: int | None = None,
           local: bool = False) -> tuple[list[dict[str, Any]], Loaded]:
    """Each image's top-k catalogue items (`xbn.serving.search.search_images`); an unreadable image gets an
    entry with its error and the others still answer."""
    k = k or params.serve.default_k
    if k > params.serve.max_k:
        raise ConfigError(f"--k {k} exceeds serve.max_k ({params.serve.max_k})")
    loaded = load(params, version, local)
    log.info("searching %s v%s (index of %d) for %d image(s)", loaded.name, loaded.version,
             loaded.index.count, len(images))
    return search_images(loaded.model, loaded.index, images, k), loaded


def serve(params: Params, host: str | None = None, port: int | None = None, *, version: int | None = None,
          local: bool = False) -> None:
    """Run the HTTP endpoint until interrupted; it follows `serve.alias` (polling every
    `serve.poll_interval_s`, and on SIGHUP) unless a version or the local model is named."""
    app = serving_app(params, version=version, local=local)
    run_server(app, host or params.serve.host, params.serve.port if port is None else port)


def serving_app(params: Params, *, version: int | None = None, local: bool = False, token=...):
    """The app `xbn serve` runs (`token`: as `create_app`'s, by default from the environment). Following the
    registry's alias, it also loads the challenger (when there is one) for the page's side-by-side review
    (`POST /compare`)."""
    source = model_source(params, version, local, long_running=True)
    _require_version(source)
    challenger = None
    if isinstance(source, RegistryModelSource) and source.pinned is None and source.alias != "challenger":
        challenger = RegistryModelSource(source.registry, source.registry.fetch_index, params.serve.cache_dir,
                                         alias="challenger", device=source.device, inference=source.inference)
    return create_app(source, params.serve, token=token, challenger=challenger,
                      catalogue_root=source_root(params.index.source, params.data.root))


def embed(params: Params, source: str, output: str, *, version: int | None = None, local: bool = False,
          progress: bool = True) -> dict[str, Any]:
    """The batch embedding job (`xbn.serving.embed_job`): `source` (a folder or a manifest-format CSV) ->
    the parquet file `output`, resumable after a kill."""
    from xbn.serving.embed_job import embed_to_parquet

    model = load_model(params, version, local)
    report = embed_to_parquet(model, source, output, batch_size=params.index.batch_size,
                              num_workers=params.data.num_workers, progress=progress)
    return {"output": str(report.output), "rows": report.rows, "skipped": report.skipped,
            "chunks_resumed": report.chunks_resumed, "model_sha256": model.sha256}
