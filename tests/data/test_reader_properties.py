"""Property tests of the label-file readers: whatever a label file holds, the reader returns a manifest or
raises a DatasetError (a ValueError) naming the file; never an IndexError, KeyError or decode error."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pandas as pd
from hypothesis import given, settings
from hypothesis import strategies as st

from xbn.data import DatasetError, read_dataset, read_manifest
from xbn.data.manifest import BOX_COLUMNS, COLUMNS, SPLITS

PROPERTY = settings(max_examples=60, deadline=None)

token = st.one_of(
    st.integers(-3, 300).map(str), st.sampled_from(SPLITS), st.sampled_from(["", " ", "a/b.png", "../x.png",
                                                                            "/abs.png", "C:\\x.png", "1.5"]),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=8),
)
header = st.lists(st.sampled_from([*COLUMNS, *BOX_COLUMNS, "extra", ""]), max_size=8)


@st.composite
def csv_text(draw) -> str:
    head = ",".join(draw(header))
    rows = draw(st.lists(st.lists(token, max_size=8).map(lambda r: ",".join(f'"{t}"' if "," in t else t
                                                                           for t in r)), max_size=6))
    return "\n".join([head, *rows]) + draw(st.sampled_from(["", "\n", "\r\n"]))


@st.composite
def whitespace_text(draw) -> str:
    rows = draw(st.lists(st.lists(token, max_size=5).map(" ".join), max_size=6))
    return "\n".join(rows)


contents = st.one_of(csv_text(), whitespace_text(), st.text(max_size=60).map(str.encode).map(bytes.decode),
                     st.binary(max_size=60))


def _write(path: Path, content: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass"))


@PROPERTY
@given(content=contents)
def test_manifest_csv_parses_or_names_the_file(content):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "labels.csv"
        _write(path, content)
        try:
            frame = read_manifest(path)
        except DatasetError as exc:
            assert str(path) in str(exc), exc
        else:
            assert isinstance(frame, pd.DataFrame) and list(frame.columns[:3]) == list(COLUMNS)
            assert not frame.empty and frame["split"].isin(SPLITS).all()


FILES = {
    "cub": ("images.txt", "image_class_labels.txt"),
    "sop": ("Ebay_train.txt", "Ebay_test.txt"),
    "inshop": ("Eval/list_eval_partition.txt",),
    "csv": ("labels.csv",),
}


@PROPERTY
@given(dataset=st.sampled_from(sorted(FILES)), data=st.data())
def test_benchmark_label_files_parse_or_name_the_file(dataset, data):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in FILES[dataset]:
            _write(root / name, data.draw(contents, label=name))
        try:
            frame = read_dataset(dataset, root)
        except DatasetError as exc:
            assert str(root) in str(exc), exc  # every reader names the file (under root) or the root
        else:
            assert not frame.empty and frame["split"].isin(SPLITS).all()
