"""`xbn init`: a params.yaml for one's own dataset, in the current folder, so that the rest is `xbn run`.

The shipped params.yaml, with its comments, is the template: the package carries it as data
(`xbn/templates/params.yaml`, a link to the project's own file in the checkout, a copy in a wheel). The
dataset's keys and any `--set` are written into it in place, and the file is loaded back through the schema
before it is kept.
"""

from __future__ import annotations

import re
from importlib.resources import files
from pathlib import Path

import yaml

from xbn.config import ConfigError, Params, apply_overrides, load_params
from xbn.utils.io import write_text

TEMPLATE = files("xbn") / "templates" / "params.yaml"
_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_./@-]+):(?P<sep> *)(?P<value>[^#\n]*?)(?P<comment> +#.*)?$")


def _template() -> str:
    if TEMPLATE.is_file():
        return TEMPLATE.read_text()
    # A package built without its data (it should not happen; the schema's defaults are the same values)
    return yaml.safe_dump(Params().model_dump(mode="json"), sort_keys=False, width=120)


def _scalar(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("...").strip()


def set_value(text: str, key: str, value) -> str | None:
    """`text` with the line of the dotted `key` holding `value` (its comment kept), or None when the template
    has no such line (a new entry of a free-form mapping)."""
    path: list[tuple[int, str]] = []
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        match = _LINE.match(line.rstrip("\n"))
        if not match:
            continue
        indent = len(match["indent"])
        while path and path[-1][0] >= indent:
            path.pop()
        path.append((indent, match["key"]))
        if ".".join(k for _, k in path) == key and not isinstance(value, dict):
            sep = match["sep"] or " "
            lines[i] = f"{match['indent']}{match['key']}:{sep}{_scalar(value)}{match['comment'] or ''}\n"
            return "".join(lines)
    return None


def init(dataset: str, root: str, overrides: list[str] | None = None, labels_file: str | None = None,
         force: bool = False, target: str | Path = "params.yaml") -> Path:
    """Write `target` for `dataset` at `root` (made absolute, so the file works from anywhere) with
    `overrides`; ConfigError (naming the file or key) when it exists (without `force`), the root is missing,
    or a value does not fit the schema."""
    target = Path(target)
    if target.exists() and not force:
        raise ConfigError(f"{target} already exists: edit it, or pass --force to replace it")
    if dataset != "glyphs" and not Path(root).exists():
        raise ConfigError(f"data.root: {root} does not exist")
    settings = [f"data.dataset={dataset}", f"data.root={Path(root).resolve() if dataset != 'glyphs' else root}",
                *([f"data.labels_file={Path(labels_file).resolve()}"] if labels_file else []), *(overrides or [])]
    if dataset != "glyphs":
        settings.append("validate.check_published_counts=false" if dataset in ("folder", "csv") else
                        "validate.check_published_counts=true")
    expected = load_params(None, settings)  # refuses an unknown key or a bad value, naming it
    text = _template()
    wanted = apply_overrides({}, settings)
    for key in _leaves(wanted):
        value = _get(expected.model_dump(mode="json"), key)
        edited = set_value(text, key, value)
        if edited is None:  # not a line of the template: fall back to plain YAML for the whole file
            raw = apply_overrides(yaml.safe_load(text) or {}, settings)
            text = yaml.safe_dump(raw, sort_keys=False, width=120)
            break
        text = edited
    header = f"# xbn params for the {dataset} dataset at {root} (`xbn init`); run the pipeline with `xbn run`.\n"
    write_text(target, header + text)
    written, want = load_params(target).model_dump(mode="json"), expected.model_dump(mode="json")
    if wrong := [k for k in _leaves(wanted) if _get(written, k) != _get(want, k)]:  # a template we misread
        target.unlink()
        raise ConfigError(f"{target}: could not write {', '.join(wrong)} into the template; nothing written")
    return target


def _leaves(tree: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        out += _leaves(value, name + ".") if isinstance(value, dict) and value else [name]
    return out


def _get(tree: dict, key: str):
    for part in key.split("."):
        tree = tree[part]
    return tree
