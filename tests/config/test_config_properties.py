"""Property tests of the params schema: any `--set key=value` either gives valid Params or a ConfigError
whose message names the key; never another exception."""

from __future__ import annotations

import re

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import pytest

from xbn.config import ConfigError, Params, flatten, load_params

REAL_KEYS = sorted(flatten(Params()))
SECTIONS = sorted({k.rsplit(".", i)[0] for k in REAL_KEYS for i in (1, 2) if "." in k})
NAME = st.from_regex(r"[a-z_][a-z0-9_]{0,7}", fullmatch=True)

# A real key, a real section, or either with a random part added or swapped in (typos, nesting under a value).
keys = st.one_of(
    st.sampled_from(REAL_KEYS),
    st.sampled_from(SECTIONS),
    st.tuples(st.sampled_from(REAL_KEYS + SECTIONS), NAME).map(".".join),
    st.tuples(st.sampled_from(SECTIONS), NAME).map(".".join),
    st.lists(NAME, min_size=1, max_size=3).map(".".join),
)
values = st.one_of(
    st.none(), st.booleans(), st.integers(-10**9, 10**9), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.lists(st.integers(-5, 200), max_size=4),
    st.dictionaries(NAME, st.integers(), max_size=2),
).map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip().removesuffix("\n...").strip())
raw_text = st.text(max_size=16)  # what a user may type after the '=' (unbalanced brackets, tabs, ...)

PROPERTY = settings(max_examples=100, deadline=None)


def _names_key(message: str, key: str) -> bool:
    """The whole dotted key, or the part of it that is wrong (an unknown section, a value used as a section),
    as a name of its own: `a` is not named by "data:", nor `train` by "train.lr" when the key was `train`."""
    parts = key.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return any(re.search(rf"(?<![\w.]){re.escape(p)}(?![\w])", message) for p in prefixes)


def test_naming_a_key_means_naming_it_whole():
    assert not _names_key("data: unknown key 'x'", "a")  # the old check took "a:" inside "data:" for the key
    assert not _names_key("train.lr: must be > 0", "lr")
    assert _names_key("train.lr: must be > 0", "train.lr") and _names_key("unknown section 'trian'", "trian.lr")


@PROPERTY
@given(key=keys, text=st.one_of(values, raw_text))
def test_any_override_is_valid_params_or_a_config_error_naming_the_key(key, text):
    try:
        params = load_params(None, [f"{key}={text}"])
    except ConfigError as exc:
        assert _names_key(str(exc), key), f"{key}={text!r}: {exc}"
    else:
        assert isinstance(params, Params)


@PROPERTY
@given(pairs=st.lists(st.tuples(st.sampled_from(REAL_KEYS), values), min_size=2, max_size=4))
def test_several_overrides_of_real_keys_fail_naming_one_of_them(pairs):
    try:
        params = load_params(None, [f"{k}={v}" for k, v in pairs])
    except ConfigError as exc:
        assert any(_names_key(str(exc), k) for k, _ in pairs), f"{pairs}: {exc}"
    else:  # accepted: each key holds what its last override said, as the schema coerced it
        flat = flatten(params)
        for key, value in dict(pairs).items():
            given_value, held = yaml.safe_load(value), flat[key]
            if isinstance(given_value, bool) or not isinstance(given_value, (int, float)):
                assert held == given_value or str(held) == str(given_value), (key, value, held)
            else:
                assert held == pytest.approx(given_value), (key, value, held)
