"""Which engine runs a trained model at inference: torch, or ONNX Runtime on the model's ONNX graph (issue 44
item 2, `inference.engine`).

Measured on AVX2 CPUs, `xbn serve` embedded at 0.40-0.67x ONNX Runtime's rate on the same model, compiled or
not; on an AVX512 CPU only torch.compile came close (0.94x), after 5-15 s compiling and with a C++ compiler. So
`inference.engine: auto` runs both on the first real batch (one untimed round, then `ROUNDS` timed rounds
interleaved, best kept, as the bf16 probe times its candidates) and keeps ONNX Runtime only when it is faster by
`MARGIN` and each of the batch's embeddings keeps cosine >= `PARITY_COSINE` to torch's float32 one; otherwise
torch, saying why. On CUDA auto is torch: the onnxruntime installed here is the CPU build.

The graph is the one `xbn export --format onnx` writes (`xbn.evaluation.onnx_export`: uint8 NHWC pixels in, the
normalisation inside): a registered version's own `onnx/` artifact when one is served (sha256-checked against
the version's `onnx_sha256` tag by `Registry.fetch_onnx`), otherwise exported once and kept in a cache
(`cache_dir()`), keyed by the checkpoint's sha256, the image size, the opset and the onnxruntime and torch
versions, beside a `.sha256` sidecar; a cached graph whose bytes fail the sidecar, or that ONNX Runtime cannot
load, is exported again.

What the engine is fed: `xbn serve` (`ServedModel.embed_images`) hands it the resized, centre-cropped pixels
directly. Passes that read a DataLoader's normalised tensors (index, embed, evaluate, the catalogue workers) are
turned back into the 8-bit pixels they came from (`pixels_of`: exact, those tensors are pixel / 255 normalised);
a tensor that is not 8-bit pixels (a pyfunc caller's own preprocessing) runs in torch.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from xbn.evaluation.inference import probe_images
from xbn.utils.cache import cache_root
from xbn.utils.errors import EnvironmentSettingError
from xbn.utils.runtime import synchronize

log = logging.getLogger(__name__)

ENGINES = ("auto", "torch", "onnxruntime")
# ONNX Runtime must beat torch by this much to be chosen. Smaller than bf16's 1.2 (PRECISION_MARGIN): its
# embeddings are float32's (the parity check), so only timing noise is guarded against, not rounding.
MARGIN = 1.05
PARITY_COSINE = 0.9999  # every row of the first batch, ONNX Runtime against torch float32
ROUNDS = 2  # timed rounds per engine on the first batch, after one untimed round (as the bf16 probe)
QUIET_S = 0.02  # a pause after each engine's pass in the race, so its idle threads are asleep when the other runs
PIXEL_TOLERANCE = 1e-2  # how far from an integer a denormalised tensor's value may be and still be a pixel
# "0": auto keeps torch without exporting or timing anything (the test suite sets it, as it sets XBN_CPU_BF16=0:
# runs compared across processes must not differ by a race); "1": auto takes ONNX Runtime without the race.
FORCE_ENV = "XBN_ONNXRUNTIME"


def forced_onnxruntime() -> bool | None:
    """`XBN_ONNXRUNTIME`: True/False when set to 1/0, None when unset; anything else is an error naming it."""
    value = os.environ.get(FORCE_ENV, "").strip()
    if not value:
        return None
    if value not in ("0", "1"):
        raise EnvironmentSettingError(f"{FORCE_ENV}={value!r}: use 1 (auto takes onnxruntime), 0 (auto keeps "
                                      f"torch), or leave it unset")
    return value == "1"


def cache_dir() -> Path:
    """The graphs' folder: `onnx/` in xbn's cache (`xbn.utils.cache`)."""
    return cache_root() / "onnx"


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's cpuset, `taskset`), not the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS has no affinity call
        return os.cpu_count() or 1


@dataclass(frozen=True)
class EngineChoice:
    """The engine that runs the model and what chose it (recorded with the run, as `InferenceMode`)."""

    engine: str = "torch"
    chosen_by: str = "default"
    rates: dict[str, float] = field(default_factory=dict, compare=False)  # images/s on the first batch
    cosine: float | None = field(default=None, compare=False)  # lowest cosine of ONNX Runtime to torch float32

    @property
    def pending(self) -> bool:
        """auto, still waiting for the first real batch to time both engines on."""
        return self.engine == "auto"

    def record(self) -> dict[str, float]:
        """Numbers only (eval.json, index.json, MLflow): 1/0 for ONNX Runtime, the rates, the parity."""
        return {"onnxruntime": float(self.engine == "onnxruntime"),
                **{f"engine_{name}_images_per_s": round(rate, 1) for name, rate in self.rates.items()},
                **({"onnxruntime_min_cosine": round(self.cosine, 6)} if self.cosine is not None else {})}

    def describe(self) -> str:
        details = [f"{name} {rate:.1f} img/s" for name, rate in self.rates.items()]
        if self.cosine is not None:
            details.append(f"min cosine to torch float32 {self.cosine:.6f}")
        return f"engine {self.engine}{' (' + ', '.join(details) + ')' if details else ''}, chosen by {self.chosen_by}"


TORCH = EngineChoice(chosen_by="params")


def session(path: str | Path, threads: int | None = None):
    """An ONNX Runtime CPU session over the graph at `path`: every graph optimisation; intra-op threads = the
    cores this process may use (`usable_cores`), no more than torch's own thread count (which a catalogue
    worker's `catalogue.threads_per_worker`, OMP_NUM_THREADS or `torch.set_num_threads` lowered: both engines
    use the cores they were given, and a race between them is fair); threads that sleep rather than spin when
    idle: on 2 cores a spinning pool slowed the torch work beside it (a loader's normalisation, `pixels_of`, the
    race) from 2 ms to 430 ms a batch for tens of milliseconds after each call, and ran no faster itself."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads or max(1, min(usable_cores(), torch.get_num_threads()))
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3  # errors only: its warnings about unused initializers are noise here
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class OnnxEngine:
    """An ONNX Runtime session over a model's pixel graph, and the engine chosen for that model (`choice`).
    Shared by every thread that embeds with the model: the decision is taken once, under a lock."""

    def __init__(self, path: str | Path, ort_session: Any, mean, std, choice: EngineChoice) -> None:
        from xbn.evaluation.onnx_export import INPUT, OUTPUT

        self.path = Path(path)
        self.session = ort_session
        self._names = INPUT, OUTPUT
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
        self.choice = choice
        self._lock = threading.Lock()
        self._not_pixels_logged = False

    @property
    def runs_onnx(self) -> bool:
        return self.choice.engine == "onnxruntime"

    def embed_pixels(self, pixels: np.ndarray) -> np.ndarray:
        """Embeddings of uint8 pixels [N, S, S, 3] (`ServedModel.pixels`) by ONNX Runtime."""
        name_in, name_out = self._names
        return self.session.run([name_out], {name_in: np.ascontiguousarray(pixels, dtype=np.uint8)})[0]

    def tensor(self, pixels: np.ndarray) -> torch.Tensor:
        """The normalised float32 [N, 3, S, S] batch the eval transform makes of these pixels (its to-tensor and
        normalise steps, the same operations in the same order)."""
        x = torch.from_numpy(np.ascontiguousarray(pixels)).permute(0, 3, 1, 2).float().div(255)
        return x.sub_(self.mean).div_(self.std)

    def pixels_of(self, images: torch.Tensor) -> np.ndarray | None:
        """The uint8 NHWC pixels a normalised batch was made of (`tensor`'s inverse: exact, its values are
        pixel / 255), or None when it was not made of 8-bit pixels."""
        x = images.detach().float().cpu().mul(self.std).add_(self.mean).mul_(255)
        rounded = x.round()
        if (x.sub_(rounded).abs_().max() > PIXEL_TOLERANCE or rounded.min() < 0 or rounded.max() > 255):
            return None
        return rounded.to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()

    def forward(self, images: torch.Tensor, network: nn.Module) -> torch.Tensor:
        """The embeddings of a normalised batch by the chosen engine (`network`: the torch side)."""
        if self.choice.engine == "torch":
            return network(images)
        pixels = self.pixels_of(images)
        if pixels is None:
            if not self._not_pixels_logged:
                self._not_pixels_logged = True
                log.info("inference: a batch that is not 8-bit pixels (its own preprocessing) runs in torch")
            return network(images)
        if self.choice.pending:
            return self.decide(images, pixels, network)
        return torch.from_numpy(self.embed_pixels(pixels)).to(images.device)

    def decide(self, images: torch.Tensor, pixels: np.ndarray, network: nn.Module) -> torch.Tensor:
        """auto on the first real batch: time both engines, check ONNX Runtime's parity with torch float32,
        keep the faster of those that agree (`MARGIN`), record why; returns the chosen engine's output."""
        with self._lock:
            if not self.choice.pending:  # another thread decided meanwhile
                return self.forward(images, network)
            outputs, rates = _race(images, pixels, network, self)
            reference = outputs["torch_float32"]
            cosine = F.cosine_similarity(torch.from_numpy(outputs["onnxruntime"]), reference.float().cpu(),
                                         dim=1).min().item()
            ort_rate, torch_rate = rates["onnxruntime"], rates["torch"]
            batch = f"on the first batch ({len(images)} image{'s' if len(images) > 1 else ''})"
            if cosine < PARITY_COSINE:
                engine, why = "torch", (f"auto: onnxruntime disagrees with torch float32 {batch} (min cosine "
                                        f"{cosine:.6f} < {PARITY_COSINE})")
            elif ort_rate > MARGIN * torch_rate:
                engine, why = "onnxruntime", f"auto: faster than torch by {ort_rate / torch_rate:.2f}x {batch}"
            else:
                engine, why = "torch", (f"auto: onnxruntime not faster than torch by {MARGIN}x {batch} "
                                        f"({ort_rate / torch_rate:.2f}x)")
            self.choice = EngineChoice(engine, why, rates, cosine)
            (log.warning if cosine < PARITY_COSINE else log.info)("inference: %s", self.choice.describe())
            if engine == "onnxruntime":
                return torch.from_numpy(outputs["onnxruntime"]).to(images.device)
            self.session = None  # torch from now on: its threads and memory go
            return outputs["torch"]


def _race(images: torch.Tensor, pixels: np.ndarray, network: nn.Module,
          engine: OnnxEngine) -> tuple[dict[str, Any], dict[str, float]]:
    """Both engines' outputs on one batch (torch as the caller runs it, e.g. under bf16 autocast or compiled,
    and in float32 for the parity) and their best images/s over `ROUNDS` rounds after an untimed one."""
    device = images.device
    outputs: dict[str, Any] = {}
    best = {"torch": float("inf"), "onnxruntime": float("inf")}
    for round_ in range(ROUNDS + 1):
        synchronize(device)
        start = time.perf_counter()
        out = network(images)
        synchronize(device)
        seconds = time.perf_counter() - start
        time.sleep(QUIET_S)
        start = time.perf_counter()
        onnx_out = engine.embed_pixels(pixels)
        onnx_seconds = time.perf_counter() - start
        time.sleep(QUIET_S)
        if round_:
            best["torch"] = min(best["torch"], seconds)
            best["onnxruntime"] = min(best["onnxruntime"], onnx_seconds)
        else:
            outputs["torch"], outputs["onnxruntime"] = out, onnx_out
    if torch.is_autocast_enabled(device.type):
        with torch.autocast(device_type=device.type, enabled=False):
            outputs["torch_float32"] = network(images).float()
    else:
        outputs["torch_float32"] = outputs["torch"]
    return outputs, {name: len(images) / seconds for name, seconds in best.items()}


class Engined(nn.Module):
    """`network` behind an `OnnxEngine`: what `xbn.evaluation.inference.run` and `embed` call as the model."""

    def __init__(self, network: nn.Module, engine: OnnxEngine) -> None:
        super().__init__()
        self.network = network
        self.engine = engine

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.engine.forward(images, self.network)


def engined(network: nn.Module, engine: OnnxEngine | None) -> nn.Module:
    """`network`, behind `engine` when there is one."""
    return network if engine is None else Engined(network, engine)


# -- the graph ---------------------------------------------------------------------------------------------------

def _versions() -> str:
    import onnxruntime as ort

    from xbn.evaluation.onnx_export import OPSET

    return f"opset{OPSET}-ort{ort.__version__}-torch{torch.__version__.split('+')[0]}"


def cached_graph_path(model_sha256: str, image_size: int) -> Path:
    """Where the graph of the checkpoint with this sha256 at this size is cached (see the module docstring)."""
    return cache_dir() / f"{model_sha256[:24]}-{int(image_size)}px-{_versions()}.onnx"


def _sidecar_ok(path: Path) -> bool:
    from xbn.utils.integrity import sidecar_path
    from xbn.utils.io import file_digest

    try:
        text = sidecar_path(path).read_text().split()
        return bool(text) and text[0] == file_digest(path)
    except OSError:
        return False


def cached_graph(served, threads: int | None = None) -> tuple[Path, Any]:
    """(the cached graph of `served` (a `ServedModel`), a session over it), exported first when it is not
    cached or the cached file fails its sidecar or does not load."""
    from xbn.evaluation.onnx_export import export_onnx
    from xbn.utils.integrity import write_sidecar

    path = cached_graph_path(served.sha256 or _weights_digest(served.model), served.image_size)
    if path.exists():
        if _sidecar_ok(path):
            try:
                return path, session(path, threads)
            except Exception as exc:  # noqa: BLE001 -- any load failure: the file is not to be trusted
                log.warning("inference: the cached ONNX graph %s does not load (%s): exporting it again", path,
                            str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        else:
            log.warning("inference: the cached ONNX graph %s fails its sha256 sidecar: exporting it again", path)
    log.info("inference: exporting the model to ONNX for onnxruntime (once, cached at %s)", path)
    start = time.perf_counter()
    export_onnx(served, path)  # written to a temp file, then renamed
    check_export(served, path)
    write_sidecar(path)
    log.info("inference: ONNX export took %.1f s", time.perf_counter() - start)
    return path, session(path, threads)


def check_export(served, path: Path) -> None:
    """The exported graph against torch float32 on two smooth synthetic images: a graph that disagrees is
    deleted, never cached."""
    from xbn.evaluation.onnx_export import ParityError

    images = probe_images(2, served.image_size, torch.device("cpu"))
    mean = torch.tensor(served.data_config["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(served.data_config["std"]).view(1, 3, 1, 1)
    pixels = ((images * 0.5 + 0.5) * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()
    x = pixels.permute(0, 3, 1, 2).float().div(255).sub(mean).div(std)
    model = served.model
    with torch.inference_mode():
        expected = model.to("cpu")(x).float() if served.device.type == "cpu" else model(x.to(served.device)).cpu()
    got = torch.from_numpy(session(path).run(None, {"images": pixels.numpy()})[0])
    cosine = F.cosine_similarity(got, expected.float(), dim=1).min().item()
    if cosine < PARITY_COSINE:
        path.unlink(missing_ok=True)
        raise ParityError(f"the ONNX export of {served.sha256[:12] or 'the model'} disagrees with torch "
                          f"(min cosine {cosine:.6f} < {PARITY_COSINE}): not cached")


def _weights_digest(model: nn.Module) -> str:
    """A sha256 of the weights, for a model served without its checkpoint file's."""
    import hashlib

    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def registered_graph(path: str | Path, served, threads: int | None = None):
    """A session over a registered version's graph (already sha256-checked against its tag), or None (logged)
    when it is not this model's graph at this size or does not load: the cache then serves."""
    from xbn.evaluation.onnx_export import onnx_metadata

    try:
        meta = onnx_metadata(path)
        if served.sha256 and meta.get("model_sha256") not in (None, "", served.sha256):
            raise ValueError(f"it was exported from checkpoint {str(meta.get('model_sha256'))[:12]}")
        if int(meta.get("image_size", served.image_size)) != served.image_size:
            raise ValueError(f"it takes {meta.get('image_size')} px images, not {served.image_size}")
        return session(path, threads)
    except Exception as exc:  # noqa: BLE001 -- not usable: say why and export our own
        log.warning("inference: the registered ONNX graph %s is not used (%s)", path, exc)
        return None


# -- choosing ------------------------------------------------------------------------------------------------------

@functools.cache
def _onnxruntime_missing() -> str | None:
    try:
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401 -- torch's exporter needs it
    except ImportError as exc:
        return str(exc)
    return None


def engine_for(served, setting: str = "auto", graph: str | Path | None = None,
               threads: int | None = None) -> OnnxEngine | None:
    """The ONNX engine of `served` (a `ServedModel`) for `inference.engine` = `setting`: None for torch (chosen,
    or auto where ONNX Runtime cannot run: CUDA, not installed, the export failed); `graph`: a registered
    version's sha256-checked graph. `onnxruntime` on CUDA or without onnxruntime is a `ConfigError`."""
    from xbn.config import ConfigError

    if setting not in ENGINES:
        raise ConfigError(f"inference.engine: {setting!r} is not one of {', '.join(ENGINES)}")
    if setting == "torch":
        return None
    forced = forced_onnxruntime() if setting == "auto" else None
    if forced is False:
        log.info("inference: engine torch, chosen by %s=0", FORCE_ENV)
        return None
    if served.device.type != "cpu":
        if setting == "onnxruntime":
            raise ConfigError(f"inference.engine: onnxruntime runs on the CPU only (the installed onnxruntime is "
                              f"the CPU build), but the model runs on {served.device}: use auto or torch, or "
                              f"train.device: cpu")
        log.info("inference: engine torch, chosen by auto: %s device", served.device.type)
        return None
    if (missing := _onnxruntime_missing()) is not None:
        if setting == "onnxruntime":
            raise ConfigError(f"inference.engine: onnxruntime needs onnxruntime and onnxscript installed ({missing})")
        log.info("inference: engine torch, chosen by auto: onnxruntime is not installed (%s)", missing)
        return None
    choice = (EngineChoice("onnxruntime", "params") if setting == "onnxruntime" else
              EngineChoice("onnxruntime", f"{FORCE_ENV}=1") if forced else EngineChoice("auto", "auto"))
    found = registered_graph(graph, served, threads) if graph is not None else None
    try:
        path, ort_session = ((Path(graph), found) if graph is not None and found is not None
                             else cached_graph(served, threads))
    except Exception as exc:
        if setting == "onnxruntime":
            raise
        log.warning("inference: engine torch, chosen by auto: the ONNX export failed (%s: %s)",
                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        return None
    if choice.engine == "onnxruntime":
        log.info("inference: %s", choice.describe())
    return OnnxEngine(path, ort_session, served.data_config["mean"], served.data_config["std"], choice)


def settled_choice(engine: OnnxEngine | None) -> EngineChoice:
    """The choice to record: torch when there is no engine."""
    return TORCH if engine is None else engine.choice


__all__ = ["ENGINES", "MARGIN", "PARITY_COSINE", "EngineChoice", "Engined", "OnnxEngine", "cache_dir",
           "cached_graph", "cached_graph_path", "engine_for", "engined", "session", "settled_choice",
           "usable_cores"]
