"""Masking secrets in URLs and DSNs before they are logged or recorded (tracking stores, DVC remotes)."""

from __future__ import annotations

import re

MASK = "***"
# scheme://user:password@host -> scheme://user:***@host; also password=... in a query string or DSN.
_USERINFO = re.compile(r"(?P<head>[a-zA-Z][\w+.-]*://[^:/@\s]*:)(?P<secret>[^@\s]+)(?P<tail>@)")
_KEYVALUE = re.compile(r"(?P<head>\b(?:password|passwd|pwd|secret|token)=)(?P<secret>[^&;\s]+)",
                       re.IGNORECASE)
_DATABASE_SCHEMES = ("postgresql", "postgres", "mysql", "mssql")


def mask_secrets(text: str) -> str:
    """`postgresql://u:pw@host/db` -> `postgresql://u:***@host/db` (and `password=...` -> `password=***`)."""
    text = _USERINFO.sub(lambda m: m["head"] + MASK + m["tail"], text)
    return _KEYVALUE.sub(lambda m: m["head"] + MASK, text)
