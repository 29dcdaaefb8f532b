#!/usr/bin/env bash
# Creates one login role and one database per service (default: mlflow, prefect, optuna), each database owned
# by its role, plus the pg_trgm extension that Prefect's migrations need. Run by the postgres image on its first
# start (/docker-entrypoint-initdb.d); safe to run again. The password of role NAME comes from the environment
# variable <NAME>_DB_PASSWORD (MLFLOW_DB_PASSWORD, PREFECT_DB_PASSWORD, OPTUNA_DB_PASSWORD); nothing is stored
# here. Connection: psql's usual variables (PGHOST, PGPORT) and POSTGRES_USER / POSTGRES_DB.
set -euo pipefail

databases="${XBN_DATABASES:-mlflow prefect optuna}"
admin_user="${POSTGRES_USER:-postgres}"
admin_db="${POSTGRES_DB:-$admin_user}"

for name in $databases; do
    if [[ ! "$name" =~ ^[a-z_][a-z0-9_]*$ ]]; then
        echo "init-databases: '$name' is not a plain lower-case identifier" >&2
        exit 1
    fi
    var="$(tr '[:lower:]' '[:upper:]' <<<"$name")_DB_PASSWORD"
    password="${!var:-}"
    if [[ -z "$password" ]]; then
        echo "init-databases: $var is not set (the password of role $name)" >&2
        exit 1
    fi
    echo "init-databases: role and database $name"
    # psql variables (:'name', :"name") quote the values; the heredoc is not expanded by the shell.
    psql -v ON_ERROR_STOP=1 -X -q --username "$admin_user" --dbname "$admin_db" \
         -v name="$name" -v password="$password" <<'SQL'
SELECT format('CREATE ROLE %I LOGIN', :'name')
 WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = :'name') \gexec
SELECT format('ALTER ROLE %I WITH LOGIN PASSWORD %L', :'name', :'password') \gexec
SELECT format('CREATE DATABASE %I OWNER %I', :'name', :'name')
 WHERE NOT EXISTS (SELECT 1 FROM pg_database WHERE datname = :'name') \gexec
SELECT format('REVOKE ALL ON DATABASE %I FROM PUBLIC', :'name') \gexec
SQL
    if [[ "$name" == *prefect* ]]; then
        psql -v ON_ERROR_STOP=1 -X -q --username "$admin_user" --dbname "$name" \
             -c "SET client_min_messages = warning" -c "CREATE EXTENSION IF NOT EXISTS pg_trgm"
    fi
done
