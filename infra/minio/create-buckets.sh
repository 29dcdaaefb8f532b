#!/bin/sh
# One-shot job (minio/mc image): create the buckets MLflow and DVC use, and an access key limited to them for
# the MLflow server, the trainer and DVC (the root credentials stay with this job and the MinIO console).
# Safe to run again: existing buckets, user and policy are kept or updated.
set -eu
: "${MINIO_ROOT_USER:?}" "${MINIO_ROOT_PASSWORD:?}" "${S3_ACCESS_KEY_ID:?}" "${S3_SECRET_ACCESS_KEY:?}"
endpoint="${MINIO_ENDPOINT:-http://minio:9000}"
buckets="${XBN_BUCKETS:-mlflow dvc}"

mc alias set xbn "$endpoint" "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD" >/dev/null
resources=""
for bucket in $buckets; do
    mc mb --ignore-existing "xbn/$bucket"
    resources="$resources\"arn:aws:s3:::$bucket\",\"arn:aws:s3:::$bucket/*\","
done

policy=/tmp/xbn-buckets.json
cat > "$policy" <<JSON
{"Version": "2012-10-17",
 "Statement": [{"Effect": "Allow", "Action": ["s3:*"], "Resource": [${resources%,}]}]}
JSON
mc admin policy create xbn xbn-buckets "$policy"
mc admin user add xbn "$S3_ACCESS_KEY_ID" "$S3_SECRET_ACCESS_KEY"
# Attaching a policy the user already has is an error in mc: check first.
if ! mc admin user info xbn "$S3_ACCESS_KEY_ID" | grep -q 'xbn-buckets'; then
    mc admin policy attach xbn xbn-buckets --user "$S3_ACCESS_KEY_ID"
fi
echo "buckets ready: $buckets"
