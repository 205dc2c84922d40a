#!/usr/bin/env bash
# The scheduler-plugins scheduler (built from its Go module by tools/peers.sh) on the local
# cluster, run as a process on this machine the way the control plane's own kube-scheduler
# is, beside it: a second scheduler named scheduler-plugins-scheduler, as the
# scheduler-plugins chart installs it, with the Coscheduling plugin that gang-schedules the
# pods of a PodGroup. Its PodGroup CRD is the module's own.
#
#   e2e/gang-scheduler.sh up       install the CRD and start it (a no-op when it runs); the
#                                  cluster must be up
#   e2e/gang-scheduler.sh down     stop it (cluster.sh down does too); the CRD stays
#   e2e/gang-scheduler.sh status   say whether it runs
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tools/pidfile.sh
source "$here/tools/pidfile.sh"
state="$here/.state"
kubeconfig="$state/kubeconfig"
dir="$state/gang-scheduler"
# shellcheck source=tools/ports.sh
source "$here/tools/ports.sh"
port=$gang_scheduler_port
# The name the scheduler-plugins chart gives it, which TrainingJobs' pods then name.
scheduler_name=scheduler-plugins-scheduler
# How long it holds a gang's placed pods waiting for the rest (the chart's value; the
# plugin's default is 60 s).
permit_wait_seconds=${GANG_PERMIT_WAIT_SECONDS:-10}

log() { printf '[gang-scheduler] %s\n' "$*" >&2; }
kubectl() { "$("$here/tools/build.sh")/kubectl" --kubeconfig "$kubeconfig" "$@"; }

running() { pidfile_running "$dir/pid"; }

healthy() {
  curl -ksf "https://127.0.0.1:$port/healthz" >/dev/null 2>&1
}

up() {
  if running && healthy; then
    log "already running (pid $(cat "$dir/pid"))"
    return 0
  fi
  stop
  [ -f "$kubeconfig" ] || { log "the cluster is not up: e2e/cluster.sh up"; exit 1; }
  local bin start=$SECONDS
  bin=$("$here/tools/peers.sh" scheduler-plugins)
  mkdir -p "$dir/certs"
  kubectl apply --server-side --force-conflicts -f "$bin.crd.yaml" >/dev/null
  kubectl wait --for=condition=Established crd/podgroups.scheduling.x-k8s.io --timeout=30s >/dev/null
  cat > "$dir/config.yaml" <<CONFIG
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
leaderElection:
  leaderElect: false
clientConnection:
  kubeconfig: $kubeconfig
profiles:
- schedulerName: $scheduler_name
  plugins:
    multiPoint:
      enabled:
      - name: Coscheduling
    queueSort:
      enabled:
      - name: Coscheduling
      disabled:
      - name: "*"
  pluginConfig:
  - name: Coscheduling
    args:
      permitWaitingTimeSeconds: $permit_wait_seconds
CONFIG
  setsid "$bin" --config "$dir/config.yaml" --bind-address=127.0.0.1 --secure-port="$port" \
    --cert-dir="$dir/certs" >"$dir/scheduler.log" 2>&1 </dev/null &
  echo $! > "$dir/pid"
  for _ in $(seq 120); do
    running || { log "it exited; its log:"; tail -20 "$dir/scheduler.log" >&2; exit 1; }
    healthy && { log "up in $((SECONDS - start)) s as $scheduler_name (pid $(cat "$dir/pid"), log $dir/scheduler.log)"; return 0; }
    sleep 0.5
  done
  log "not healthy within 60 s; its log:"
  tail -20 "$dir/scheduler.log" >&2
  exit 1
}

stop() { pidfile_stop "$dir/pid"; }

case "${1:-}" in
  up) up ;;
  down) stop; rm -rf "$dir"; log "down" ;;
  status) if running; then log "running (pid $(cat "$dir/pid"))"; else log "not running"; exit 1; fi ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
