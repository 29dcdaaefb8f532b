"""A crashed retrain tells a person (issue 40 item 3): Prefect does not retry a CRASHED run and does not call
on_failure for it, so the flow hooks on_crashed too. The crash is real: the flow's own process gets SIGTERM at
the named fault point `retrain.start` (xbn.utils.faults), in a subprocess with Prefect's ephemeral server, and
the notification arrives at a real HTTP receiver through Apprise."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from tests_support import ROOT


def test_a_flow_terminated_mid_run_is_reported_as_crashed(tmp_path, receiver):
    url, received = receiver
    env = {**os.environ, "XBN_FAULT": "retrain.start:term", "PREFECT_HOME": str(tmp_path / "prefect"),
           "XBN_NOTIFY_URLS": url, "PYTHONPATH": str(ROOT)}
    env.pop("PREFECT_API_URL", None)  # Prefect's ephemeral server, in the subprocess
    log = tmp_path / "flow.log"
    # Its own session: the ephemeral Prefect server it starts outlives a terminated flow process (and would
    # hold a captured pipe open), so the whole group is stopped once the flow process has ended.
    with log.open("w") as out:
        flow = subprocess.Popen([sys.executable, "-m", "xbn.flows.retrain", "--params", str(ROOT / "params.yaml")],
                                cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        flow.wait(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(flow.pid, signal.SIGKILL)
    text = log.read_text()
    assert "Running hook '_notify_crash' in response to entering state 'Crashed'" in text, text[-3000:]
    titles = [m["title"] for m in received]
    assert len(titles) == 1 and titles[0].startswith("xbn retrain CRASHED"), (titles, text[-3000:])
    assert "it is not retried" in received[0]["message"]
    assert not (tmp_path / "data").exists()  # it stopped where the fault was injected, before any stage
