#!/usr/bin/env bash
# Volcano (built from its Go module by tools/peers.sh) on the local cluster: its scheduler,
# named volcano as Volcano's chart installs it, and its controller manager with the two
# controllers the scheduler relies on (queue: opens queues; pg: keeps PodGroups' status), run
# as processes on this machine the way the control plane's own components are. Its CRDs are
# the module's own. Its admission webhooks are not run: nothing here relies on their defaults
# (Ringmaster names each PodGroup's queue or leaves it to the scheduler's default queue).
#
#   e2e/volcano.sh up       install the CRDs and start both (a no-op when they run); the
#                           cluster must be up
#   e2e/volcano.sh down     stop them (cluster.sh down does too); the CRDs stay
#   e2e/volcano.sh status   say whether they run
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tools/pidfile.sh
source "$here/tools/pidfile.sh"
state="$here/.state"
kubeconfig="$state/kubeconfig"
dir="$state/volcano"
# shellcheck source=tools/ports.sh
source "$here/tools/ports.sh"
scheduler_metrics=$volcano_scheduler_metrics scheduler_health=$volcano_scheduler_health
manager_metrics=$volcano_manager_metrics manager_health=$volcano_manager_health

log() { printf '[volcano] %s\n' "$*" >&2; }
kubectl() { "$("$here/tools/build.sh")/kubectl" --kubeconfig "$kubeconfig" "$@"; }

running() { pidfile_running "$dir/scheduler.pid" && pidfile_running "$dir/controller-manager.pid"; }

healthy() {
  curl -sf "http://127.0.0.1:$scheduler_health/healthz" >/dev/null 2>&1 &&
    curl -sf "http://127.0.0.1:$manager_health/healthz" >/dev/null 2>&1
}

# The default queue, made by the scheduler, opened by the queue controller: jobs can wait in
# it.
default_queue_open() {
  [ "$(kubectl get queues.scheduling.volcano.sh default -o jsonpath='{.status.state}' 2>/dev/null)" = Open ]
}

up() {
  if running && healthy; then
    log "already running (pids $(cat "$dir/scheduler.pid") $(cat "$dir/controller-manager.pid"))"
    return 0
  fi
  stop
  [ -f "$kubeconfig" ] || { log "the cluster is not up: e2e/cluster.sh up"; exit 1; }
  local bin start=$SECONDS
  bin=$("$here/tools/peers.sh" volcano)
  mkdir -p "$dir"
  kubectl apply --server-side --force-conflicts -f "$bin.crds.yaml" >/dev/null
  kubectl wait --for=condition=Established crd/podgroups.scheduling.volcano.sh \
    crd/queues.scheduling.volcano.sh --timeout=30s >/dev/null
  # The actions and plugins of Volcano's chart.
  cat > "$dir/scheduler.conf" <<CONFIG
actions: "enqueue, allocate, backfill"
tiers:
- plugins:
  - name: priority
  - name: gang
    enablePreemptable: false
  - name: conformance
- plugins:
  - name: overcommit
  - name: drf
    enablePreemptable: false
  - name: predicates
  - name: proportion
  - name: nodeorder
  - name: binpack
CONFIG
  setsid "$bin.controller-manager" --kubeconfig "$kubeconfig" --leader-elect=false \
    --controllers=queue-controller,pg-controller \
    --listen-address="127.0.0.1:$manager_metrics" \
    --enable-healthz --healthz-address="127.0.0.1:$manager_health" \
    >"$dir/controller-manager.log" 2>&1 </dev/null &
  echo $! > "$dir/controller-manager.pid"
  setsid "$bin" --kubeconfig "$kubeconfig" --leader-elect=false \
    --scheduler-conf="$dir/scheduler.conf" --cache-dumper=false \
    --listen-address="127.0.0.1:$scheduler_metrics" \
    --enable-healthz --healthz-address="127.0.0.1:$scheduler_health" \
    >"$dir/scheduler.log" 2>&1 </dev/null &
  echo $! > "$dir/scheduler.pid"
  for _ in $(seq 120); do
    running || { log "one exited; the logs:"; tail -10 "$dir"/*.log >&2; exit 1; }
    healthy && default_queue_open && {
      log "up in $((SECONDS - start)) s (scheduler volcano, logs in $dir)"
      return 0
    }
    sleep 0.5
  done
  log "not up within 60 s; the logs:"
  tail -10 "$dir"/*.log >&2
  exit 1
}

stop() {
  pidfile_stop "$dir/scheduler.pid"
  pidfile_stop "$dir/controller-manager.pid"
}

case "${1:-}" in
  up) up ;;
  down) stop; rm -rf "$dir"; log "down" ;;
  status) if running; then log "running"; else log "not running"; exit 1; fi ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
