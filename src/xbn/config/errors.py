"""The error every config check raises, and the close-match hint its messages give."""

from __future__ import annotations

import difflib


class ConfigError(ValueError):
    """A params file or override that does not fit the schema; the message names the key."""


def close_matches(name: str, candidates, n: int = 5) -> list[str]:
    """Up to `n` of `candidates` that look like `name` (difflib, ignoring case), best first."""
    by_lower: dict[str, str] = {}
    for candidate in candidates:
        by_lower.setdefault(str(candidate).lower(), str(candidate))
    return [by_lower[m] for m in difflib.get_close_matches(name.lower(), list(by_lower), n=n, cutoff=0.6)]
