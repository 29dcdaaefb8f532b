"""xbn as a user installs it (issue 43): the wheel built from this checkout, in a virtual environment of its own,
run from a folder outside the checkout. `xbn --version` and `xbn init`'s commented template must come from the
installed package, never from the checkout (`fresh_environment`: the dependencies are this environment's)."""

import json
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from tests_support import ROOT, fresh_environment


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from this checkout, as `pip install .` builds it."""
    dist = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(ROOT)], check=True, capture_output=True, cwd=dist)
    return next(dist.glob("xbn-*.whl"))


def test_the_built_wheel_runs_outside_the_checkout_with_its_own_template(tmp_path, wheel):
    with zipfile.ZipFile(wheel) as archive:  # a file in the wheel, not the checkout's link
        assert archive.read("xbn/templates/params.yaml").decode() == (ROOT / "params.yaml").read_text()

    venv = tmp_path / "venv"
    python = fresh_environment(venv, with_pip=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   capture_output=True)

    user = tmp_path / "user"
    user.mkdir()

    def xbn(*args: str) -> str:
        done = subprocess.run([str(venv / "bin" / "xbn"), *args], cwd=user, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout + done.stderr

    where = subprocess.run([str(python), "-c", "import json, xbn; print(json.dumps([xbn.__file__, xbn.__version__]))"],
                           cwd=user, check=True, capture_output=True, text=True).stdout
    location, version = json.loads(where)
    assert Path(location).is_relative_to(venv) and version == metadata.version("xbn")
    assert version in xbn("--version")
    xbn("init", "--dataset", "glyphs", "--root", "data/glyphs")
    written = (user / "params.yaml").read_text()
    assert "\n# xbn parameters, grouped by stage" in written and "# none | xbm | xbn" in written  # with comments
    assert any(line.strip().startswith("root:") and "data/glyphs" in line for line in written.splitlines())


# What the memory's own loop may import, and packages it must not find installed at all: the pipeline's.
LIBRARY_SCRIPT = """
import importlib.util, json, sys
import torch
from pytorch_metric_learning import losses
import xbn

torch.manual_seed(0)
inner = losses.ContrastiveLoss(pos_margin=0.0, neg_margin=0.5)
memory_loss = xbn.cross_batch_memory(inner, embedding_size=16, memory_size=64, method="axbn", kalman={"r": 0.1})
model = torch.nn.Linear(32, 16)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
losses_seen = []
for step in range(2):
    features, labels = torch.randn(16, 32), torch.arange(4).repeat(4)
    embeddings = torch.nn.functional.normalize(model(features))
    loss = memory_loss(embeddings, labels) + inner(embeddings, labels)
    optimizer.zero_grad()
    loss.backward()
    assert model.weight.grad.abs().sum() > 0
    optimizer.step()
    losses_seen.append(float(loss))
pipeline = ("pydantic", "yaml", "pandas", "mlflow", "prefect", "dvc", "great_expectations", "optuna", "faiss",
            "fastapi", "onnx", "timm", "torchvision", "distributed")
print(json.dumps({"losses": losses_seen, "rows": memory_loss.num_valid, "file": xbn.__file__,
                  "moments": type(memory_loss.moments).__name__,
                  "loaded": sorted({m.split(".")[0] for m in sys.modules} & set(pipeline)),
                  # torchvision is linked beside torch by the test's environment (tests_support.LOCAL_ONLY)
                  "installed": [p for p in pipeline if p != "torchvision" and importlib.util.find_spec(p)]}))
"""


def test_the_wheel_without_extras_trains_with_the_memory_and_has_none_of_the_pipeline(tmp_path, wheel):
    # `pip install xbn` as a pytorch-metric-learning user runs it: the wheel and its declared dependencies from the
    # package index (torch linked: `fresh_environment`), no extras. Two steps of a PML loss with the memory train,
    # and none of the pipeline's packages is installed, let alone imported; the CLI says which extra it needs.
    venv = tmp_path / "venv"
    python = fresh_environment(venv, requirements=[str(wheel)])
    user = tmp_path / "user"
    user.mkdir()
    done = subprocess.run([str(python), "-c", LIBRARY_SCRIPT], cwd=user, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert Path(report["file"]).is_relative_to(venv) and report["moments"] == "KalmanMoments"
    assert report["rows"] == 32 and all(loss > 0 for loss in report["losses"])
    assert report["loaded"] == [] and report["installed"] == []
    cli = subprocess.run([str(venv / "bin" / "xbn"), "train"], cwd=user, capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and "pip install 'xbn[all]'" in cli.stderr and "Traceback" not in cli.stderr, \
        cli.stderr
    assert len(cli.stderr.strip().splitlines()) == 1


def _extra_requirements(extra: str) -> set[str]:
    """The distribution names an extra of pyproject.toml brings, its own `xbn[...]` references followed."""
    import re
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names: set[str] = set()
    for requirement in extras[extra]:
        inner = re.fullmatch(r"xbn\[(.+)\]", requirement)
        if inner:
            for other in inner.group(1).split(","):
                names |= _extra_requirements(other.strip())
        else:
            names.add(re.split(r"[<>=!;\[ ]", requirement, 1)[0].lower().replace("_", "-"))
    return names


def test_no_extra_brings_both_faiss_packages_and_make_runs_lock_pins_all():
    # faiss-cpu and faiss-gpu install the same `faiss` module: the pipeline comes with one or the other.
    assert "faiss-cpu" in _extra_requirements("pipeline") and "faiss-gpu" in _extra_requirements("gpu")
    for extra in ("pipeline", "gpu", "serve", "dask", "all"):
        assert not {"faiss-cpu", "faiss-gpu"} <= _extra_requirements(extra), extra
    # `all` is what make run's lock installs: every package it names is pinned there.
    assert _extra_requirements("all") - _names(ROOT / "requirements/lock.txt") == set()


def _names(path: Path) -> set[str]:
    return {line.split("==")[0].lower().replace("_", "-") for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def test_make_run_installs_the_runtime_set_alone_and_make_test_adds_the_test_tools():
    runtime, dev = _names(ROOT / "requirements/lock.txt"), _names(ROOT / "requirements/lock-dev.txt")
    assert not runtime & dev
    tools = {"pytest", "pytest-xdist", "hypothesis", "selenium", "scikit-image", "ruff", "mypy"}
    assert tools <= dev and not tools & runtime
    makefile = (ROOT / "Makefile").read_text()
    assert "\nrun: install\n" in makefile and "\ntest: install-dev\n" in makefile


# Top-level modules that only requirements/lock-dev.txt installs.
DEV_MODULES = ("pytest", "_pytest", "xdist", "execnet", "hypothesis", "selenium", "skimage", "imageio", "tifffile",
               "trio", "trio_websocket", "outcome", "wsproto", "socks", "websocket", "lazy_loader", "iniconfig",
               "mypy", "mypyc", "mypy_extensions", "librt", "ast_serialize")


def test_every_xbn_module_imports_without_the_test_tools():
    # Each module of the package, imported with the dev-only modules made unimportable: a runtime import of a
    # test tool would break `make run`'s environment, which does not have them.
    # (A None in sys.modules makes `import name` fail and importlib.util.find_spec answer None, as when the
    # package is absent: torch probes for hypothesis that way.)
    code = f"""
import importlib, pkgutil, sys
sys.modules.update(dict.fromkeys({DEV_MODULES!r}))
import xbn
for module in pkgutil.walk_packages(xbn.__path__, "xbn."):
    importlib.import_module(module.name)
print("imported")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr[-3000:]
