"""Stage `register` and the registry jobs behind `xbn registry review|promote|rollback`: the orchestration.
The promotion policy is in `promotion.py`, the model card and the review table in `model_card.py`.

`register` adds the trained model (the run's pyfunc) as a new version of `registry.model_name` with alias
`challenger`, and lets the promotion gate (`xbn.stages.promotion`) decide whether it becomes `champion`: the
challenger and the champion are both embedded on the validation split (`registry.gate_split`) of the current
data and compared query by query with a paired bootstrap; the first model is promoted, a challenger without a
`val` split to compare on is `held`, and otherwise it is `promoted` only if the interval's lower bound clears
`registry.min_improvement` and no guarded metric falls by more than `registry.tolerance`, else `rejected`.
The test split's metrics (`eval.output`) are recorded with the version for reporting only (they never decide a
promotion): as its logged model's metrics on dataset `test` (and the run's), in the model card and the review
table.
A version that becomes champion loses the `challenger` alias. Every move of `champion` (the gate's, a promote,
a rollback) is appended to the champion's history, a log in the registry itself (`xbn.tracking.history`), which
`rollback` walks and `review` shows; the version also records the champion it replaced as tag
`previous_champion`, for a reviewer scanning versions (never read to decide). Every decision is written as version tags (`decision`,
`decided_by`, `decided_at`, `reason`) and to `registry.report`; the gate's comparison as the tags
`<split>_<metric>` (the challenger's primary metric on the gate split) and `gate_interval` (the interval in
short), in full (JSON) on the logged model (tag `gate`) and in the model card.
The version tags are only what a reviewer scans across versions in the MLflow UI's versions table (see the
comment at `GATE_INTERVAL_TAG`); the rest is in the model card (the version's description) and on the logged
model.
All MLflow access goes through `xbn.tracking`.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import logging
import os
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from xbn.config import Params
from xbn.data.snapshot import current_record, diff_files, diff_line
from xbn.stages.model_card import gate_tags, history_lines, model_card, provenance_tags, review_table
from xbn.stages.promotion import (
    CHALLENGER,
    CHAMPION,
    GATE,
    Comparison,
    Decision,
    Gate,
    finish_logged_move,
    gate_settings,
    make_champion,
    rollback_target,
)
from xbn.tracking import (
    ModelVersionInfo,
    PipelineRun,
    Registry,
    data_hash,
    log_gate,
    log_model,
    params_hash,
    pipeline_run,
    scores_of,
    tracking_uri,
)
from xbn.tracking.history import append_history, read_history
from xbn.tracking.registry import PARENT_TAG, SERVED_TAG, SHA_TAG, log_refiner
from xbn.tracking.runs import DATA_MD5_TAG
from xbn.tracking.services import wait_reachable
from xbn.utils.errors import IntegrityError, RegistryError
from xbn.utils.faults import fault_point
from xbn.utils.integrity import verify_sidecar
from xbn.utils.io import write_json

log = logging.getLogger(__name__)
REVIEW_HISTORY = 10  # the newest champion-history entries `review` shows


def register(params: Params, tags: dict[str, str] | None = None) -> dict:
    """Register `models/model.pt` (tagged with the test metrics of `eval.output`, for reporting), apply the
    promotion gate on the validation split, write `registry.report`. `tags`: more version tags from the caller
    (the retrain flow's `request_hash`, which its next run compares with).

    Idempotent: a model whose sha256 is already registered is reported (with its recorded decision) and
    nothing is created or changed, unless its registration was interrupted: then it is completed (see
    `REGISTRATION_TAG`).
    """
    fault_point("register.start")
    cfg = params.registry
    checkpoint = Path(params.train.checkpoint_dir) / "model.pt"
    results_file = Path(params.eval.output)
    for path, stage in ((checkpoint, "train"), (results_file, "evaluate")):
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: run `xbn {stage}` first")
    results = json.loads(results_file.read_text())
    # Seed 001: when the refine stage serves refined queries, the gate judges (and the tags record) those.
    served = "refined" if (results.get("refined") or {}).get("served") else "plain"
    metrics = scores_of(results["refined"] if served == "refined" else results)
    if cfg.primary_metric not in metrics:
        raise ValueError(f"registry.primary_metric '{cfg.primary_metric}' is not in {results_file} "
                         f"(it has {', '.join(sorted(metrics))})")
    sha = verify_sidecar(checkpoint)  # the bytes training wrote, before they are registered
    trained, trained_hash = trained_params(params, checkpoint)  # the training run's own record, not this call's
    registry = _registry(params, wait_s=params.tracking.outage_s)
    if existing := registry.find_by_tag(SHA_TAG, sha):
        return _registered(params, registry, existing, trained)

    data = data_hash(params) or "unknown"
    lineage = {DATA_MD5_TAG: data_md5(params), **parent_tags(checkpoint), **(tags or {})}
    gate = Gate(params, checkpoint)
    with pipeline_run(params, "register") as run:
        # The slow parts outside the lock: logging the model, embedding the val split with both models.
        model_uri = log_model(params, run, checkpoint)
        if served == "refined":
            log_refiner(run, params.refine.output)
        gate.decide(registry.by_alias(CHAMPION), registry)
        # Read the champion, decide and move the aliases under the registry lock: a concurrent register or
        # promote may have changed the champion (or registered this very file) since the check above; the
        # gate then compares with the new champion (else its comparison above is reused).
        with registry.lock():
            if existing := registry.find_by_tag(SHA_TAG, sha):
                return _registered(params, registry, existing, trained, locked=True)
            champion = registry.by_alias(CHAMPION)
            decision = gate.decide(champion, registry)
            comparison = decision.comparison
            # The metrics and the comparison first, then the version with its decision: no version is ever
            # seen without them. Under the keys evaluate logged them to the run (refined: `refined/...`).
            registry.record(model_uri, run.run_id, metrics, params.eval.split, data,
                            prefix="refined/" if served == "refined" else "",
                            gate=comparison.as_dict() if comparison else None, settings=gate_settings(cfg))
            stamp = _stamp(decision.decision, decision.reason, GATE)
            tags = {"decision": stamp.pop("decision"), "decided_by": stamp.pop("decided_by"),
                    **gate_tags(comparison), "data_hash": data, **lineage, "params_hash": trained_hash,
                    **provenance_tags(trained), SHA_TAG: sha, SERVED_TAG: served, **stamp,
                    REGISTRATION_TAG: "created"}
            info = _first_of(registry, registry.create(model_uri, tags), sha)
            fault_point("register.after_create")
            log_gate(run, comparison, cfg.min_improvement)  # before the card, which links it
            info = _complete(params, registry, info, trained, run, decision, champion)
    return _write_report(params, registry, info, compared=champion)


# A registration is a sequence of writes (create, aliases, history, card); a process killed between two of them
# left a version tagged "promoted" that never served, which the next run then skipped as already registered.
# The version is created with `registration: created` (with its decision tags, in the same request) and tagged
# `done` only after the rest; a register that finds its model created but not done completes it, step by step,
# each step idempotent. Versions from before the tag count as done.
# Promote last (with registry.promote_with_index): a version the gate promoted becomes champion only once its
# index is attached and verified; until then it is the challenger, tagged `registration: awaiting_index`, and
# the old champion serves. The `index` stage completes it (`complete_awaiting_index`); a run killed before that
# is completed by the next one (`complete_interrupted`, after indexing it).
# A registration that cannot be completed (its checkpoint fails its sha256, its index cannot be built) is
# `abandoned` (held, with the reason), by the next run's repair or by hand (`xbn registry abandon`), so that it
# never stops a later week.
REGISTRATION_TAG = "registration"
AWAITING_INDEX = "awaiting_index"
ABANDONED = "abandoned"
UNFINISHED = ("created", AWAITING_INDEX)


def _registered(params: Params, registry: Registry, existing: ModelVersionInfo, trained: Params,
                locked: bool = False, write: bool = True) -> dict:
    """The report on a model already registered; an interrupted registration is completed first, never
    skipped (`locked`: the caller holds the registry lock; `write`: to `registry.report`)."""
    completed = False
    if existing.tags.get(REGISTRATION_TAG, "done") != "done":
        with contextlib.nullcontext() if locked else registry.lock():
            existing = registry.get(existing.version)  # another run may have completed it meanwhile
            state = existing.tags.get(REGISTRATION_TAG, "done")
            if state != "done":
                if state != AWAITING_INDEX:
                    log.warning("%s v%s: its registration was interrupted (%s=%s): completing it",
                                registry.name, existing.version, REGISTRATION_TAG, state)
                existing = _complete(params, registry, existing, trained)
                completed = existing.tags.get(REGISTRATION_TAG) == "done"
    report = _write_report(params, registry, existing, compared=None, already_registered=True, write=write)
    return {**report, "completed": True} if completed else report


def complete_interrupted(params: Params) -> list[dict]:
    """Every registration a killed run left unfinished (`registration: created` or `awaiting_index`), completed
    oldest first, as far as it can be: a promotion still waiting for its index stays so (its report says
    `registration: awaiting_index`; the caller indexes it, which completes it). The retrain flow runs this before
    its plan: next week's run finishes last week's registration, whatever it then trains (a new training has
    another sha256, so its own register would never find the old one)."""
    return [complete_version(params, version) for version in interrupted_versions(params)]


def finish_champion_move(params: Params) -> dict | None:
    """The champion history's last move, completed if a killed process logged it but never moved the alias
    (`finish_logged_move`); None when there was nothing to finish."""
    registry = _registry(params, wait_s=params.tracking.outage_s)
    with registry.lock():
        done = finish_logged_move(registry)
    return None if done is None else {"seq": done.seq, "action": done.action, "from_version": done.from_version,
                                      "to_version": done.to_version, "model_name": registry.name}


def interrupted_versions(params: Params) -> list[int]:
    """The versions whose registration a killed run left unfinished, oldest first."""
    registry = _registry(params, wait_s=params.tracking.outage_s)
    return sorted(int(v.version) for state in UNFINISHED for v in registry.client.search_model_versions(
        f"name = '{registry.name}' and tags.{REGISTRATION_TAG} = '{state}'"))


def complete_version(params: Params, version: int) -> dict:
    """`complete_interrupted` for one version (the loop's repair abandons the one that cannot be completed)."""
    registry = Registry(params)
    info = registry.get(version)
    return _registered(params, registry, info, _trained_of(params, registry, info, strict=True))


def abandon(params: Params, version: int | str, reason: str, user: str | None = None, *,
            by_gate: bool = False) -> dict:
    """Give up an unfinished registration that cannot be completed: tagged `registration: abandoned` and held,
    with the reason, so no later run tries it again. The champion is never abandoned; a finished registration
    has nothing to abandon (`RegistryError`). `by_gate`: the run's own repair decided it, as the gate decides a
    promotion (recorded as the gate's whichever account the run writes as), not a person."""
    _require_reason(reason, user)
    who = GATE if by_gate else _user(user)
    registry = _registry(params)
    with registry.lock():
        target = _version(registry, version)
        state = target.tags.get(REGISTRATION_TAG, "done")
        champion = registry.by_alias(CHAMPION)
        if champion is not None and champion.version == target.version:
            raise RegistryError(f"v{target.version} is the champion: roll back (`xbn registry rollback`) rather "
                                "than abandon it")
        if state not in UNFINISHED:
            raise RegistryError(f"v{target.version}'s registration is {state}, not unfinished: nothing to abandon")
        registry.set_tags(target.version, {**_stamp("held", f"abandoned: {reason}", who),
                                           REGISTRATION_TAG: ABANDONED})
    return _write_report(params, registry, registry.get(target.version), compared=None, write=False)


def complete_awaiting_index(params: Params, version: int) -> dict | None:
    """Finish the registration of `version` if it was waiting for its index (the `index` stage calls this once
    it has attached one): the gate's promotion takes effect now, `_complete` verifying the index first. None
    when the version was not waiting."""
    registry = Registry(params)
    info = registry.get(version)
    if info.tags.get(REGISTRATION_TAG) != AWAITING_INDEX:
        return None
    # registry.report stays register's own output (dvc.yaml: the index stage depends on it, never writes it)
    return _registered(params, registry, info, _trained_of(params, registry, info), write=False)


def registration(params: Params, version: int) -> dict:
    """The registry's report on `version` as it stands now (what `register` wrote to `registry.report`, after
    whatever completed it since), not written anywhere."""
    registry = Registry(params)
    return _write_report(params, registry, _version(registry, version), compared=None, write=False)


def _trained_of(params: Params, registry: Registry, info: ModelVersionInfo, strict: bool = False) -> Params:
    """The params `info`'s model was trained with, as recorded in its registered checkpoint (the card describes
    them); this call's params if the checkpoint cannot be read back, unless `strict` (a registration completed
    by a later run: a checkpoint that fails its sha256 is not one to promote)."""
    try:
        with tempfile.TemporaryDirectory(prefix="xbn-complete-") as tmp:
            return trained_params(params, registry.checkpoint(info, tmp).path)[0]
    except IntegrityError as exc:
        if strict:
            raise
        log.warning("%s v%s: %s; its card shows this run's params", registry.name, info.version, exc)
        return params


def _first_of(registry: Registry, created: ModelVersionInfo, sha: str) -> ModelVersionInfo:
    """The model's first version: MLflow's client retries a POST whose response was lost, so one create can
    register the same file twice. The later copy is marked a duplicate (deleting takes an admin) and never
    served; the first is the registration."""
    first = registry.find_by_tag(SHA_TAG, sha)
    if first is None or first.version == created.version:
        return created
    log.warning("%s: v%s and v%s hold the same model (a create request was retried): v%s is marked a duplicate",
                registry.name, first.version, created.version, created.version)
    registry.set_tags(created.version, {**_stamp("duplicate", f"the same model as v{first.version} (a retried "
                                                 "create request registered it twice)", GATE),
                                        REGISTRATION_TAG: "done"})
    return first


def _complete(params: Params, registry: Registry, info: ModelVersionInfo, trained: Params, run=None,
              decision: Decision | None = None, champion: ModelVersionInfo | None = None) -> ModelVersionInfo:
    """Take `info`'s registration from wherever it stopped to `done` (under the registry lock): `challenger`,
    then `champion` when the gate promoted it, then the model card. `decision` and `champion` (the champion it
    was judged against): this register's own, else read back from the version."""
    if decision is None:
        comparison = Comparison.from_dict(info.gate) if info.gate else None
        decision = Decision(info.tags.get("decision") == "promoted", info.tags.get("decision", "held"),
                            info.tags.get("reason", ""), comparison)
        judged = comparison.champion_version if comparison else None
        champion = registry.get(judged) if judged is not None else None
    current, awaiting = registry.by_alias(CHAMPION), None
    if current is None or current.version != info.version:
        registry.set_alias(CHALLENGER, info.version)
        if decision.promote and (current and current.version) == (champion and champion.version):
            if params.registry.promote_with_index:
                awaiting = registry.index_problem(info)
            if awaiting is None:
                make_champion(registry, info.version, current, by=GATE, action="gate", reason=decision.reason)
                fault_point("register.after_champion")
            else:  # promote last: the champion serves until this version's index is attached (`index`)
                log.info("%s v%s: promoted by the gate; it becomes champion once its index is attached (it %s)",
                         registry.name, info.version, awaiting)
        elif decision.promote:  # resumed after someone else moved the champion: the gate's verdict is stale
            decision = Decision(False, "held", (
                f"its registration was interrupted and the champion is now v{current.version if current else '-'}"
                f", not v{champion.version if champion else '-'} as when the gate promoted it: review it and "
                "promote it by hand (`xbn registry promote`)"), decision.comparison)
            registry.set_tags(info.version, _stamp("held", decision.reason, GATE))
    elif (challenger := registry.by_alias(CHALLENGER)) is not None and challenger.version == info.version:
        registry.remove_alias(CHALLENGER)  # stopped between the champion's move and this
    if run is None:
        assert info.run_id is not None  # registered by xbn: from a run
        recorded = registry.client.get_run(info.run_id).info
        run = PipelineRun(info.run_id, recorded.experiment_id, tracking_uri(params), recorded.artifact_uri,
                          resumed=True)
    registry.set_description(info.version, model_card(params, registry.get(info.version), champion, decision,
                                                      run, trained=trained))
    registry.set_tags(info.version, {REGISTRATION_TAG: AWAITING_INDEX if awaiting else "done"})
    return registry.get(info.version)



def promote(params: Params, version: int | str, reason: str, user: str | None = None) -> dict:
    """Move `champion` to `version` by hand (the promotion gate does not apply); idempotent."""
    _require_reason(reason, user)
    registry = _registry(params)
    with registry.lock():  # the champion read here is still the champion when the alias moves
        finish_logged_move(registry)  # a move killed between its history entry and its alias
        target = _version(registry, version)
        champion = registry.by_alias(CHAMPION)
        if champion is not None and champion.version == target.version:
            return _write_report(params, registry, target, compared=None, decision="unchanged",
                                 reason=f"v{target.version} is already the champion; nothing changed")
        who = _user(user)
        _require_index(params, registry, target)
        make_champion(registry, target.version, champion, by=who, action="promote", reason=reason)
        registry.set_tags(target.version, _stamp("promoted", reason, who))
    return _write_report(params, registry, registry.get(target.version), compared=champion)


def rollback(params: Params, reason: str, user: str | None = None) -> dict:
    """Restore the champion before the current one's promotion, as the champion's history records it (entries
    already rolled back are skipped, so repeated rollbacks walk back to the first champion). Nothing to restore:
    `RegistryError`."""
    _require_reason(reason, user)
    registry = _registry(params)
    with registry.lock():
        pending = finish_logged_move(registry)  # a rollback killed before its alias moved: this retry ends it
        champion: ModelVersionInfo | None
        previous: int | None
        if pending is not None and pending.action == "rollback" and pending.from_version is not None:
            previous, who, champion = pending.to_version, pending.by, registry.get(pending.from_version)
        else:
            champion = registry.by_alias(CHAMPION)
            reverted = rollback_target(read_history(registry), champion.version if champion else None,
                                       registry.name)
            previous, who = reverted.from_version, _user(user)
            assert champion is not None and previous is not None  # else rollback_target raised
            _require_index(params, registry, registry.get(previous))
            append_history(registry, by=who, action="rollback", from_version=champion.version,
                           to_version=previous, reason=reason, undoes=reverted.seq)
            fault_point("rollback.after_history")
            registry.set_alias(CHAMPION, previous)
        assert champion is not None and previous is not None
        registry.set_tags(champion.version, _stamp("rolled_back", reason, who))
        registry.set_tags(int(previous),
                          _stamp("restored", f"rollback of v{champion.version}: {reason}", who))
    return _write_report(params, registry, registry.get(previous), compared=champion)


# -- helpers -----------------------------------------------------------------------------------------------
def data_md5(params: Params) -> str:
    """DVC's md5 of the data the model trained on (`reports/data.json`, when it describes the current data):
    `unversioned` with data.version: none, `unknown` when no snapshot was taken (`dvc repro`, `xbn run`)."""
    found = current_record(params)
    if found is None:
        return "unknown"
    return found.md5 or "unversioned"


def parent_tags(checkpoint: Path) -> dict[str, str]:
    """`parent_version` for a model fine-tuned from a registry version (model.pt records where it started)."""
    import torch

    init = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True).get("init") or {}
    if init.get("version") is not None:
        return {PARENT_TAG: str(init["version"])}
    return {PARENT_TAG: Path(str(init["from"])).name} if init.get("from") else {}


def data_changes(registry: Registry, before: ModelVersionInfo | None,
                 after: ModelVersionInfo | None) -> str | None:
    """What changed between two versions' training data, from the snapshots their runs recorded: one line of
    counts and examples, or why it cannot be said."""
    import tempfile

    if before is None or after is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        old = registry.data_snapshot(before.run_id, Path(tmp) / "before")
        new = registry.data_snapshot(after.run_id, Path(tmp) / "after")
    if old is None or new is None:
        missing = [f"v{v.version}" for v, found in ((before, old), (after, new)) if found is None]
        return f"data v{before.version} -> v{after.version}: no data snapshot recorded for {', '.join(missing)}"
    diff = diff_files(old[1], new[1])
    same = "same data" if old[0].get("md5") == new[0].get("md5") and old[0].get("manifest_md5") == \
        new[0].get("manifest_md5") else diff_line(diff)
    caveat = "" if diff["content_compared"] else " (paths and labels only: a side is unversioned)"
    return f"data v{before.version} -> v{after.version}: {same}{caveat}"


def review(params: Params) -> str:
    """A side-by-side text table of the champion and the challenger (or, without a challenger, the champion a
    rollback would restore): metrics with differences, hashes, dates and decision
    tags; then the newest entries of the champion's history."""
    registry = _registry(params)
    champion = registry.by_alias(CHAMPION)
    challenger = registry.challenger(champion)
    history = read_history(registry)
    other_title = CHALLENGER
    if challenger is None and champion is not None:
        try:  # the champion a rollback would restore
            previous = rollback_target(history, champion.version, registry.name).from_version
            assert previous is not None  # else rollback_target raised
            challenger, other_title = registry.get(previous), "previous champion"
        except RegistryError:
            pass
    if champion is None and challenger is None:
        return f"{params.registry.model_name}: no champion and no challenger registered yet"
    changes = data_changes(registry, champion, challenger)
    return (review_table(params, champion, challenger, other_title) + ("\n" + changes if changes else "") + "\n"
            + history_lines(history, REVIEW_HISTORY))


def _write_report(params: Params, registry: Registry, info: ModelVersionInfo,
                  compared: ModelVersionInfo | None, already_registered: bool = False,
                  decision: str | None = None, reason: str | None = None, write: bool = True) -> dict[str, Any]:
    champion = registry.by_alias(CHAMPION)
    previous = info.tags.get("previous_champion")
    report = {
        "model_name": info.name,
        "version": info.version,
        # A champion is nobody's challenger, even where the account could not remove that alias.
        "alias": ",".join(a for a in info.aliases if not (a == CHALLENGER and CHAMPION in info.aliases)) or None,
        "decision": decision or info.tags.get("decision"),
        "reason": reason or info.tags.get("reason"),
        "decided_by": info.tags.get("decided_by"),
        "decided_at": info.tags.get("decided_at"),
        "metrics": info.metrics,  # the test split's, for reporting
        "gate": info.gate,
        "gate_settings": info.gate_settings,
        "champion_version": champion.version if champion else None,
        "compared_with": {"version": compared.version, "metrics": compared.metrics} if compared else None,
        "previous_champion": int(previous) if previous else None,
        "data_hash": info.tags.get("data_hash"),
        "data_md5": info.tags.get(DATA_MD5_TAG),
        "parent_version": info.tags.get(PARENT_TAG),
        "params_hash": info.tags.get("params_hash"),
        "model_sha256": info.tags.get(SHA_TAG),
        "run_id": info.run_id,
        "already_registered": already_registered,
        # awaiting_index: promoted by the gate, champion once its index is attached (promote last)
        "registration": info.tags.get(REGISTRATION_TAG, "done"),
    }
    if write:
        write_json(params.registry.report, report)
    return report


def trained_params(params: Params, checkpoint: Path) -> tuple[Params, str]:
    """The params `checkpoint` was trained with and their hash, as the trainer recorded them in it; a model
    from before xbn recorded them gets this call's params, with a warning (its provenance is unknown)."""
    import torch

    state = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
    record, digest = state.get("params"), state.get("params_hash")
    if isinstance(record, dict) and digest:
        try:
            return Params.model_validate(record), str(digest)
        except ValueError as exc:  # a record from another xbn version whose keys no longer fit the schema
            log.warning("%s: its training params do not fit this xbn's schema (%s); the version's card "
                        "shows the current params, its params hash is the recorded one", checkpoint,
                        str(exc).splitlines()[0])
            return params, str(digest)
    log.warning("%s records no training params (written by an older xbn): the version is described with "
                "this call's params", checkpoint)
    return params, params_hash(params)


def _stamp(decision: str, reason: str, who: str) -> dict[str, str]:
    return {"decision": decision, "decided_by": who,
            "decided_at": datetime.now(UTC).isoformat(timespec="seconds"), "reason": reason}


def _user(user: str | None) -> str:
    """Who decides: the account authenticated to the MLflow server when there is one (MLFLOW_TRACKING_USERNAME;
    a `--user` that names someone else is refused), else `--user`, else the login name."""
    account = os.environ.get("MLFLOW_TRACKING_USERNAME")
    if account:
        if user and user != account:
            raise RegistryError(f"--user {user} is not the account you are authenticated as ({account}): the "
                                "decision is recorded as made by the authenticated account")
        return account
    if user:
        return user
    try:
        return os.environ.get("USER") or getpass.getuser()
    except (KeyError, OSError):  # no $USER and no passwd entry (some containers)
        return "unknown"


# A reason lands in a version tag, the champion history and the report. MLflow refuses a registry tag over
# 100,000 characters, and it did so after the alias had moved (a promotion that failed after it succeeded):
# every value a decision writes is checked before the first write.
MAX_REASON = 5000
MAX_USER = 250


def _require_reason(reason: str, user: str | None = None) -> None:
    if not reason or not reason.strip():
        raise RegistryError("a reason is required: it is recorded with the decision")
    if len(reason) > MAX_REASON:
        raise RegistryError(f"the reason is {len(reason):,} characters, over the limit of {MAX_REASON:,}: say it "
                            "in short, and link to the long version")
    if user is not None and (len(user) > MAX_USER or not user.strip()):
        raise RegistryError(f"--user must be a name of 1 to {MAX_USER} characters")


def _require_index(params: Params, registry: Registry, target: ModelVersionInfo) -> None:
    """A hand-made champion must serve too (registry.promote_with_index): refused, before any write, when its
    index is missing or fails its sha256, naming the command that attaches one."""
    if params.registry.promote_with_index and (problem := registry.index_problem(target)):
        if "checkpoint" in problem:  # the model itself: no index can make it servable
            raise RegistryError(f"{registry.name} v{target.version} {problem}, so it could not serve as champion: "
                                "choose another version")
        raise RegistryError(f"{registry.name} v{target.version} {problem}, so it could not serve as champion: "
                            f"attach one first (`xbn index --model-version {target.version}`), or set "
                            "registry.promote_with_index=false for a registry served without a search index")


def _registry(params: Params, wait_s: float = 0.0) -> Registry:
    """The registry, once the tracking store has answered: a store that is down fails in seconds (exit 4),
    not after minutes of the MLflow client's retries; `wait_s`: waited for that long first (after a training,
    a store that blinks is worth waiting for: `tracking.outage_s`)."""
    wait_reachable(tracking_uri(params), wait_s)
    return Registry(params)


def _version(registry: Registry, version: int | str) -> ModelVersionInfo:
    try:
        return registry.get(version)
    except ValueError as exc:  # no such version, or not a number
        raise RegistryError(str(exc)) from None


