"""Telling a person what the schedule did: Apprise (which ships with Prefect) to the URLs `notify.urls` names.

`notify.urls` holds references, never URLs (they carry tokens, and params.yaml is committed): `env:VAR`, an
environment variable holding one or more URLs (space- or comma-separated), or `secret:BLOCK`, a Prefect Secret
block. The retrain flow sends three events and nothing else: a run that failed after its retries, a promotion, a
challenger held for review. A notifier that fails is logged and never fails the flow.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, cast

from xbn.config.schema import NotifyConfig
from xbn.utils.secrets import mask_error, mask_secrets

log = logging.getLogger(__name__)


def notification_urls(settings: NotifyConfig) -> list[str]:
    """The Apprise URLs `notify.urls` names: each entry `env:VAR` or a Prefect Secret block's name."""
    urls: list[str] = []
    for entry in settings.urls:
        kind, _, name = entry.partition(":")
        if kind == "env":
            value = os.environ.get(name, "")
        else:
            try:
                from prefect.blocks.system import Secret

                # load() is typed "the block or, in async code, a coroutine": this is sync code
                value = str(cast("Secret[Any]", Secret.load(name)).get())
            except Exception as exc:  # noqa: BLE001 - a missing block, a server that is down: never fatal here
                log.warning("notify: Prefect Secret block %r could not be read (%s): not notified through it",
                            name, type(exc).__name__)
                continue
        urls += [u for u in re.split(r"[\s,]+", value) if u]
    return urls


def notify(settings: NotifyConfig, title: str, body: str) -> bool:
    """Send one notification to every URL of `settings` (params.notify); False (logged, not raised) when none is configured or
    any of them failed."""
    title, body = mask_secrets(title), mask_secrets(body)  # an error's text may carry a URI with its password
    urls = notification_urls(settings)
    if not urls:
        log.info("notify: no URL configured (notify.urls): '%s' not sent", title)
        return False
    try:
        import apprise

        sender = apprise.Apprise()
        sender.asset.async_mode = False  # send in order, in this thread: the flow waits for the answer
        for url in urls:
            if not sender.add(url):
                log.warning("notify: Apprise does not understand one of the notify.urls (%s...): skipped",
                            url.split(":", 1)[0])
        ok = bool(len(sender)) and bool(sender.notify(title=title, body=body))
    except Exception as exc:  # noqa: BLE001 - a notifier must never fail the flow
        log.warning("notify: sending '%s' failed: %s", title, mask_error(exc))
        return False
    if not ok:
        log.warning("notify: '%s' was not delivered to every URL (see Apprise's log above)", title)
    return ok


__all__ = ["notification_urls", "notify"]
