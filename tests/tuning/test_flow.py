"""The `xbn-tune` Prefect flow for real (prefect_test_harness): it runs the stage's study and merges the best
values into the params file it was given."""

import pytest
import yaml

from xbn.config import load_params

pytestmark = pytest.mark.slow


def test_tune_flow_runs_the_study_and_merges_the_best_values(prefect_harness, project, tmp_path):
    from xbn.flows.tune import tune_flow

    params = project("tune.trials=2", "tracking.enabled=false")
    params_file = tmp_path / "params.yaml"
    params_file.write_text("# kept\n" + yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))

    summary = tune_flow(str(params_file), apply=True)

    assert summary["trials"]["total"] == 2 and summary["applied_to"] == str(params_file)
    merged = load_params(params_file)
    for key, value in summary["best"]["overrides"].items():
        section, *rest = key.split(".")
        node = getattr(merged, section)
        for part in rest:
            node = getattr(node, part)
        assert node == value
    assert params_file.read_text().startswith("# kept")
