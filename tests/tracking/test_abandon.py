"""A bad version never stops the week (issue 54 item 2): an interrupted registration that cannot be completed
(its registered checkpoint fails its sha256) is abandoned by the next run's repair, held with the reason, and
that run goes on; a person can abandon one by hand. The champion's index that cannot be rebuilt is said, not
raised."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from xbn.cli import main
from xbn.config import Params
from xbn.stages.index import index
from xbn.stages.loop import RepairSteps, repair
from xbn.stages.register import abandon, register
from xbn.tracking import Registry, file_digest
from xbn.utils.errors import EXIT_FAILURE, RegistryError

from .helpers import next_model, run_pipeline, state


@pytest.fixture
def awaiting(served) -> Params:
    """v1 champion and indexed, v2 promoted by the gate and waiting for its index, as a run killed before its
    index stage leaves it (promote_with_index on, the shipped setting)."""
    run_pipeline(served, seed=0, blind=True)
    index(served)
    next_model(served, seed=1)
    assert register(served)["registration"] == "awaiting_index"
    return served


def _tamper_checkpoint(version_sha: str, root: Path) -> None:
    stored = [p for p in (root / "mlruns").rglob("model.pt") if p.is_file() and file_digest(p) == version_sha]
    assert len(stored) == 1, stored
    data = bytearray(stored[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    stored[0].write_bytes(bytes(data))


def test_a_tampered_awaiting_version_is_abandoned_and_the_week_goes_on(awaiting, tmp_path, monkeypatch):
    _tamper_checkpoint(Registry(awaiting).get(2).tags["model_sha256"], tmp_path)
    # As a deployed run: authenticated as the pipeline's account, which is not the gate (the fault suite found
    # the repair's abandon refused there, "--user gate is not the account you are authenticated as").
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "xbn-pipeline")
    next_model(awaiting, seed=7)  # next week's training on disk
    repaired = repair(awaiting)
    assert [r.title for r in repaired] == ["xbn: v2 registration abandoned"]
    assert "IntegrityError" in repaired[0].line and "the champion is unchanged and this run goes on" in \
        repaired[0].line
    after = state(awaiting)
    tags = after["versions"][2]
    assert tags["registration"] == "abandoned" and tags["decision"] == "held" and tags["decided_by"] == "gate"
    assert tags["reason"].startswith("abandoned: its interrupted registration could not be completed: "
                                     "IntegrityError")
    assert after["champion"] == 1 and after["history"] == [("gate", None, 1)]
    assert repair(awaiting) == []  # never tried again: the next week is not stopped by it either


def test_a_failing_step_is_retried_a_bounded_number_of_times_and_an_integrity_error_not_at_all(awaiting):
    calls = []

    def flaky(params, version):
        calls.append(version)
        raise OSError("the artifact store blinked")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("xbn.stages.loop.time.sleep", lambda s: None)
        mp.setattr("xbn.stages.loop.REPAIR_TRIES", 3)
        from xbn.stages import loop

        steps = RepairSteps(complete=loop._retried(flaky))
        repaired = repair(awaiting, steps)
    assert calls == [2, 2, 2] and repaired[0].title == "xbn: v2 registration abandoned"
    assert "OSError: the artifact store blinked" in repaired[0].line


def test_a_champion_index_that_cannot_be_rebuilt_is_said_and_the_run_goes_on(awaiting):
    def gone(params, version):
        raise FileNotFoundError("index.source: /data/catalogue is gone")

    abandon(awaiting, 2, "not this one", user="ops")
    steps = RepairSteps(check_index=lambda p: {"version": 1, "problem": "has lost its index"}, attach_index=gone)
    repaired = repair(awaiting, steps)
    assert [r.title for r in repaired] == ["xbn: champion v1 index not repaired"]
    assert "FileNotFoundError: index.source: /data/catalogue is gone" in repaired[0].line


def test_a_person_abandons_an_unfinished_registration_by_hand_and_nothing_else(awaiting, tmp_path, capsys):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(awaiting.model_dump(mode="json"), sort_keys=False))
    base = ["registry", "--params", str(path), "abandon", "--reason", "its data was wrong", "--user", "ops"]
    assert main([*base, "--model-version", "1"]) == EXIT_FAILURE  # the champion
    assert "v1 is the champion: roll back" in capsys.readouterr().err
    assert main([*base, "--model-version", "2"]) == 0
    assert state(awaiting)["versions"][2]["registration"] == "abandoned"
    with pytest.raises(RegistryError, match="registration is abandoned, not unfinished"):
        abandon(awaiting, 2, "again", user="ops")
