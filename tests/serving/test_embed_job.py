"""The batch embedding job: parquet output, resume after an interruption, unreadable files named."""

from __future__ import annotations

import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from xbn.serving.embed_job import embed_to_parquet, read_embeddings, work_dir
from xbn.serving.sources import read_source


class Interrupted(Exception):
    pass


def stop_after(chunks: int):
    def on_chunk(done, total):
        if done == chunks:
            raise Interrupted

    return on_chunk


def test_csv_to_parquet(served, image_root, tmp_path):
    out = tmp_path / "emb.parquet"
    report = embed_to_parquet(
        served, image_root / "manifest.csv", out, chunk_size=7, batch_size=4, progress=False
    )
    table = pq.read_table(out)
    assert table.column_names == ["path", "label", "embedding"]
    assert table.schema.field("embedding").type == pa.list_(pa.float32())
    frame, emb = read_embeddings(out)
    assert report.rows == len(frame) == 24 and emb.shape == (24, 16)
    assert frame["label"].tolist()[:4] == ["class0"] * 4
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    # The same numbers as embedding the rows in one go.
    rows, root = read_source(image_root / "manifest.csv")
    np.testing.assert_allclose(emb, served.embed_frame(rows, root).embeddings, atol=1e-5)
    assert not work_dir(out).exists()


def test_folder_has_no_label_column(served, image_root, tmp_path):
    out = tmp_path / "emb.parquet"
    embed_to_parquet(served, image_root, out, progress=False)
    frame, _ = read_embeddings(out)
    assert frame.columns.tolist() == ["path"] and len(frame) == 24 and frame["path"][0] == "class0/img0.png"


def test_resume_after_interruption_gives_the_same_file(served, image_root, tmp_path):
    whole = tmp_path / "whole.parquet"
    embed_to_parquet(served, image_root / "manifest.csv", whole, chunk_size=5, progress=False)

    out = tmp_path / "resumed.parquet"
    with pytest.raises(Interrupted):
        embed_to_parquet(
            served, image_root / "manifest.csv", out, chunk_size=5, progress=False, on_chunk=stop_after(3)
        )
    assert not out.exists()  # no partial output
    assert len(list(work_dir(out).glob("chunk-*.parquet"))) == 3
    embedded = []
    report = embed_to_parquet(
        served,
        image_root / "manifest.csv",
        out,
        chunk_size=5,
        progress=False,
        on_chunk=lambda done, total: embedded.append(done),
    )
    assert report.chunks_resumed == 3 and embedded == [4, 5]  # only the missing chunks ran
    assert pq.read_table(out).equals(pq.read_table(whole))
    assert pq.read_table(out).schema.metadata == pq.read_table(whole).schema.metadata


def test_chunks_of_another_plan_are_discarded(served, other_model_path, image_root, tmp_path):
    from xbn.serving.model import load_served_model

    out = tmp_path / "emb.parquet"
    other = load_served_model(other_model_path, 32)
    with pytest.raises(Interrupted):
        embed_to_parquet(
            other, image_root / "manifest.csv", out, chunk_size=5, progress=False, on_chunk=stop_after(2)
        )
    embed_to_parquet(served, image_root / "manifest.csv", out, chunk_size=5, progress=False)
    _, emb = read_embeddings(out)
    rows, root = read_source(image_root / "manifest.csv")
    np.testing.assert_allclose(emb, served.embed_frame(rows, root).embeddings, atol=1e-5)


def test_unreadable_files_are_reported_by_name(served, image_root, broken_image, tmp_path):
    folder = tmp_path / "imgs"
    shutil.copytree(image_root / "class1", folder / "class1")
    shutil.copy(broken_image, folder / "broken.png")
    out = tmp_path / "emb.parquet"
    report = embed_to_parquet(served, folder, out, progress=False)
    assert report.skipped == ["broken.png"] and report.rows == 4
    assert b"broken.png" in pq.read_table(out).schema.metadata[b"xbn.skipped"]


def test_a_folder_of_only_unreadable_images_embeds_nothing_without_crashing(served, broken_image, tmp_path):
    # Issue 41: every image skipped left `embed` with no chunk to concatenate (torch.cat of nothing).
    folder = tmp_path / "imgs"
    folder.mkdir()
    shutil.copy(broken_image, folder / "broken.png")
    report = embed_to_parquet(served, folder, tmp_path / "emb.parquet", progress=False)
    assert report.rows == 0 and report.skipped == ["broken.png"]
    frame, emb = read_embeddings(tmp_path / "emb.parquet")
    assert frame.empty and not work_dir(tmp_path / "emb.parquet").exists()


@pytest.mark.parametrize("values, named", [([1, 2], "int 1"), ([b"a.png", b"b.png"], "bytes b'a.png'"),
                                           (["a.png", None], "row 2: 'path' must be a string")])
def test_a_parquet_path_column_of_non_strings_is_refused_by_row(tmp_path, values, named):
    # Issue 41: str() turned them into "1", "b'a.png'" and "nan" silently.
    from xbn.data import DatasetError

    pq.write_table(pa.table({"path": pa.array(values)}), tmp_path / "rows.parquet")
    with pytest.raises(DatasetError, match=named.replace("(", r"\(")):
        read_source(tmp_path / "rows.parquet")


def test_a_nul_byte_in_a_listed_path_is_refused_by_row(tmp_path):
    from xbn.data import DatasetError

    pq.write_table(pa.table({"path": ["ok.png", "bad\0.png"]}), tmp_path / "rows.parquet")
    with pytest.raises(DatasetError, match="line 2: .*control character"):
        read_source(tmp_path / "rows.parquet")


def test_an_s3_source_without_s3fs_is_a_config_error(monkeypatch):
    import builtins

    from xbn.config import ConfigError

    real_import = builtins.__import__

    def no_s3fs(name, *args, **kwargs):  # whether or not s3fs is installed here, as on a machine without it
        if name == "s3fs" or name.startswith("s3fs."):
            raise ImportError("No module named 's3fs'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_s3fs)
    with pytest.raises(ConfigError, match="s3://bucket/rows.parquet"):
        read_source("s3://bucket/rows.parquet")


def test_a_remote_catalogues_rows_outside_it_are_neither_fetched_nor_written(tmp_path, caplog):
    """A remote catalogue (fsspec's memory filesystem, as s3:// would be) whose rows name '../x' or '/x': those
    keys are not read from outside the catalogue's prefix, and nothing is written outside the temp folder."""
    import logging
    from pathlib import Path

    import fsspec
    import pandas as pd

    from xbn.serving.sources import local_images

    fs = fsspec.filesystem("memory")
    # Object stores do not normalise keys: a key may literally hold "..", as this one does.
    fs.pipe({"/shop/catalogue/a.png": b"inside", "/shop/catalogue/../escaped.png": b"x",
             "/shop/secret.png": b"outside the prefix"})
    rows = pd.DataFrame({"path": ["a.png", "../escaped.png", "/shop/secret.png"]})
    with caplog.at_level(logging.WARNING), local_images(rows, "memory://shop/catalogue") as folder:
        found = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
        parent = folder.parent
    assert found == ["a.png"] and "2 row(s) name a path outside it" in caplog.text
    assert not (parent / "escaped.png").exists() and not Path("/shop/secret.png").exists()
