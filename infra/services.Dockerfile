# syntax=docker/dockerfile:1
# The MLflow and Prefect servers of infra/compose.yaml: no CUDA, no torch; mlflow, prefect and their
# dependencies at the versions of requirements/lock.txt (the clients' versions, fastapi<0.151 included),
# psycopg2/asyncpg for PostgreSQL and boto3 for the s3:// artifact store. Build from the repository root:
#
#   docker build -f infra/services.Dockerfile -t xbn-services .
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    DO_NOT_TRACK=1

COPY requirements/lock.txt /tmp/requirements/lock.txt
COPY infra/requirements-s3.txt /tmp/requirements/requirements-s3.txt
RUN pip install -c /tmp/requirements/lock.txt -c /tmp/requirements/requirements-s3.txt \
        "mlflow[auth]" prefect fastapi psycopg2-binary asyncpg boto3 \
 && useradd --create-home --uid 10001 --user-group xbn

USER xbn
WORKDIR /home/xbn
EXPOSE 5000 4200
