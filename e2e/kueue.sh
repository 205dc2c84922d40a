#!/usr/bin/env bash
# Kueue (built from its Go module by tools/peers.sh) on the local cluster, run as a process on
# this machine the way the control plane's components are, with TrainingJobs registered as
# an external framework.
#
#   e2e/kueue.sh up       install and start it (a no-op when it runs); the cluster must be up
#   e2e/kueue.sh down     stop it (cluster.sh down does too) and remove its webhook
#                         configurations (its CRDs stay: they hold no running parts)
#   e2e/kueue.sh status   say whether it runs
#
# Kueue's webhooks and certificates are as Kueue ships them: its CRDs and webhook
# configurations come from its own kustomization, and its internal certificate manager makes
# the CA and serving certificate for kueue-webhook-service.kueue-system.svc and puts the CA
# into the webhook configurations and the CRDs' conversion webhooks. Two things differ
# because the process is not a pod: the webhook Service is of type ExternalName, pointing at
# 127.0.0.1, where the API server (on this machine) reaches the process; the webhooks name
# the port the process listens on; and this script copies the certificate Secret into the
# process's certificate folder, as the kubelet would mount it into Kueue's pod (Kueue waits
# for the files before it serves). The API server still verifies the certificate against
# the Service's name.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tools/pidfile.sh
source "$here/tools/pidfile.sh"
state="$here/.state"
kubeconfig="$state/kubeconfig"
dir="$state/kueue"
# shellcheck source=tools/ports.sh
source "$here/tools/ports.sh"
webhook_port=$kueue_webhook_port health_port=$kueue_health_port
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-${RINGMASTER_CACHE:-$HOME/.cache/ringmaster}/target}
# The ringmaster.dev kind Kueue leaves to Ringmaster ("Kind.version.group").
external_framework=TrainingJob.v1alpha1.ringmaster.dev

log() { printf '[kueue] %s\n' "$*" >&2; }
kubectl() { "$("$here/tools/build.sh")/kubectl" --kubeconfig "$kubeconfig" "$@"; }

running() { pidfile_running "$dir/pid"; }

# Kueue answers through its webhooks: a server-side dry run of a ResourceFlavor passes them.
answering() {
  kubectl create --dry-run=server -f - >/dev/null 2>&1 <<'EOF'
apiVersion: kueue.x-k8s.io/v1beta2
kind: ResourceFlavor
metadata:
  name: kueue-sh-probe
EOF
}

# What the kubelet does for a pod's Secret volume: the Secret's keys as files. Kueue's
# certificate manager fills the Secret at start; false until it has.
mount_certificate() {
  local key value
  for key in tls.crt tls.key ca.crt; do
    value=$(kubectl get secret kueue-webhook-server-cert -n kueue-system \
      -o jsonpath="{.data.${key//./\\.}}" 2>/dev/null) || return 1
    [ -n "$value" ] || return 1
    printf '%s' "$value" | base64 -d > "$dir/certs/$key.tmp"
  done
  for key in tls.crt tls.key ca.crt; do mv "$dir/certs/$key.tmp" "$dir/certs/$key"; done
}

up() {
  if running && answering; then
    log "already running (pid $(cat "$dir/pid"))"
    return 0
  fi
  # One that runs but does not answer holds the ports: it goes first.
  stop
  [ -f "$kubeconfig" ] || { log "the cluster is not up: e2e/cluster.sh up"; exit 1; }
  local bin start=$SECONDS
  bin=$("$here/tools/peers.sh" kueue)
  mkdir -p "$dir/certs"
  sed "s/@WEBHOOK_PORT@/$webhook_port/" "$bin.manifests.yaml" > "$dir/manifests.yaml"
  kubectl apply --server-side --force-conflicts -f "$dir/manifests.yaml" >/dev/null
  kubectl apply --server-side -f - >/dev/null <<EOF
apiVersion: v1
kind: Service
metadata:
  name: kueue-webhook-service
  namespace: kueue-system
spec:
  type: ExternalName
  externalName: 127.0.0.1
EOF
  cat > "$dir/config.yaml" <<EOF
apiVersion: config.kueue.x-k8s.io/v1beta2
kind: Configuration
namespace: kueue-system
health:
  healthProbeBindAddress: 127.0.0.1:$health_port
metrics:
  bindAddress: "0"
webhook:
  host: 127.0.0.1
  port: $webhook_port
  certDir: $dir/certs
leaderElection:
  leaderElect: false
internalCertManagement:
  enable: true
  webhookServiceName: kueue-webhook-service
  webhookSecretName: kueue-webhook-server-cert
integrations:
  frameworks: ["batch/job"]
  externalFrameworks: ["$external_framework"]
# Kueue evicts an admitted Workload whose PodsReady is not True within this (30 minutes by
# default): short here, so a job that forgot to report its pods ready would be caught.
waitForPodsReady:
  timeout: 20s
EOF
  # The on-demand visibility API would listen on every interface; nothing here uses it.
  KUBECONFIG="$kubeconfig" setsid "$bin" --config "$dir/config.yaml" \
    --feature-gates=VisibilityOnDemand=false >"$dir/kueue.log" 2>&1 </dev/null &
  echo $! > "$dir/pid"
  local mounted=0
  for _ in $(seq 240); do
    running || { log "Kueue exited; its log:"; tail -20 "$dir/kueue.log" >&2; exit 1; }
    if [ "$mounted" = 0 ]; then
      mount_certificate && mounted=1
    fi
    answering && { log "up in $((SECONDS - start)) s (pid $(cat "$dir/pid"), log $dir/kueue.log)"; return 0; }
    sleep 0.5
  done
  log "Kueue did not answer through its webhooks within 120 s; its log:"
  tail -20 "$dir/kueue.log" >&2
  exit 1
}

stop() { pidfile_stop "$dir/pid"; }

down() {
  stop
  # Its webhooks would refuse every request they guard once nobody answers them.
  if [ -f "$kubeconfig" ] && [ -f "$dir/manifests.yaml" ]; then
    kubectl delete --ignore-not-found --wait=false \
      mutatingwebhookconfiguration/kueue-mutating-webhook-configuration \
      validatingwebhookconfiguration/kueue-validating-webhook-configuration >/dev/null 2>&1 || true
  fi
  rm -rf "$dir"
  log "down"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) if running; then log "running (pid $(cat "$dir/pid"))"; else log "not running"; exit 1; fi ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
