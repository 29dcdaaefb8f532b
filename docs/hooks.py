"""The command-line reference, docs/cli.md, is every command's `--help` as xbn's own argument parser prints it.

`python docs/hooks.py` rewrites it. It is committed, so that it reads on GitHub too, and it cannot fall behind the
code: as a mkdocs hook (mkdocs.yml `hooks:`) this module fails the site's build when the file differs from what
the parser prints, and tests/console/test_docs_site.py fails the suite."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

CLI_PAGE = Path(__file__).with_name("cli.md")
WIDTH = 110  # argparse wraps to $COLUMNS: one width, whatever terminal builds the page


def _commands(parser: argparse.ArgumentParser, path: str):
    """(`xbn registry promote`, its parser) for every command and action, depth first, in the parser's order."""
    yield path, parser
    for action in parser._actions:  # argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, f"{path} {name}")


def cli_reference() -> str:
    from xbn.cli import build_parser

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)
    try:
        parts = ["# Command line\n", "Every command's `--help`, as `xbn` prints it (`python docs/hooks.py` "
                 "writes this page from the parser).\n"]
        for path, parser in _commands(build_parser(), "xbn"):
            parser.prog = path
            parts += [f"## `{path}`\n", "```text", parser.format_help().rstrip(), "```\n"]
    finally:
        if columns is None:
            os.environ.pop("COLUMNS")
        else:
            os.environ["COLUMNS"] = columns
    return "\n".join(parts)


def on_pre_build(config) -> None:
    from mkdocs.exceptions import PluginError

    if not CLI_PAGE.exists() or CLI_PAGE.read_text() != cli_reference():
        raise PluginError(f"{CLI_PAGE} does not match the parser: run `python docs/hooks.py` and commit it")


if __name__ == "__main__":
    CLI_PAGE.write_text(cli_reference())
    print(f"wrote {CLI_PAGE}")
