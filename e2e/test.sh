#!/usr/bin/env bash
# Runs the end-to-end tests against the local control plane: brings it up when it is not
# up, and takes it down afterwards when this script started it (KEEP_CLUSTER=1 keeps it).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
# The tests find this checkout and its cluster at run time (the test binaries are shared by
# every checkout that builds into the same cargo target directory).
export RINGMASTER_REPO_ROOT="$root" RINGMASTER_KUBECONFIG="$here/.state/kubeconfig"
started=0
# stderr stays on the terminal: the first run builds the control plane here (minutes), and
# tools/build.sh says what it builds and how long it took.
if ! "$here/cluster.sh" status >/dev/null; then
  "$here/cluster.sh" up
  started=1
fi
finish() {
  local rc=$?
  # A failure caused by the cluster (a component that died) must be told apart from one
  # caused by the operator before the state, logs included, is removed.
  [ "$rc" = 0 ] || "$here/cluster.sh" report || true
  if [ "$started" = 1 ] && [ "${KEEP_CLUSTER:-0}" != 1 ]; then
    "$here/cluster.sh" down
  elif [ "$started" = 1 ]; then
    echo "[e2e] KEEP_CLUSTER=1: the cluster stays up (make cluster-down stops it)" >&2
  fi
  exit $rc
}
trap finish EXIT
cargo test --locked --manifest-path "$root/Cargo.toml" -p ringmaster-e2e --tests -- --test-threads="${TEST_THREADS:-2}" "$@"
