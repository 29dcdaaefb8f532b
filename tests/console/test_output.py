"""What a person sees on the console: xbn's own lines, no library INFO noise unless -v, no JSON under -q, and a
summary generated from the files the stages wrote."""

import json
import logging
import re
import sys
from pathlib import Path

import pytest

from xbn.config import load_params
from xbn.stages.summary import summary_markdown, summary_text
from xbn.utils.logs import configure_logging

from tests_support import ROOT


@pytest.fixture(autouse=True)
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.getLogger("xbn").setLevel(logging.NOTSET)


def emit_all():
    library = logging.getLogger("great_expectations.data_context.types.base")
    library.setLevel(logging.INFO)  # as great-expectations does on import
    library.info("Created temporary directory for ephemeral docs site")
    logging.getLogger("faiss.loader").info("Loading faiss with AVX512 support.")
    logging.getLogger("xbn.stages.evaluate").info("R@1 0.5000 -> metrics/eval.json")
    logging.getLogger("faiss.loader").warning("a library warning")


def test_library_info_stays_out_and_xbn_lines_read_as_sentences(capsys):
    configure_logging(prefix="xbn evaluate: ")
    emit_all()
    err = capsys.readouterr().err.splitlines()
    assert err == ["xbn evaluate: R@1 0.5000 -> metrics/eval.json",
                   "xbn evaluate: WARNING faiss.loader: a library warning"]


def test_the_console_follows_sys_stderr_when_it_is_replaced(monkeypatch):
    """A stream replaced after configure_logging (here, as pytest's capture of an earlier test, closed since) is
    not written to: the line goes to the sys.stderr of the moment, with no "--- Logging error ---"."""
    import io

    earlier, now = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", earlier)
    configure_logging()
    earlier.close()
    monkeypatch.setattr(sys, "stderr", now)
    logging.getLogger("xbn.stages.evaluate").info("R@1 0.5000 -> metrics/eval.json")
    assert now.getvalue() == "R@1 0.5000 -> metrics/eval.json\n"


def test_verbose_brings_every_library_line_back(capsys):
    configure_logging(verbose=True)
    emit_all()
    err = capsys.readouterr().err
    assert "INFO great_expectations.data_context.types.base: Created temporary" in err
    assert "INFO faiss.loader: Loading faiss" in err and "INFO xbn.stages.evaluate: R@1" in err


def test_quiet_keeps_the_result_in_its_file_not_on_the_console(tmp_path, monkeypatch, capsys):
    from xbn.cli import main

    monkeypatch.chdir(tmp_path)
    tiny = ["--params", "none", "--set", "data.glyphs.classes=4", "--set", "data.glyphs.images_per_class=2",
            "--set", "data.glyphs.image_size=16"]
    (tmp_path / "none").write_text("{}\n")
    assert main(["generate", "-q", *tiny]) == 0
    out = capsys.readouterr()
    assert out.out == "" and "4 glyph classes x 2 images, 16 px -> data/glyphs" in out.err
    assert main(["generate", *tiny]) == 0
    assert json.loads(capsys.readouterr().out)["classes"] == 4
    assert main(["generate", "-q", "--json", *tiny]) == 0  # --json asks for it: printed, -q or not
    assert json.loads(capsys.readouterr().out)["classes"] == 4


def write(path: str, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data))


def test_summary_says_what_the_stage_files_hold(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    params = load_params(None, ["memory.method=xbn"])
    text = summary_text(params)
    assert "not evaluated (metrics/eval.json missing)" in text and "not registered" in text

    write("reports/validation.json", {"success": True, "summary": {"splits": {
        "train": {"classes": 255, "images": 1530}, "test": {"classes": 300, "images": 1800}}}})
    write("metrics/train.json", {"epochs": 14, "iterations": 336, "best_epoch": 12, "best_val_recall@1": 0.91,
                                 "memory_rows": 1530, "train_seconds": 240.0})
    write("metrics/eval.json", {"recall@1": 0.6761, "map@r": 0.4104,
                                "untrained": {"recall@1": 0.3031, "map@r": 0.1433}})
    write("reports/registry.json", {"version": 3, "decision": "rejected", "reason": "within noise",
                                    "champion_version": 2})
    lines = summary_text(params).splitlines()
    assert len(lines) <= 12
    text = "\n".join(lines)
    assert "train 255 classes / 1530 images, test 300 classes / 1800 images); validation passed" in text
    assert "xbn, 1530 rows" in text and "best epoch 12 (val R@1 0.9100), 240 s" in text
    assert "R@1 0.6761  MAP@R 0.4104  (untrained: R@1 0.3031  MAP@R 0.1433)" in text
    assert "v3 rejected: within noise (champion: v2)" in text
    assert "mlflow ui --backend-store-uri sqlite:///mlflow.db" in text
    assert "| registry | v3 rejected: within noise (champion: v2) |" in summary_markdown(params)


def test_the_summary_artifact_names_the_tracking_server_without_its_password(tmp_path, monkeypatch):
    # Issue 41: the retrain flow's summary is a Prefect artifact; the tracking URI was printed as given.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://xbn:p@ss/w0rd@mlflow.example.com")
    text = summary_markdown(load_params(None, []))
    assert "https://xbn:***@mlflow.example.com" in text and "w0rd" not in text


def test_one_name_for_a_model_version_and_the_old_one_still_works(capsys):
    from xbn import __version__
    from xbn.cli import build_parser

    parser = build_parser()
    new = parser.parse_args(["registry", "promote", "--model-version", "3", "--reason", "r"])
    assert new.model_version == 3 and "deprecated" not in capsys.readouterr().err
    old = parser.parse_args(["data", "restore", "--version", "2", "--to", "x"])
    assert old.model_version == 2
    assert "--version V is deprecated: use --model-version V" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == f"xbn {__version__}"


def _read_only_folder() -> Path:
    """A folder that even root cannot write in: sysfs (chmod does not stop root, so a tmp folder cannot serve)."""
    probe = Path("/sys/xbn-write-probe")
    try:
        probe.write_text("")
    except OSError:
        return Path("/sys")
    probe.unlink()
    pytest.skip("/sys is writable here: no read-only folder to run in")


def test_init_and_run_in_a_read_only_folder_say_so_in_one_line(monkeypatch, capsys, tmp_path):
    """Issue 41 item 5: `xbn init` and `xbn run` where nothing can be written: one line naming the file, a
    non-zero exit, no traceback."""
    from xbn.cli import main

    params = tmp_path / "params.yaml"
    params.write_text(Path(__file__).parents[2].joinpath("params.yaml").read_text())
    monkeypatch.chdir(_read_only_folder())
    assert main(["init", "--dataset", "glyphs", "--root", "data/glyphs"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("xbn init: cannot write here:") and "params.yaml" in err[0], err
    assert main(["run", "--params", str(params), "-q", "--set", "tracking.enabled=false"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("xbn run: ") and "'reports' (in /sys: a folder" in err[0], err


def test_json_prints_the_structured_result_of_a_command_that_prints_text(tiny_params, glyph_root, capsys):
    from xbn.cli import main

    tiny_params()  # chdir to a tmp folder
    Path("params.yaml").write_text((ROOT / "params.yaml").read_text())
    args = ["--params", "params.yaml", "--set", f"data.root={glyph_root}", "--set", "tracking.enabled=false"]
    assert main(["summary", *args]) == 0
    text = capsys.readouterr().out
    assert text.startswith("xbn: summary")
    assert main(["summary", *args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["summary"]
    assert [r["what"] for r in rows][:1] == ["data"] and all(r["value"] in text for r in rows)
    # Issue 55 item 5: -q and --json mean what they mean for every other command.
    assert main(["summary", *args, "-q"]) == 0 and capsys.readouterr().out == ""
    assert main(["summary", *args, "-q", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"] == rows


def test_the_help_lists_every_command_once_under_its_group_and_says_the_exit_codes(capsys):
    from xbn.cli import COMMAND_GROUPS, build_parser, main

    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices
    grouped = [name for _, names in COMMAND_GROUPS for name in names]
    assert sorted(grouped) == sorted(commands)  # none missing from the help, none listed twice
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    headings = [line.strip() for line in text.splitlines() if re.fullmatch(r"  [a-z]+:", line)]
    assert headings == [f"{group}:" for group, _ in COMMAND_GROUPS]
    assert all(f"    {name}" in text for name in grouped) and "exit codes: 0 done" in text
