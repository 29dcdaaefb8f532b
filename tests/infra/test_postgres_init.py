"""infra/postgres/init-databases.sh (the postgres service's init script), run for real against the local
PostgreSQL with unique names: one login role per service owning its database, pg_trgm for Prefect, no access
to another service's database, and safe to run twice."""

from __future__ import annotations

import os
import shutil
import subprocess

from tests_support import ROOT

from .support import PG_HOST, PG_PORT, PG_USER, admin_execute, require_postgres

SCRIPT = ROOT / "infra/postgres/init-databases.sh"


def run_script(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)


def psql_as(role: str, database: str, sql: str) -> subprocess.CompletedProcess:
    return subprocess.run(["psql", "-X", "-tA", "-h", PG_HOST, "-p", str(PG_PORT), "-U", role, "-d", database,
                           "-v", "ON_ERROR_STOP=1", "-c", sql], capture_output=True, text=True, timeout=30)


def test_compose_defaults_are_the_three_service_databases():
    text = SCRIPT.read_text()
    assert 'databases="${XBN_DATABASES:-mlflow prefect optuna}"' in text


def test_init_script_creates_one_owned_database_per_service(pg_name):
    require_postgres()
    assert shutil.which("psql"), "psql is needed: the postgres image runs the script with it too"
    names = [pg_name(service) for service in ("mlflow", "prefect", "optuna")]
    # What the postgres image gives its init scripts, pointed at the local server; a password with quotes.
    env = {**os.environ, "PGHOST": PG_HOST, "PGPORT": str(PG_PORT), "POSTGRES_USER": PG_USER,
           "POSTGRES_DB": "postgres", "XBN_DATABASES": " ".join(names),
           **{f"{n.upper()}_DB_PASSWORD": f"pw'\"{i}" for i, n in enumerate(names)}}
    try:
        for attempt in (1, 2):  # the second run must change nothing and not fail
            out = run_script(env)
            assert out.returncode == 0, f"run {attempt}:\n{out.stdout}\n{out.stderr}"
        owners = admin_execute("SELECT datname, pg_get_userbyid(datdba) FROM pg_database "
                               f"WHERE datname IN ({', '.join(repr(n) for n in names)})")
        assert sorted(owners) == sorted((n, n) for n in names)
        roles = admin_execute("SELECT rolname, rolcanlogin, rolsuper, rolpassword IS NOT NULL FROM pg_authid "
                              f"WHERE rolname IN ({', '.join(repr(n) for n in names)})")
        assert sorted(roles) == sorted((n, True, False, True) for n in names)
        mlflow_db, prefect_db, optuna_db = names
        assert admin_execute("SELECT extname FROM pg_extension WHERE extname = 'pg_trgm'", dbname=prefect_db)
        # Each role can build its schema in its own database (what the services' migrations do) ...
        for name in names:
            made = psql_as(name, name, "CREATE TABLE t (x int); SELECT current_user")
            assert made.returncode == 0 and made.stdout.split()[-1] == name, made.stderr
        # ... and cannot even connect to another's.
        denied = psql_as(mlflow_db, optuna_db, "SELECT 1")
        assert denied.returncode != 0 and "permission denied" in denied.stderr
    finally:
        for name in names:
            admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)', f'DROP ROLE IF EXISTS "{name}"')


def test_init_script_refuses_a_missing_password(pg_name):
    name = pg_name("mlflow")
    env = {k: v for k, v in os.environ.items() if not k.endswith("_DB_PASSWORD")}
    out = run_script({**env, "XBN_DATABASES": name, "PGHOST": PG_HOST, "POSTGRES_USER": PG_USER})
    assert out.returncode != 0 and f"{name.upper()}_DB_PASSWORD is not set" in out.stderr
