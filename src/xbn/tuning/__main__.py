"""`python -m xbn.tuning`: the `tune` stage from the command line, as `xbn tune` runs it. It is also what the
coordinator starts for each worker (`--worker`), and what another machine runs to join a study."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from xbn.config import ConfigError, load_params
from xbn.data import DatasetError


def _positive_int(text: str) -> int:
    if (value := int(text)) < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m xbn.tuning", description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("-q", "--quiet", action="store_true", help="as in xbn (trials show no bars anyway)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--workers", type=_positive_int, default=1, metavar="N",
                      help="worker processes on this machine")
    mode.add_argument("--worker", action="store_true", help="only run trials of the study (no outputs)")
    parser.add_argument("--apply", action="store_true", help="merge the best values into the --params file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.apply and args.worker:
        print("xbn tune: --apply needs the coordinator, not --worker", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from xbn.stages.tune import tune

    try:
        params = load_params(args.params, args.overrides)
        result = tune(params, workers=args.workers, worker=args.worker,
                      apply_to=args.params if args.apply else None)
    except ConfigError as exc:
        print(f"xbn tune: {exc}", file=sys.stderr)
        return 2
    except (DatasetError, FileNotFoundError) as exc:
        print(f"xbn tune: {exc}", file=sys.stderr)
        return 3
    print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
