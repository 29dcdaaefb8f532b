"""Constants shared by tests in several folders (importable because pytest puts tests/ on sys.path)."""

import hashlib
import json
import socket
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

TINY = [
    "data.glyphs.classes=24", "data.glyphs.images_per_class=4", "data.glyphs.image_size=32",
    "data.image_size=32", "data.num_workers=0", "data.val_classes=0.25",
    "model.backbone=test_efficientnet", "model.pretrained=none", "model.embedding_dim=16",
    "train.epochs=2", "train.warmup_epochs=1", "train.batch_size=16", "train.samples_per_class=4",
    "train.log_every=1", "train.probe_size=8", "eval.k=[1, 2, 4]", "eval.batch_size=32",
    # A random-init tiny net puts every pair beyond the pair-margin miner's margins: use all pairs.
    "loss.miner=null", "tracking.enabled=false",
    # No DVC project around a test's tmp folder: the retrain flow's snapshot records the manifest only.
    "data.version=none",
    # auto's probe times both memory formats, so two runs could choose differently: tests that compare runs pin it.
    "train.channels_last=false",
]


def write_tiny_params(path: Path, *overrides: str) -> Path:
    """The shipped params.yaml with TINY and `overrides` applied (`xbn.config.apply_overrides`, as `--set`
    does), written to `path`: a project a subprocess runs `xbn` in."""
    import yaml

    from xbn.config import apply_overrides

    raw = apply_overrides(yaml.safe_load((ROOT / "params.yaml").read_text()), [*TINY, *overrides])
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def brute_force_recall_at_1(embeddings, labels) -> float:
    """Leave-one-out R@1 by cosine similarity, written out in full (no faiss, no chunking): does each item's
    nearest other item share its label; items whose label occurs once have no answer and are left out.
    The similarity is the one evaluation defines (xbn.evaluation.cpu_knn.rescore) on the model's float32
    L2-normalized embeddings: their float64 dot product rounded to float32, ties to the lower index (argmax's
    first). In float64 a tiny net's near-tie (6.7e-8 apart) resolved the other way: one query of 48."""
    import torch

    x = torch.as_tensor(embeddings, dtype=torch.float32).double()
    labels = torch.as_tensor(labels)
    similarity = (x @ x.T).float()
    similarity.fill_diagonal_(float("-inf"))
    same = labels[:, None] == labels[None, :]
    answerable = same.sum(1) > 1
    hit = same[torch.arange(len(x)), similarity.argmax(1)]
    return float(hit[answerable].double().mean())


def split_embeddings(params, split: str, model_path: str | Path = "models/model.pt"):
    """(embeddings, labels) of a saved model on a split of params' manifest, on the CPU; images unreadable
    now are left out, as evaluation does."""
    import torch

    from xbn.data import read_manifest
    from xbn.evaluation.embed import embed_split
    from xbn.models import load_embedder

    model, data_config, _ = load_embedder(model_path, map_location="cpu")
    return embed_split(
        model, read_manifest(params.data.manifest), params.data.root, split,
        image_size=params.data.image_size, mean=data_config["mean"], std=data_config["std"],
        batch_size=params.eval.batch_size, num_workers=0, device=torch.device("cpu"))


def recomputed_recall_at_1(params, split: str, model_path: str | Path = "models/model.pt") -> float:
    """R@1 of a saved model on a split, recomputed by `brute_force_recall_at_1`, to check a reported R@1
    against."""
    return brute_force_recall_at_1(*split_embeddings(params, split, model_path))


# What a fresh environment may take from this one by path, gigabytes each: torch and torchvision with the CUDA
# libraries and triton that torch's wheel requires (their dist-info too, so that pip sees them installed).
LOCAL_ONLY = ("torch", "torchgen", "torchvision", "nvidia", "triton", "cuda")


def fresh_environment(venv: Path, with_pip: bool = False, requirements: list[str] | None = None) -> Path:
    """A new virtual environment without xbn (unless `requirements` name it), and its python.

    Without `requirements`, the dependencies are this environment's, added by path (a .pth line does not run that
    folder's own .pth files, so the editable link to the checkout stays out). With them, it gets exactly those,
    installed by pip from the package index as a serving host would, except `LOCAL_ONLY` (torch and what its wheel
    brings), linked from this environment: a download of those would be gigabytes."""
    import subprocess
    import sys
    import sysconfig

    here = Path(sysconfig.get_paths()["purelib"])
    # The requirements go in with this environment's pip (`pip --python`): the venv's own would cost an
    # ensurepip for nothing the test checks.
    subprocess.run([sys.executable, "-m", "venv", *([] if with_pip else ["--without-pip"]), str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    if requirements is None:
        (site / "dependencies.pth").write_text(f"{here}\n")
    else:
        local = venv / "local-torch"
        local.mkdir()
        for entry in here.iterdir():
            if entry.name.lower().startswith(LOCAL_ONLY):
                (local / entry.name).symlink_to(entry)
        (site / "local-torch.pth").write_text(f"{local}\n")
    missing = subprocess.run([str(python), "-c", "import xbn"], capture_output=True, text=True, cwd=venv)
    assert missing.returncode != 0 and "No module named 'xbn'" in missing.stderr, missing.stderr
    if requirements is not None:  # xbn's own wheel may be one of them
        # --no-compile: the bytecode of every installed module is written as it is first imported instead
        done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                               "--disable-pip-version-check", "--no-compile", "-q", *requirements],
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
    return python


def digests(folder: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `folder`: two folders hold the same files, byte for byte."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def free_port() -> int:
    """A loopback port nothing listens on once this returns (the OS picked it and the socket is closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class NotificationReceiver:
    """A real HTTP server on 127.0.0.1 that Apprise posts to (a `json://` URL): what a chat webhook receives."""

    def __init__(self) -> None:
        import http.server
        import threading

        self.messages: list[dict] = []
        received = self.messages

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the http.server API
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                received.append(json.loads(body or b"{}"))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):  # quiet
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"json://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
