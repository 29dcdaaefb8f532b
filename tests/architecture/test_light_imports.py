"""What a scheduled run that finds nothing changed imports: the modules of its steps (prepare, snapshot, repair,
plan, notify: xbn.stages.loop's order) load without torch, timm, pytorch-metric-learning or great-expectations,
each seconds of CPU in a fresh process (a deployment's flow run is one). Training imports them once the plan
decides to train; torch also loads when the champion check reads its verified checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "timm", "torchvision", "pytorch_metric_learning", "great_expectations")
# The retrain flow and what its repair, plan and notification steps import when they run.
NOTHING_CHANGED_PATH = ("xbn.flows.retrain", "xbn.stages.register", "xbn.stages.index", "xbn.stages.schedule",
                        "xbn.stages.loop", "xbn.stages.data", "xbn.stages.notify", "xbn.stages.summary")


def test_a_nothing_changed_runs_steps_import_no_deep_learning_stack():
    script = (f"import json, sys\nfor name in {NOTHING_CHANGED_PATH!r}:\n    __import__(name)\n"
              f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [], "imported on a nothing-changed run's path"
