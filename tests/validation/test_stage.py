"""The `validate` stage: reports written on pass and on failure; a failure raises `ValidationFailed`."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from xbn.config import Params
from xbn.data import DatasetError, write_manifest
from xbn.stages.validate import validate
from xbn.validation import ValidationFailed

from .builders import build_dataset


@pytest.fixture
def params(tmp_path):
    root = tmp_path / "root"
    write_manifest(build_dataset(root), tmp_path / "manifest.csv")
    return Params.model_validate({
        "data": {"dataset": "csv", "root": str(root), "manifest": str(tmp_path / "manifest.csv")},
        "validate": {"report": str(tmp_path / "reports/validation.json"),
                     "report_text": str(tmp_path / "reports/validation.md")},
    })


def reports(params):
    with open(params.validate.report) as fh:
        data = json.load(fh)
    with open(params.validate.report_text) as fh:
        return data, fh.read()


def test_pass_writes_both_reports(params):
    summary = validate(params)
    assert summary["success"] and summary["rows"] == 10 and summary["failed"] == []
    data, text = reports(params)
    assert data["success"] and text.startswith("# Data validation: PASSED")


def test_failure_raises_and_names_the_expectation(params):
    Path(params.data.root, "images/eel/0.png").unlink()
    with pytest.raises(ValidationFailed) as info:
        validate(params)
    assert isinstance(info.value, DatasetError) and not info.value.result.success
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)
    assert "file_exists (1 row: row 8 images/eel/0.png" in str(info.value)
    assert params.validate.report_text in str(info.value)
    data, text = reports(params)
    assert not data["success"] and data["summary"]["failed"] == ["file_exists"]
    [outcome] = [e for e in data["expectations"] if e["name"] == "file_exists"]
    assert outcome["examples"][0] | {"detail": None} == {"row": 8, "path": "images/eel/0.png", "label": "eel",
                                                        "split": "test", "detail": None}
    assert "| 8 | images/eel/0.png | eel | test |" in text


@pytest.mark.parametrize("content, message", [
    ("file,class,split\nimages/ant/0.png,ant,train\n", "lacks column(s) ['path', 'label']"),
    ("path,label,split\n../escape.png,ant,train\n", "contains '..'"),
    ("path,label,split\nimages/ant/0.png,,train\n", "empty 'label'"),
])
def test_unreadable_manifest_is_a_failed_expectation(params, content, message):
    with open(params.data.manifest, "w") as fh:
        fh.write(content)
    with pytest.raises(ValidationFailed, match="manifest_readable"):
        validate(params)
    data, text = reports(params)
    [outcome] = data["expectations"]
    assert outcome["name"] == "manifest_readable" and message in outcome["message"]
    assert message in text
