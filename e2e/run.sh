#!/usr/bin/env bash
# `make run`: the operator on the local cluster, doing its job on a sample.
#   1. brings the local control plane up (e2e/cluster.sh up)
#   2. installs the CRDs
#   3. starts the operator (logs here; Ctrl-C stops it, the cluster stays up)
#   4. applies SAMPLE (default: config/samples/trainingjob-cpu-small.yaml) on the real node
#      (a TrainingJob gets the node's locally built image and its toleration), then follows the
#      job until it ends and shows `kubectl get trainingjobs -o wide`
# EXIT_WHEN_DONE=1 stops the operator and leaves when the job has ended (exit 1 if it failed);
# otherwise the operator keeps running until Ctrl-C.
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
"$CARGO_TARGET_DIR/debug/ringmaster" run --metrics-bind-address "$metrics" \
  --stager-image ringmaster.local/ringmaster:e2e &
operator=$!
trap 'kill $operator 2>/dev/null; wait $operator 2>/dev/null' EXIT INT TERM
for _ in $(seq 100); do
  curl -fsS "http://$metrics/readyz" >/dev/null 2>&1 && break
  kill -0 $operator 2>/dev/null || { echo "[run] the operator exited; see its log above" >&2; exit 1; }
  sleep 0.2
done

echo "[run] applying $sample" >&2
# A TrainingJob sample runs on the real node (e2e/node.sh): its image is the one built there,
# and its pods tolerate and select that node. Anything else is applied as it is.
placement='{"nodeSelector":{"ringmaster.dev/real-node":"true"},"tolerations":[{"key":"ringmaster.dev/real-node","operator":"Exists","effect":"NoSchedule"}]}'
if grep -q '^kind: TrainingJob' "$root/$sample"; then
  "${kubectl[@]}" patch --local -f "$root/$sample" --type merge -o yaml \
    -p "{\"spec\":{\"image\":\"ringmaster.local/ringmaster-trainer:e2e\",\"worker\":$placement,\"launcher\":$placement}}" \
    | "${kubectl[@]}" apply -f -
else
  "${kubectl[@]}" apply -f "$root/$sample"
fi
cat >&2 <<HINT
[run] watch it from another terminal:
  export KUBECONFIG=$KUBECONFIG
  $bin/kubectl get trainingjobs,datastages -A -o wide
  $bin/kubectl describe -f $root/$sample
  $bin/kubectl get events --field-selector involvedObject.kind=TrainingJob
[run] Ctrl-C stops the operator; \`make cluster-down\` stops the cluster.
HINT
# Follow the TrainingJob: each phase it passes through, then the table with its images/s.
if grep -q '^kind: TrainingJob' "$root/$sample"; then
  name=$(sed -n 's/^  name: //p' "$root/$sample" | head -1)
  started=$SECONDS last=
  while kill -0 $operator 2>/dev/null; do
    phase=$("${kubectl[@]}" get trainingjob "$name" -o jsonpath='{.status.phase}' 2>/dev/null || true)
    if [ -n "$phase" ] && [ "$phase" != "$last" ]; then
      echo "[run] $name: $phase after $((SECONDS - started)) s" >&2
      last=$phase
    fi
    case $phase in Succeeded|Failed) break ;; esac
    sleep 1
  done
  "${kubectl[@]}" get trainingjob "$name" -o wide
  if [ "${EXIT_WHEN_DONE:-0}" = 1 ]; then
    [ "$last" = Succeeded ]
    exit
  fi
fi
wait $operator
