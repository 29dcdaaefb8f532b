"""Promote last (issue 40 item 1): a version becomes champion only once its index is attached and verified, so
the champion always serves; until then the old champion serves and the new one is the challenger, tagged
`registration: awaiting_index`. The kills (`xbn register` and `xbn index` SIGKILLed at their fault points, the
champion searched meanwhile) are in test_interrupted_registration.py."""

from __future__ import annotations


import pytest

from xbn.stages.index import index, index_version
from xbn.stages.register import complete_interrupted, promote, register, rollback
from xbn.utils.errors import RegistryError

from .helpers import next_model, run_pipeline, state


def test_the_gates_promotion_takes_effect_once_the_index_is_attached(served):
    report = run_pipeline(served, seed=0, blind=True)  # the first model: promoted by the gate
    assert report["decision"] == "promoted" and report["registration"] == "awaiting_index"
    before = state(served)
    assert before["champion"] is None and before["challenger"] == 1 and before["history"] == []
    attached = index(served)
    assert attached["version"] == 1 and attached["champion"] is True
    after = state(served)
    assert after["champion"] == 1 and after["challenger"] is None and after["history"] == [("gate", None, 1)]
    assert after["versions"][1]["registration"] == "done" and after["descriptions"][1]

    next_model(served, seed=1)  # a seeing model: promoted over the blind v1, but v1 serves until v2 is indexed
    assert register(served)["registration"] == "awaiting_index"
    assert state(served)["champion"] == 1
    index(served)
    after = state(served)
    assert after["champion"] == 2 and after["history"] == [("gate", None, 1), ("gate", 1, 2)]
    assert after["versions"][2]["previous_champion"] == "1" and after["versions"][2]["registration"] == "done"


def test_a_rejected_version_is_done_at_once_and_an_index_does_not_promote_it(served):
    run_pipeline(served, seed=0)
    index(served)
    report = run_pipeline(served, seed=3)  # as good as v1: rejected
    assert report["decision"] == "rejected" and report["registration"] == "done"
    assert "champion" not in index(served)  # attached to v2, which stays the challenger
    assert state(served)["champion"] == 1 and state(served)["challenger"] == 2


def test_a_person_cannot_promote_or_roll_back_to_a_version_that_could_not_serve(served):
    run_pipeline(served, seed=0, blind=True)
    index(served)
    run_pipeline(served, seed=3, blind=True)  # v2: rejected, no index
    with pytest.raises(RegistryError, match=r"v2 has no index attached.*xbn index --model-version 2"):
        promote(served, 2, "I prefer it", user="alice")
    assert state(served)["champion"] == 1 and len(state(served)["history"]) == 1  # refused before any write
    index_version(served, 2)
    promote(served, 2, "I prefer it", user="alice")
    assert state(served)["champion"] == 2
    rollback(served, "back", user="alice")  # v1 has its index: allowed
    assert state(served)["champion"] == 1


def test_an_interrupted_promotion_without_its_index_stays_waiting_until_indexed(served):
    run_pipeline(served, seed=0, blind=True)
    index(served)
    next_model(served, seed=1)
    register(served)  # killed before its index, as far as the registry can tell
    next_model(served, seed=7)
    reports = complete_interrupted(served)
    assert [(r["version"], r["registration"]) for r in reports] == [(2, "awaiting_index")]
    assert state(served)["champion"] == 1  # the old champion serves meanwhile
    index_version(served, 2)  # what the retrain flow does with it (its own checkpoint, not models/model.pt)
    assert state(served)["champion"] == 2 and complete_interrupted(served) == []


def test_promote_and_rollback_check_every_file_a_new_server_would_load(served, tmp_path):
    """index.json intact but a file it names altered in the artifact store, or the checkpoint altered: a new
    server could not load it, so it is refused before any write (the old check read index.json only)."""
    from xbn.tracking import Registry, file_digest

    run_pipeline(served, seed=0, blind=True)
    index(served)
    run_pipeline(served, seed=3, blind=True)  # v2, rejected
    index_version(served, 2)
    v2 = Registry(served).get(2)
    stored = [p for p in (tmp_path / "mlruns").rglob("ids.parquet") if v2.tags["index_sha256"] in str(p)]
    assert len(stored) == 1, stored
    original = stored[0].read_bytes()
    stored[0].write_bytes(original + b"\0")
    with pytest.raises(RegistryError, match=r"v2 has an index that fails its sha256 .*ids.parquet"):
        promote(served, 2, "I prefer it", user="alice")
    stored[0].write_bytes(original)
    checkpoint = [p for p in (tmp_path / "mlruns").rglob("model.pt") if file_digest(p) == v2.tags["model_sha256"]]
    data = bytearray(checkpoint[0].read_bytes())
    data[len(data) // 2] ^= 0xFF
    checkpoint[0].write_bytes(bytes(data))
    with pytest.raises(RegistryError, match=r"v2 has a checkpoint that fails its sha256"):
        promote(served, 2, "I prefer it", user="alice")
    assert state(served)["champion"] == 1 and len(state(served)["history"]) == 1
