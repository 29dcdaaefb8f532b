#!/usr/bin/env bash
# Entry point of the prefect-worker service (training image): make sure the `xbn-process` work pool exists,
# deploy prefect.yaml's deployments (the weekly retrain) to the server at $PREFECT_API_URL, then run a process
# worker on that pool. Extra arguments go to `prefect worker start` (e.g. --limit 1, --run-once).
set -euo pipefail
: "${PREFECT_API_URL:?set PREFECT_API_URL (http://prefect-server:4200/api): without it Prefect would start a throwaway server}"
pool=xbn-process   # the work_pool of prefect.yaml
cd "${XBN_WORKDIR:-/app}"

if prefect work-pool inspect "$pool" >/dev/null 2>&1; then
    echo "worker.sh: work pool $pool exists"
else
    prefect work-pool create "$pool" --type process
fi
prefect deploy --all --no-prompt
exec prefect worker start --pool "$pool" --type process --name "xbn-worker-$(hostname)" "$@"
