"""infra/compose.yaml and the files it names, checked statically (no Docker engine on these machines): the
services and how they wire together, every ${VAR} declared in .env.example, no credential literal, and the
training image's Dockerfile."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest
import yaml

from tests_support import ROOT

from .support import LEASE_STORAGE, env_example

INFRA = ROOT / "infra"
COMPOSE_TEXT = (INFRA / "compose.yaml").read_text()
COMPOSE = yaml.safe_load(COMPOSE_TEXT)
SERVICES = COMPOSE["services"]
# ${VAR}, ${VAR:-default}, ${VAR:?message}, ... ; $$ is compose's escaped dollar.
REFERENCE = re.compile(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(?::?[-?+])[^}]*)?\}")
SECRET_KEY = re.compile(r"PASSWORD|SECRET|TOKEN|AUTH|ACCESS_KEY|CREDENTIAL", re.I)


def environment(service: str) -> dict[str, str]:
    env = SERVICES[service].get("environment") or {}
    if isinstance(env, list):  # KEY=VALUE form
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def values(node, path=""):
    """Every scalar value in the parsed file, with its path (`services.mlflow.environment.KEY`, `...[3]`)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from values(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from values(v, f"{path}[{i}]")
    elif node is not None:
        yield path, str(node)


def test_services():
    assert set(SERVICES) == {"postgres", "minio", "minio-init", "mlflow", "mlflow-accounts", "prefect-server",
                             "prefect-worker", "trainer"}
    assert set(COMPOSE["volumes"]) >= {"pgdata", "minio-data"}
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (INFRA / source).is_file(), f"{name} mounts {source}, which does not exist"
            else:
                assert source in COMPOSE["volumes"], f"{name} uses undeclared volume {source}"


def test_every_variable_is_in_env_example_and_none_is_unbraced():
    texts = [text for _, text in values(COMPOSE)]  # parsed values: comments do not count
    used = {name for text in texts for name in REFERENCE.findall(text)}
    declared = set(env_example())
    assert used, "compose.yaml references no variable"
    assert used <= declared, f"not in .env.example: {sorted(used - declared)}"
    assert declared <= used, f".env.example declares unused variables: {sorted(declared - used)}"
    # A bare $VAR would escape the check above: every reference is braced (or an escaped $$).
    bare = [m for text in texts for m in re.findall(r"(?<!\$)\$(?![{$])\w+", text)]
    assert not bare, f"unbraced variables: {bare}"


def test_no_credential_literals():
    secrets = {k: v for k, v in env_example().items() if SECRET_KEY.search(k) and not k.endswith("_ID")}
    assert secrets, ".env.example declares no secret"
    assert all("change-me" in v for v in secrets.values()), f"real-looking secrets in .env.example: {secrets}"
    for where, text in values(COMPOSE):
        key = where.rsplit(".", 1)[-1]
        if "=" in text and not text.startswith(("http", "postgres")):  # --flag=value, KEY=value
            key, text = text.split("=", 1)
        if SECRET_KEY.search(key) and not key.endswith("_PATH"):  # MLFLOW_AUTH_CONFIG_PATH names a file
            assert REFERENCE.fullmatch(text), f"{where}: {key} is a literal, not a ${{VAR}} reference"
        for userinfo in re.findall(r"://([^/\s@]+)@", text):  # user:password@host in a URL
            password = userinfo.partition(":")[2]
            assert not password or REFERENCE.fullmatch(password), f"{where}: a password literal in a URL"
    for where, text in values(COMPOSE):
        assert "change-me" not in text and "minioadmin" not in text, f"{where}: a placeholder credential"
    assert ".env" in (INFRA / ".gitignore").read_text().split(), "infra/.env must be git-ignored"


def test_healthchecks_and_start_order():
    one_shot = {"minio-init", "mlflow-accounts"}
    for name, service in SERVICES.items():
        if name not in one_shot and "profiles" not in service:
            assert "healthcheck" in service and service["healthcheck"]["test"], f"{name} has no healthcheck"
        for dependency, rule in (service.get("depends_on") or {}).items():
            assert dependency in SERVICES
            condition = rule["condition"]
            if dependency in one_shot:
                assert condition == "service_completed_successfully", (name, dependency)
            else:
                assert condition == "service_healthy", (name, dependency)
                assert "healthcheck" in SERVICES[dependency], (name, dependency)

    def needs(service: str) -> set[str]:
        return set(SERVICES[service].get("depends_on") or {})

    assert needs("minio-init") == {"minio"}
    assert needs("mlflow") == {"postgres", "minio-init"}
    assert needs("prefect-server") == {"postgres"}
    assert needs("prefect-worker") >= {"prefect-server", "mlflow"}
    assert SERVICES["minio-init"]["restart"] == "no"


def test_postgres_initialises_the_service_databases():
    volumes = SERVICES["postgres"]["volumes"]
    assert any(v.startswith("./postgres/init-databases.sh:/docker-entrypoint-initdb.d/") for v in volumes)
    env = environment("postgres")
    for service in ("MLFLOW", "PREFECT", "OPTUNA", "LOCKS"):  # the passwords init-databases.sh reads
        assert REFERENCE.fullmatch(env[f"{service}_DB_PASSWORD"])
    assert "locks" in env["XBN_DATABASES"].split()


def test_every_registry_writer_holds_the_locks_in_one_database_the_host_can_reach():
    """The MLflow server offers no lock: the containers that run xbn name the locks database, and postgres is
    published on loopback so that a reviewer's `xbn registry rollback` on the host takes the same lock."""
    for name in ("trainer", "prefect-worker"):
        assert re.fullmatch(r"postgresql\+psycopg2://locks:\$\{LOCKS_DB_PASSWORD[^}]*\}@postgres:5432/locks",
                            environment(name)["XBN_LOCK_URI"]), name
    assert SERVICES["postgres"]["ports"] == ["127.0.0.1:${XBN_POSTGRES_HOST_PORT:-5433}:5432"]
    readme = (ROOT / "infra" / "README.md").read_text()
    assert "export XBN_LOCK_URI=postgresql+psycopg2://locks:" in readme


def test_minio_buckets_job():
    job = SERVICES["minio-init"]
    assert job["image"].startswith("minio/mc:") and SERVICES["minio"]["image"].startswith("minio/minio:")
    script_path = job["entrypoint"][-1]
    mount = next(v for v in job["volumes"] if v.split(":")[1] == script_path)
    script = (INFRA / mount.split(":")[0]).read_text()
    assert "mc mb --ignore-existing" in script and 'mc version enable "xbn/$bucket"' in script  # versioned


def test_one_storage_key_per_bucket_and_none_for_the_mlflow_bucket_outside_the_server():
    """Issue 41 item 2: the MLflow server alone holds the mlflow bucket's key (artifacts are proxied); DVC's
    key reaches bucket dvc only, without delete; both buckets versioned; no s3:* anywhere."""
    script = (INFRA / "minio/create-buckets.sh").read_text()
    assert "s3:*" not in script and "s3:*" not in COMPOSE_TEXT
    grants = dict(re.findall(r'^grant (\w+) "\$\w+".*?\n\s*\'(\[[^\]]*\])\'', script, re.M | re.S))
    assert set(grants) == {"mlflow", "dvc"}, grants
    assert "s3:DeleteObject" in grants["mlflow"] and "s3:DeleteObject" not in grants["dvc"]
    assert not any("Delete" in action for action in re.findall(r'"(s3:\w+)"', grants["dvc"]))
    example = env_example()
    assert example["S3_MLFLOW_ACCESS_KEY_ID"] != example["S3_DVC_ACCESS_KEY_ID"]
    job = environment("minio-init")
    assert {k for k in job if k.startswith("S3_")} == {
        "S3_MLFLOW_ACCESS_KEY_ID", "S3_MLFLOW_SECRET_ACCESS_KEY", "S3_DVC_ACCESS_KEY_ID", "S3_DVC_SECRET_ACCESS_KEY"}

    def key_of(service: str) -> str | None:
        found = REFERENCE.fullmatch(environment(service).get("AWS_ACCESS_KEY_ID", ""))
        return found.group(1) if found else None

    assert key_of("mlflow") == "S3_MLFLOW_ACCESS_KEY_ID"
    for service in set(SERVICES) - {"mlflow", "minio-init"}:
        assert "S3_MLFLOW" not in str(SERVICES[service]), f"{service} holds the mlflow bucket's key"
    for service in ("trainer", "prefect-worker"):
        assert key_of(service) == "S3_DVC_ACCESS_KEY_ID", service
        assert REFERENCE.fullmatch(environment(service)["AWS_SECRET_ACCESS_KEY"]).group(1) == \
            "S3_DVC_SECRET_ACCESS_KEY"


def test_mlflow_server():
    mlflow = SERVICES["mlflow"]
    command = " ".join(mlflow["command"])
    assert command.startswith("mlflow server") and "--artifacts-destination=s3://mlflow" in command
    assert "--allowed-hosts=${MLFLOW_ALLOWED_HOSTS" in command
    env = environment("mlflow")
    # psycopg2 named: SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3, which is not installed.
    assert re.fullmatch(r"postgresql\+psycopg2://mlflow:\$\{MLFLOW_DB_PASSWORD[^}]*\}@postgres:5432/mlflow",
                        env["MLFLOW_BACKEND_STORE_URI"])
    assert env["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    assert "mlflow:5000" in env_example()["MLFLOW_ALLOWED_HOSTS"].split(",")
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"  # no job runner: xbn submits no MLflow jobs
    # Issue 41: authenticated, nothing allowed that no grant names, secrets from the environment only.
    assert "--app-name=basic-auth" in mlflow["command"]
    ini = (INFRA / "mlflow/basic_auth.ini").read_text()
    settings = [line for line in ini.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert "default_permission = NO_PERMISSIONS" in settings
    assert not any(line.startswith("admin_password") for line in settings)  # MLFLOW_AUTH_ADMIN_PASSWORD
    assert "database_uri = postgresql+psycopg2://mlflow_auth@postgres:5432/mlflow_auth" in settings  # PGPASSWORD
    # A password check is cached for at most a minute: the revocation delay infra/README.md promises.
    assert "auth_cache_ttl_seconds = 60" in settings
    assert env["MLFLOW_AUTH_CONFIG_PATH"] == "/etc/mlflow/basic_auth.ini"
    assert "./mlflow/basic_auth.ini:/etc/mlflow/basic_auth.ini:ro" in mlflow["volumes"]
    for key in ("MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY", "PGPASSWORD"):
        assert REFERENCE.fullmatch(env[key]), key
    # Every process that trains signs in as the pipeline's account; the accounts job creates it first.
    trainer = environment("trainer")
    assert trainer["MLFLOW_TRACKING_USERNAME"].startswith("${XBN_PIPELINE_USER")
    assert REFERENCE.fullmatch(trainer["MLFLOW_TRACKING_PASSWORD"])
    accounts = " ".join(SERVICES["mlflow-accounts"]["command"])
    assert "xbn.tracking.accounts" in accounts and {"pipeline:", "reviewer:", "reader:"} <= {
        a.split("=", 1)[1].split("$")[0] for a in SERVICES["mlflow-accounts"]["command"] if a.startswith("--account")}


def test_prefect_server_and_worker():
    env = environment("prefect-server")
    assert re.fullmatch(r"postgresql\+asyncpg://prefect:\$\{PREFECT_DB_PASSWORD[^}]*\}@postgres:5432/prefect",
                        env["PREFECT_API_DATABASE_CONNECTION_URL"])
    assert SERVICES["prefect-server"]["command"][:3] == ["prefect", "server", "start"]
    # The leases survive a restart (the live test restarts a server configured the same way).
    assert env["PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE"] == LEASE_STORAGE
    assert f"prefect-home:{env['PREFECT_HOME']}" in SERVICES["prefect-server"]["volumes"]

    worker = SERVICES["prefect-worker"]
    assert worker["build"]["dockerfile"] == "infra/Dockerfile"
    assert worker["image"] == SERVICES["trainer"]["image"]
    worker_env = environment("prefect-worker")
    assert worker_env["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert worker_env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert worker_env["XBN_WORKDIR"] == "/app"  # prefect.yaml's pull step changes into $XBN_WORKDIR
    script = INFRA / "prefect/worker.sh"
    assert worker["command"][:2] == ["bash", "infra/prefect/worker.sh"] and script.is_file()
    pool = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"][0]["work_pool"]["name"]
    assert pool == "xbn-process" and f"pool={pool}" in script.read_text()


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def ignored(dockerignore: Path, relative: str) -> bool:
    """Whether the context filter drops `relative` (last matching rule wins; ! re-includes)."""
    result = False
    for rule in dockerignore.read_text().splitlines():
        rule = rule.strip()
        if not rule or rule.startswith("#"):
            continue
        negate, pattern = rule.startswith("!"), rule.lstrip("!")
        parts = relative.split("/")
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        patterns = (pattern, pattern.removeprefix("**/"))
        if any(fnmatch.fnmatch(p, pat) for p in prefixes for pat in patterns):
            result = not negate
    return result


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "services.Dockerfile"])
def test_images_copy_only_what_exists_and_their_context_keeps_the_venv_out(dockerfile):
    path = INFRA / dockerfile
    ignore = INFRA / f"{dockerfile}.dockerignore"  # BuildKit's per-Dockerfile ignore file
    for relative in (".venv/bin/python", ".git/HEAD", "data/glyphs/x.png", "mlflow.db"):
        assert ignored(ignore, relative), f"{relative} would be sent to the {dockerfile} build"
    for instruction, args in dockerfile_instructions(path):
        if instruction == "COPY" and "--from" not in args:
            *sources, _ = args.split()
            for source in sources:
                if source != ".":
                    assert (ROOT / source).exists(), f"{dockerfile} copies missing {source}"
                    assert not ignored(ignore, source), f"{dockerfile} copies {source}, not in its context"


def test_training_image():
    instructions = dockerfile_instructions(INFRA / "Dockerfile")
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for i, a in instructions if i == "ARG" and "=" in a}
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-(cudnn-)?runtime-ubuntu\d+\.\d+", args["CUDA_IMAGE"])
    assert ("FROM", "${CUDA_IMAGE}") in instructions
    runs = " ".join(a for i, a in instructions if i == "RUN")
    assert "python3.11 -m venv" in runs
    assert "pip install -r requirements/lock.txt -r infra/requirements-s3.txt" in runs
    assert "pip install --no-deps --no-build-isolation ." in runs
    # faiss-gpu replaces faiss-cpu: uninstalled first, since both own the same `faiss` module files.
    swap = runs.index("pip uninstall -y faiss-cpu")
    assert runs.index("pip install -r requirements/lock.txt") < swap < runs.index(
        "pip install -r infra/requirements-gpu.txt")
    assert "faiss-gpu==" in (INFRA / "requirements-gpu.txt").read_text()
    assert ("USER", "xbn") in instructions
    ignore = INFRA / "Dockerfile.dockerignore"
    for needed in ("src/xbn/__init__.py", "pyproject.toml", "README.md", "params.yaml", "prefect.yaml",
                   "pipelines/retrain.py", "infra/prefect/worker.sh", "dvc.yaml", ".dvc/config"):
        assert (ROOT / needed).exists() and not ignored(ignore, needed), needed


def test_s3_requirements_are_pinned_and_not_in_the_lock():
    lock = {line.split("==")[0].lower() for line in (ROOT / "requirements/lock.txt").read_text().splitlines()
            if "==" in line}
    pins = [line for line in (INFRA / "requirements-s3.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9_.-]+==[\w.]+", p) for p in pins), pins
    names = {p.split("==")[0].lower() for p in pins}
    assert {"boto3", "dvc-s3"} <= names and not names & lock, "pinned twice: " + str(names & lock)
