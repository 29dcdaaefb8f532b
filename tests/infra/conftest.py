"""Fixtures for the infra tests: each test that needs PostgreSQL gets names and a database of its own, dropped
afterwards (see support.py for the services and the skip rule)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator

import pytest

from .support import admin_execute, require_postgres


@pytest.fixture
def pg_name() -> Callable[[str], str]:
    """Unique, valid PostgreSQL identifiers for this test: pg_name('mlflow') -> 'xbninfra_1a2b3c4d_mlflow'."""
    token = uuid.uuid4().hex[:8]
    return lambda suffix: f"xbninfra_{token}_{suffix}"


@pytest.fixture
def fresh_database(pg_name) -> Iterator[str]:
    """A new empty database owned by postgres; dropped (connections closed) after the test."""
    require_postgres()
    name = pg_name("db")
    admin_execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

