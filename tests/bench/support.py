"""What the report tests share: a fake run's provenance, and the check that a section prints no number its JSON
does not give."""

from __future__ import annotations

import re

PROVENANCE = {
    "git_commit": "0123456789abcdef0123456789abcdef01234567", "dirty": True, "dirty_paths": ["a.py", "b.py"],
    "command": "python -m benchmarks memory --quick --allow-dirty", "argv": ["x"],
    "started_utc": "2031-02-03T04:05:06+00:00", "finished_utc": "2031-02-03T04:17:36+00:00",
    "loadavg_1min_before": 3.71, "loadavg_1min_after": 4.93,
    "machine": {"cpu": "Test CPU", "cores": 7, "cpu_flags": ["avx", "avx2", "fma"], "avx512": False,
                "python": "3.99.1", "os": "test", "packages": {"torch": "9.8.7"}, "torch_cpu_capability": "AVX2"},
}


def _iqr(median, p25, p75):
    return {"median": median, "p25": p25, "p75": p75, "n": 13}


def _p99(low, high):
    return {"p50": 5.0, "mean": 6.0, "n": 1000, "p99": {"value": (low + high) / 2, "low": low, "high": high,
                                                        "ranks": [984, 996], "n": 1000, "clipped": False}}


# A number token not glued to a word, an '@', a '^' or a '/' (float32, R@1, N^2 and avx512 are names).
NUMBER = re.compile(r"(?<![\w@^/.\-])\d+(?:\.\d+)*(?:e[-+]?\d+)?(?![\w@^/])")


def _json_numbers(obj, numbers: list[float], strings: list[str]) -> None:
    if isinstance(obj, bool):
        return
    if isinstance(obj, (int, float)):
        numbers.append(float(obj))
    elif isinstance(obj, str):
        strings.append(obj)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _json_numbers(key, numbers, strings)
            _json_numbers(value, numbers, strings)
    elif isinstance(obj, list):
        for value in obj:
            _json_numbers(value, numbers, strings)


def _unexplained(markdown: str, data: dict) -> list[str]:
    """Numbers of `markdown` (section numbers of headings and code spans left out) that no JSON number gives
    at the printed precision and no JSON string contains."""
    numbers, strings = [], []
    _json_numbers(data, numbers, strings)
    text = re.sub(r"`[^`]*`", "", re.sub(r"^#+ \d+\.", "", markdown, flags=re.MULTILINE))
    missing = []
    for token in NUMBER.findall(text):
        if any(token in s for s in strings):
            continue
        if token.count(".") > 1:
            missing.append(token)
            continue
        value = float(token)
        decimals = len(token.split(".")[1]) if "." in token and "e" not in token else 0
        if not any(abs(v - value) <= max(0.5 * 10**-decimals, 5e-4 * abs(v)) for v in numbers):
            missing.append(token)
    return missing
