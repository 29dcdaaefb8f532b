"""A stage that fails leaves nothing a later stage could take for its result, and `xbn run` stops where
`dvc repro` would: bad data never reaches training."""

from __future__ import annotations

from pathlib import Path

from xbn.cli import EXIT_DATA, main


def test_a_failed_prepare_removes_the_previous_manifest_so_validate_fails(params_file, tmp_path, capsys):
    good = str(params_file())
    assert main(["prepare", "--params", good, "-q"]) == 0
    manifest = Path("data/manifest.csv")
    assert manifest.exists()
    # The dataset moves (or its label file breaks): prepare fails, and the old manifest must not survive it.
    bad = str(params_file("data.dataset=folder", f"data.root={tmp_path / 'moved'}", name="bad.yaml"))
    assert main(["prepare", "--params", bad, "-q"]) == EXIT_DATA
    assert not manifest.exists()
    capsys.readouterr()
    assert main(["validate", "--params", bad, "-q"]) == EXIT_DATA
    assert "manifest_readable" in capsys.readouterr().err
    assert "data/manifest.csv" in Path("reports/validation.md").read_text()


def test_xbn_run_validates_like_dvc_repro_and_stops_on_a_failure(params_file, capsys):
    # Every tiny glyph is 32 px: a 1000 px minimum fails validation after prepare succeeded.
    params = str(params_file("validate.min_image_side=1000"))
    assert main(["run", "--params", params, "-q"]) == EXIT_DATA
    err = capsys.readouterr().err
    # The first bad files are named on the console, not only in the report.
    assert ("xbn run: data validation failed: image_width_in_bounds (96 rows: row 0 images/0000/0.png (32), "
            "row 1 images/0000/1.png (32), row 2 images/0000/2.png (32), ...)") in err, err
    assert Path("reports/validation.json").exists()
    assert not Path("models").exists() and not Path("metrics").exists()  # training never started


def test_generate_into_a_folder_that_is_not_a_glyph_set_is_a_data_error(params_file, tmp_path, capsys):
    other = tmp_path / "photos"
    other.mkdir()
    (other / "holiday.jpg").write_bytes(b"not ours")
    for stage in ("generate", "prepare"):  # prepare generates the default glyph set too
        params = str(params_file(f"data.root={other}"))
        assert main([stage, "--params", params, "-q"]) == EXIT_DATA
        err = capsys.readouterr().err
        assert f"xbn {stage}: {other} exists and is not a glyph set" in err and "Traceback" not in err
        assert (other / "holiday.jpg").read_bytes() == b"not ours"  # left as it was
