#!/bin/sh
# One-shot job (minio/mc image): the buckets MLflow and DVC use, versioned, and one access key per bucket, each
# limited to its own bucket (infra/README.md, "Accounts and keys"):
# - S3_MLFLOW_ACCESS_KEY_ID: the MLflow server only (artifacts are proxied through it: --serve-artifacts); read,
#   write and delete on bucket mlflow (MLflow's garbage collection deletes).
# - S3_DVC_ACCESS_KEY_ID: the trainer and the worker (the DVC remote): list, read and write on bucket dvc, and no
#   delete. With versioning on, an overwrite keeps the old object: a stolen DVC key cannot erase a snapshot.
# The root credentials stay with this job and the MinIO console. Safe to run again: existing buckets, users and
# policies are kept or updated.
set -eu
: "${MINIO_ROOT_USER:?}" "${MINIO_ROOT_PASSWORD:?}"
: "${S3_MLFLOW_ACCESS_KEY_ID:?}" "${S3_MLFLOW_SECRET_ACCESS_KEY:?}"
: "${S3_DVC_ACCESS_KEY_ID:?}" "${S3_DVC_SECRET_ACCESS_KEY:?}"
endpoint="${MINIO_ENDPOINT:-http://minio:9000}"
if [ "$S3_MLFLOW_ACCESS_KEY_ID" = "$S3_DVC_ACCESS_KEY_ID" ]; then
    echo "S3_MLFLOW_ACCESS_KEY_ID and S3_DVC_ACCESS_KEY_ID must differ: one key per bucket" >&2
    exit 1
fi

mc alias set xbn "$endpoint" "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD" >/dev/null

# grant BUCKET USER SECRET OBJECT_ACTIONS: the bucket (versioned), a policy xbn-BUCKET allowing list on the
# bucket and OBJECT_ACTIONS (a JSON list) on its objects, and the user holding that policy only.
grant() {
    bucket="$1" user="$2" secret="$3" actions="$4"
    mc mb --ignore-existing "xbn/$bucket"
    mc version enable "xbn/$bucket"
    policy="/tmp/xbn-$bucket.json"
    cat > "$policy" <<JSON
{"Version": "2012-10-17",
 "Statement": [
  {"Effect": "Allow", "Action": ["s3:ListBucket", "s3:GetBucketLocation", "s3:ListBucketMultipartUploads"],
   "Resource": ["arn:aws:s3:::$bucket"]},
  {"Effect": "Allow", "Action": $actions, "Resource": ["arn:aws:s3:::$bucket/*"]}]}
JSON
    mc admin policy create xbn "xbn-$bucket" "$policy"
    mc admin user add xbn "$user" "$secret"
    # Attaching a policy the user already has is an error in mc: check first.
    if ! mc admin user info xbn "$user" | grep -q "xbn-$bucket"; then
        mc admin policy attach xbn "xbn-$bucket" --user "$user"
    fi
    echo "bucket $bucket: versioned, key $user may $actions"
}

grant mlflow "$S3_MLFLOW_ACCESS_KEY_ID" "$S3_MLFLOW_SECRET_ACCESS_KEY" \
    '["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"]'
grant dvc "$S3_DVC_ACCESS_KEY_ID" "$S3_DVC_SECRET_ACCESS_KEY" \
    '["s3:GetObject", "s3:PutObject", "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"]'
