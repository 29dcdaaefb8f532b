"""A real HTTP receiver for the notifications the pipeline sends through Apprise (its `json://` scheme)."""

from __future__ import annotations

import pytest
from tests_support import NotificationReceiver


@pytest.fixture
def receiver():
    """The receiver's `json://` URL and the list its messages arrive in."""
    server = NotificationReceiver()
    yield server.url, server.messages
    server.close()
