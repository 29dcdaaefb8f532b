"""`xbn export --format onnx`: models/model.pt as one ONNX file with a free batch axis (uint8 pixels in, the
normalisation in the graph) and its preprocessing rule beside it (`<file>.json`), checked against torch on real
catalogue images (max |diff| <= 1e-4) before they are kept, and attached to the model's registry version
(under `onnx/<sha256>/`, the ONNX file's sha256 as the version tag `onnx_sha256`), and logged as an
`mlflow.onnx` model in the version's run (tag `onnx_model_uri`)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from xbn.config import ConfigError, Params
from xbn.evaluation.onnx_export import PARITY_ATOL, check_parity, export_onnx, rule_path, save_mlflow_onnx
from xbn.serving.sources import read_source
from xbn.stages.index import local_model, registered_version

log = logging.getLogger(__name__)

FORMATS = ("onnx",)
PARITY_IMAGES = 8  # catalogue images the parity check embeds both ways


def export(params: Params, fmt: str = "onnx", output: str | None = None) -> dict[str, Any]:
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt}: only {', '.join(FORMATS)} is supported")
    model = local_model(params)
    path = Path(output or Path(params.train.checkpoint_dir) / "model.onnx")
    frame, root = read_source(params.index.source, manifest=params.data.manifest, root=params.data.root)
    images = [root / p for p in frame["path"].head(PARITY_IMAGES)]
    export_onnx(model, path)
    try:
        diff = check_parity(model, path, images, PARITY_ATOL)
    except AssertionError:
        path.unlink(missing_ok=True)  # a file that disagrees with torch is not left for anyone to serve
        rule_path(path).unlink(missing_ok=True)
        raise
    report: dict[str, Any] = {"output": str(path), "preprocessing": str(rule_path(path)),
                              "max_abs_diff": diff, "parity_images": len(images),
                              "model_sha256": model.sha256, "version": None}
    version = registered_version(params, model.sha256)
    if version is not None:
        from xbn.tracking import Registry

        with tempfile.TemporaryDirectory(prefix="xbn-onnx-") as tmp:  # the graph as an mlflow.onnx model too
            folder = save_mlflow_onnx(path, Path(tmp) / "onnx_model")
            Registry(params).log_onnx(version, path, rule_path(path), mlflow_model=folder)
        report["version"] = version.version
    log.info("ONNX -> %s (parity max |diff| %.1e on %d images)", path, diff, len(images))
    return report
