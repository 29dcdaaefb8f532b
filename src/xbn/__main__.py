"""`xbn` and `python -m xbn`: the command line, which needs the pipeline's packages (the `pipeline` or `gpu`
extra); without them, one line says what to install instead of a traceback."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    try:
        from xbn.cli import main as cli_main
    except ModuleNotFoundError as exc:
        if (exc.name or "xbn").split(".")[0] == "xbn":  # a module of xbn itself: a broken install, not an extra
            raise
        print(f"xbn: the command line needs the pipeline's packages ({exc.name} is missing): pip install "
              f"'xbn[all]' (or 'xbn[gpu,serve,dask]' on a CUDA machine); `import xbn.memory` needs none of them",
              file=sys.stderr)
        return 2
    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
