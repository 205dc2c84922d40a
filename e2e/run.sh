#!/usr/bin/env bash
# `make run`: the operator on the local cluster, doing its job on a sample.
#   1. brings the local control plane up (e2e/cluster.sh up)
#   2. installs the CRDs
#   3. starts the operator (logs here; Ctrl-C stops it, the cluster stays up)
#   4. applies SAMPLE (default: config/samples/trainingjob-cpu-small.yaml) and says how to watch it
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
sample=${SAMPLE:-config/samples/trainingjob-cpu-small.yaml}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-${RINGMASTER_CACHE:-$HOME/.cache/ringmaster}/target}
metrics=${METRICS_ADDR:-127.0.0.1:8080}

"$here/cluster.sh" up
bin=$("$here/tools/build.sh")
export KUBECONFIG="$here/.state/kubeconfig"
export RINGMASTER_REPO_ROOT="$root" RINGMASTER_KUBECONFIG="$KUBECONFIG"
kubectl=("$bin/kubectl")

echo "[run] installing CRDs" >&2
"${kubectl[@]}" apply --server-side --force-conflicts -f "$root/crds/" >/dev/null
"${kubectl[@]}" wait --for=condition=Established crd --all --timeout=30s >/dev/null

echo "[run] building and starting the operator (metrics on http://$metrics/metrics)" >&2
cargo build --quiet --locked --manifest-path "$root/Cargo.toml" -p ringmaster
"$CARGO_TARGET_DIR/debug/ringmaster" run --metrics-bind-address "$metrics" &
operator=$!
trap 'kill $operator 2>/dev/null; wait $operator 2>/dev/null' EXIT INT TERM
for _ in $(seq 100); do
  curl -fsS "http://$metrics/readyz" >/dev/null 2>&1 && break
  kill -0 $operator 2>/dev/null || { echo "[run] the operator exited; see its log above" >&2; exit 1; }
  sleep 0.2
done

echo "[run] applying $sample" >&2
"${kubectl[@]}" apply -f "$root/$sample"
cat >&2 <<HINT
[run] watch it from another terminal:
  export KUBECONFIG=$KUBECONFIG
  $bin/kubectl get trainingjobs,datastages -A
  $bin/kubectl describe -f $root/$sample
  $bin/kubectl get events --field-selector involvedObject.kind=TrainingJob
[run] Ctrl-C stops the operator; \`make cluster-down\` stops the cluster.
HINT
wait $operator
