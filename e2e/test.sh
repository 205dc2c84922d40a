#!/usr/bin/env bash
# Runs the end-to-end tests against the local control plane: brings it up when it is not
# up, and takes it down afterwards when this script started it (KEEP_CLUSTER=1 keeps it).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
started=0
if ! "$here/cluster.sh" status >/dev/null 2>&1; then
  "$here/cluster.sh" up
  started=1
fi
finish() {
  local rc=$?
  if [ "$started" = 1 ] && [ "${KEEP_CLUSTER:-0}" != 1 ]; then
    "$here/cluster.sh" down
  elif [ "$started" = 1 ]; then
    echo "[e2e] KEEP_CLUSTER=1: the cluster stays up (make cluster-down stops it)" >&2
  fi
  exit $rc
}
trap finish EXIT
cargo test --locked --manifest-path "$here/../Cargo.toml" -p ringmaster-e2e --tests -- --test-threads="${TEST_THREADS:-2}" "$@"
