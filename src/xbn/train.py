"""The train stage as a module, for data-parallel runs:

    torchrun --nproc_per_node N -m xbn.train [--params FILE] [--set key=value ...] [--resume] [--quiet]

(`xbn train --nproc N` runs exactly this through torchrun.) Under torchrun (WORLD_SIZE > 1) each process joins
the process group (NCCL on CUDA, each process on the GPU its LOCAL_RANK names; gloo on the CPU), trains its
slice of every global batch and leaves the group at the end. Rank 0 alone tracks the run in MLflow, writes the
checkpoints and metrics, and prints the summary. Without torchrun it is a plain single-process `xbn train`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from xbn import distributed
from xbn.config import ConfigError, Params, load_params
from xbn.utils.errors import ServiceUnavailableError
from xbn.utils.logs import configure_logging

EXIT_CONFIG, EXIT_DATA = 2, 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m xbn.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a param, e.g. --set memory.method=xbn (repeatable)")
    parser.add_argument("--resume", action="store_true", help="continue from models/last.pt")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar, no summary on the console")
    parser.add_argument("-v", "--verbose", action="store_true", help="every library's log lines too")
    return parser


def run(params: Params, resume: bool = False, progress: bool = True,
        params_file: str = "params.yaml") -> dict:
    """Train in this process: the tracked stage on rank 0, the bare loop (whose collectives pair with rank
    0's) on the others."""
    if distributed.is_main():
        from xbn.stages.train import train

        return train(params, resume=resume, progress=progress, params_file=params_file)
    from xbn.training.trainer import train as fit

    return fit(params, resume=resume, progress=False)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank = os.environ.get("RANK", "0")  # torchrun's; the group does not exist yet
    main_rank = rank == "0"
    configure_logging(verbose=args.verbose, prefix=f"xbn train [rank {rank}]: ",
                      level=logging.INFO if main_rank else logging.WARNING)
    try:
        params = load_params(args.params, args.overrides)
    except ConfigError as exc:
        print(f"xbn.train: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    from xbn.data import DatasetError
    from xbn.training.trainer import resolve_device

    try:
        with distributed.process_group(resolve_device(params.train.device).type):
            summary = run(params, resume=args.resume, progress=not args.quiet, params_file=args.params)
    except ConfigError as exc:  # e.g. --resume of a checkpoint trained with other params
        print(f"xbn.train: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except (DatasetError, FileNotFoundError) as exc:
        print(f"xbn.train: {exc}", file=sys.stderr)
        return EXIT_DATA
    except ServiceUnavailableError as exc:
        print(f"xbn.train: {exc}", file=sys.stderr)
        return 4
    if main_rank and not args.quiet:
        print(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
