"""Masking secrets in URLs and DSNs before they are logged or recorded (tracking stores, DVC remotes)."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar

MASK = "***"
# scheme://user:password@host -> scheme://user:***@host. The password runs to the last '@' of the token: an
# unencoded '@' inside it (`u:p@ss@host`) left `ss` in the clear. Masking too much of a URL is the safe side.
_USERINFO = re.compile(r"(?P<head>[a-zA-Z][\w+.-]*://[^:/@\s]*:)(?P<secret>\S+)(?P<tail>@)")
# key=value in a query string, a DSN or an environment line, for any key that names a credential: password,
# aws_secret_access_key, apikey / api_key, access_token, client_secret, X-Amz-Signature, X-Amz-Credential...
_KEYVALUE = re.compile(r"(?P<head>\b[\w.-]*(?:password|passwd|pwd|secret|token|api[_-]?key|signature|credential)"
                       r"[\w-]*=)(?P<secret>[^&;\s]+)", re.IGNORECASE)
_DATABASE_SCHEMES = ("postgresql", "postgres", "mysql", "mssql")
P = ParamSpec("P")
R = TypeVar("R")


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


def mask_exception(exc: BaseException) -> BaseException:
    """Mask, in place, the text of `exc` and of every exception it was raised from or during, and return it.
    What Prefect records of a failed task or flow (the state's message, the traceback its engine sends to the
    API's log table) is made of these texts, and a library's error may name a URL or a DSN with its password
    (MLflow names the URL it called, a database driver its DSN). The type is kept, so that callers' `except`
    clauses and retry rules still match."""
    pending: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.args = tuple(mask_secrets(a) if isinstance(a, str) else a for a in current.args)
        if isinstance(message := getattr(current, "message", None), str):  # MlflowException's str() reads it
            current.message = mask_secrets(message)  # type: ignore[attr-defined]
        if notes := getattr(current, "__notes__", None):
            current.__notes__ = [mask_secrets(n) if isinstance(n, str) else n for n in notes]
        pending += [current.__cause__, current.__context__]
    return exc


def masks_exceptions(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn`, whose exceptions leave it masked (`mask_exception`): under every Prefect `@task` and `@flow` of xbn,
    the one place their failures are written from."""

    @functools.wraps(fn)
    def masked(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except BaseException as exc:
            mask_exception(exc)
            raise

    # Prefect validates a flow's parameters against its signature: give it `fn`'s with the annotations resolved
    # in `fn`'s module (a postponed annotation is a string, and the wrapper's module does not know its names).
    masked.__signature__ = inspect.signature(fn, eval_str=True)  # type: ignore[attr-defined]
    return masked
