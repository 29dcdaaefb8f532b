"""Masking secrets in URLs and DSNs before they are logged or recorded (tracking stores, DVC remotes)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

MASK = "***"
# scheme://user:password@host -> scheme://user:***@host. The password runs to the last '@' of the token: an
# unencoded '@' inside it (`u:p@ss@host`) left `ss` in the clear. Masking too much of a URL is the safe side.
_USERINFO = re.compile(r"(?P<head>[a-zA-Z][\w+.-]*://[^:/@\s]*:)(?P<secret>\S+)(?P<tail>@)")
# key=value in a query string, a DSN or an environment line, for any key that names a credential: password,
# aws_secret_access_key, apikey / api_key, access_token, client_secret, X-Amz-Signature, X-Amz-Credential...
_KEYVALUE = re.compile(r"(?P<head>\b[\w.-]*(?:password|passwd|pwd|secret|token|api[_-]?key|signature|credential)"
                       r"[\w-]*=)(?P<secret>[^&;\s]+)", re.IGNORECASE)
_DATABASE_SCHEMES = ("postgresql", "postgres", "mysql", "mssql")


def mask_secrets(text: str) -> str:
    """`postgresql://u:pw@host/db` -> `postgresql://u:***@host/db` (and `password=...` -> `password=***`)."""
    text = _USERINFO.sub(lambda m: m["head"] + MASK + m["tail"], text)
    return _KEYVALUE.sub(lambda m: m["head"] + MASK, text)


def mask_values(value: Any) -> Any:
    """`value` with every string in it passed through `mask_secrets` (mappings and lists recursively): what a
    record of params holds (a checkpoint, a Prefect parameter), never a password from a URI."""
    if isinstance(value, str):
        return mask_secrets(value)
    if isinstance(value, Mapping):
        return {k: mask_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(mask_values(v) for v in value)
    return value


def mask_error(exc: BaseException, limit: int = 300) -> str:
    """`Type: first line` of an exception, masked: the one form an error takes wherever it is written (a record,
    a notification, a log line, /health)."""
    first = (str(exc).strip().splitlines() or [""])[0][:limit]
    return mask_secrets(f"{type(exc).__name__}: {first}" if first else type(exc).__name__)
