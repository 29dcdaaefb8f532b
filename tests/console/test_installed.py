"""xbn as a user installs it (issue 43): the wheel built from this checkout, in a virtual environment of its own,
run from a folder outside the checkout. `xbn --version` and `xbn init`'s commented template must come from the
installed package, never from the checkout (`fresh_environment`: the dependencies are this environment's)."""

import json
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

from tests_support import ROOT, fresh_environment


def test_the_built_wheel_runs_outside_the_checkout_with_its_own_template(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(ROOT)], check=True, capture_output=True, cwd=tmp_path)
    wheel = next(dist.glob("xbn-*.whl"))
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
