"""Issue 54 item 4: Prefect's ephemeral API server that does not start in time (a busy machine; here a start-up
timeout it cannot meet) is one line from `xbn retrain` naming PREFECT_API_URL, with exit 4, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests_support import write_tiny_params
from xbn.utils.errors import EXIT_SERVICE


def test_an_ephemeral_prefect_api_that_does_not_start_is_one_line_naming_prefect_api_url(tmp_path):
    write_tiny_params(tmp_path / "params.yaml", "tracking.enabled=true", "data.version=none")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "1",
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    done = subprocess.run([str(Path(sys.executable).with_name("xbn")), "retrain", "--params", "params.yaml"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == EXIT_SERVICE, done.stderr[-3000:]
    ours = [line for line in done.stderr.splitlines() if line.startswith("xbn retrain:")]
    assert len(ours) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "the Prefect API did not start" in ours[0] and "Set PREFECT_API_URL" in ours[0]
    assert not (tmp_path / "models").exists()  # nothing trained
