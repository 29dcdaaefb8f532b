"""The named fault points (xbn.utils.faults): inert unless XBN_FAULT names them; `kill` is a real SIGKILL."""

from __future__ import annotations

import subprocess
import sys

import pytest

from xbn.utils.faults import FaultInjected, fault_point


def test_a_point_acts_only_when_named(monkeypatch):
    fault_point("register.after_create")  # unset: nothing
    monkeypatch.setenv("XBN_FAULT", "other.point:raise, register.after_create:raise")
    fault_point("register.after")  # a prefix is not the name
    with pytest.raises(FaultInjected, match="register.after_create"):
        fault_point("register.after_create")
    monkeypatch.setenv("XBN_FAULT", "register.after_create:explode")
    with pytest.raises(ValueError, match="unknown action 'explode'"):
        fault_point("register.after_create")


def test_kill_is_a_sigkill_at_that_line():
    code = "from xbn.utils.faults import fault_point\nprint('before', flush=True)\nfault_point('x.y')\nprint('after')"
    done = subprocess.run([sys.executable, "-c", code], env={"XBN_FAULT": "x.y", "PATH": ""}, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == -9 and done.stdout == "before\n"


def test_wait_pauses_until_released_then_lets_every_later_pass(monkeypatch, tmp_path):
    import threading

    monkeypatch.setenv("XBN_FAULT", "flow.step:wait")
    monkeypatch.setenv("XBN_FAULT_DIR", str(tmp_path))
    passed = threading.Event()
    waiter = threading.Thread(target=lambda: (fault_point("flow.step"), passed.set()), daemon=True)
    waiter.start()
    for _ in range(100):  # the point says it arrived, and holds
        if (tmp_path / "flow.step.reached").exists():
            break
        waiter.join(0.05)
    assert (tmp_path / "flow.step.reached").exists() and not passed.wait(0.5)
    (tmp_path / "flow.step.release").touch()
    assert passed.wait(5)
    fault_point("flow.step")  # released: no more waiting
