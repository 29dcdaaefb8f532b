"""Notifications (issue 24 item 5): URLs only by reference, sent through Apprise to a real HTTP receiver, and a
notifier that fails never fails the caller."""

from __future__ import annotations

import logging

import pytest

from tests_support import ROOT
from xbn.config import ConfigError, load_params
from xbn.stages.notify import notification_urls, notify


def test_a_url_in_params_is_refused_naming_the_way_to_give_it():
    with pytest.raises(ConfigError, match="environment variable or a Prefect Secret block"):
        load_params(ROOT / "params.yaml", ["notify.urls=['slack://tokenA/tokenB']"])


def test_urls_come_from_the_environment_and_every_one_is_sent_to(receiver, monkeypatch):
    url, received = receiver
    monkeypatch.setenv("XBN_NOTIFY_URLS", f"{url}, {url}")
    params = load_params(ROOT / "params.yaml")
    assert notification_urls(params.notify) == [url, url]
    assert notify(params.notify, "xbn: v2 promoted to champion", "the body")
    assert [(m["title"], m["message"]) for m in received] == [("xbn: v2 promoted to champion", "the body")] * 2


def test_nothing_configured_or_a_dead_receiver_is_logged_not_raised(monkeypatch, caplog):
    params = load_params(ROOT / "params.yaml")
    monkeypatch.delenv("XBN_NOTIFY_URLS", raising=False)
    with caplog.at_level(logging.INFO):
        assert not notify(params.notify, "t", "b")
    assert "no URL configured" in caplog.text
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("XBN_NOTIFY_URLS", f"json://127.0.0.1:{port}/")
    with caplog.at_level(logging.WARNING):
        assert not notify(params.notify, "xbn retrain FAILED", "b")
    assert "not delivered" in caplog.text or "failed" in caplog.text


def test_a_run_that_overrides_the_gate_says_so():
    # Issue 41 item 4: registry.* overrides weaken the gate for one run; the decision's notification names them.
    from xbn.flows.retrain import _gate_overrides

    path = ROOT / "params.yaml"
    assert _gate_overrides(load_params(path), str(path)) == []
    weak = load_params(path, ["registry.confidence=0.01", "registry.guarded_metrics=[]"])
    assert _gate_overrides(weak, str(path)) == [
        "registry.guarded_metrics: ['recall@10', 'map@r', 'r_precision', 'nmi'] -> []",
        "registry.confidence: 0.95 -> 0.01"]


def test_what_is_sent_is_masked(receiver, monkeypatch):
    """An error's text in a title or a body (a store's URI with its password) reaches no chat room in clear."""
    url, received = receiver
    monkeypatch.setenv("XBN_NOTIFY_URLS", url)
    error = "OperationalError: could not connect to postgresql://xbn:hunter2@db:5432/mlflow"
    assert notify(load_params(ROOT / "params.yaml").notify, f"xbn retrain FAILED: {error}", f"the run failed: {error}")
    assert "hunter2" not in str(received) and "postgresql://xbn:***@db:5432/mlflow" in received[0]["message"]
