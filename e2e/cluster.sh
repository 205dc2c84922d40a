#!/usr/bin/env bash
# Ringmaster's local Kubernetes control plane: upstream etcd, kube-apiserver,
# kube-controller-manager and kube-scheduler built from source (tools/build.sh), run by
# `kwokctl --runtime binary`, with KWOK playing AKS-shaped nodes (kwok/stages.yaml), and one
# real node (node.sh: kubelet, containerd, runc) where pods that tolerate it really run.
# Everything listens on 127.0.0.1, except what pods on the real node must reach (node.sh).
#
#   e2e/cluster.sh up       start it (a no-op when it is up); writes e2e/.state/kubeconfig
#   e2e/cluster.sh down     stop every process it started and remove its state
#   e2e/cluster.sh status   say whether it is up (every component running, the API ready)
#   e2e/cluster.sh report   which components died, and the tail of each one's log
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
state="$here/.state"
name=ringmaster
kubeconfig="$state/kubeconfig"
export KWOK_WORKDIR="$state/kwok"
# The Rust helpers (kwok-nodes here) read these at run time: binaries in the shared cargo
# target directory are built by every checkout, so they cannot know which one they serve.
export RINGMASTER_REPO_ROOT="$root" RINGMASTER_KUBECONFIG="$kubeconfig"
# shellcheck source=tools/ports.sh
source "$here/tools/ports.sh"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-${RINGMASTER_CACHE:-$HOME/.cache/ringmaster}/target}

log() { printf '[cluster] %s\n' "$*" >&2; }

binaries() { "$here/tools/build.sh"; }

components=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok-controller)

# The components kwokctl started whose process is gone (kwokctl never restarts one).
dead_components() {
  local c pid
  for c in "${components[@]}"; do
    pid=$(cat "$KWOK_WORKDIR/clusters/$name/pids/$c.pid" 2>/dev/null || true)
    { [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; } || echo "$c"
  done
}

healthy() {
  [ -f "$kubeconfig" ] || return 1
  [ -z "$(dead_components)" ] || return 1
  "$bin/kubectl" --kubeconfig "$kubeconfig" get --raw /readyz >/dev/null 2>&1
}

# What a failed test run needs to tell a broken cluster from a broken operator: which
# components died and the last lines of every component's log.
report() {
  local dir="$KWOK_WORKDIR/clusters/$name" dead c
  [ -d "$dir" ] || { log "not running: nothing to report"; return 0; }
  dead=$(dead_components | tr '\n' ' ')
  if [ -n "$dead" ]; then log "DEAD components: $dead(a test that waits on them times out)"; else log "every component is running"; fi
  for c in "${components[@]}"; do
    log "last lines of $c.log:"
    tail -n "${REPORT_LINES:-15}" "$dir/logs/$c.log" 2>/dev/null | cut -c1-400 >&2 || true
  done
}

kwok_nodes() {
  cargo run --quiet --locked --manifest-path "$root/Cargo.toml" -p ringmaster-e2e --bin kwok-nodes -- "$@"
}

usage_hint() {
  cat >&2 <<HINT
[cluster] up: Kubernetes $("$bin/kubectl" --kubeconfig "$kubeconfig" version -o json 2>/dev/null | sed -n 's/.*"gitVersion": "\(v[^"]*\)".*/\1/p' | tail -1) at https://127.0.0.1:$api_port
  export KUBECONFIG=$kubeconfig
  $bin/kubectl get nodes -L kubernetes.azure.com/agentpool,node.kubernetes.io/instance-type
  logs: $KWOK_WORKDIR/clusters/$name/logs/
HINT
}

up() {
  bin=$(binaries)
  if healthy; then
    log "already up"
    usage_hint
    return 0
  fi
  if [ -d "$KWOK_WORKDIR/clusters/$name" ]; then
    # A stopped cluster, or one with a dead component: everything it started goes, the
    # real node included (its kubelet would not register again with a new etcd).
    log "removing a stopped or broken cluster (dead: $(dead_components | tr '\n' ' '))"
    down
  fi
  mkdir -p "$state"
  rm -f "$kubeconfig"
  log "starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok-controller"
  local start=$SECONDS
  # kwokctl v0.8.0 files a component's later --extra-args under the index of its first one in
  # the list: a component's first argument must come before any second argument of another,
  # so the API server's and KWOK's later arguments go last. The real node's kubelet is reached
  # at its InternalIP (its hostname resolves nowhere); the API server advertises the address
  # node.sh relays to it for pods; KWOK plays only the nodes annotated as its own. Owner
# references are enforced as on OpenShift: blockOwnerDeletion needs the right to update the
# owner's finalizers (the chart's RBAC is tested under it). bench-operator counts
  # the requests of the ServiceAccounts of namespace ringmaster-bench (kwok/audit-policy.yaml).
  # The controller manager and the scheduler run without leader election: there is one of
  # each, and with it a stall of the API server or etcd longer than the lease's renew
  # deadline (10 s, as when a loaded machine holds back etcd's fsync) made both exit for good,
  # leaving every later pod without its ServiceAccount or node.
  "$bin/kwokctl" create cluster --name "$name" --runtime binary \
    --kube-apiserver-binary "$bin/kube-apiserver" \
    --kube-controller-manager-binary "$bin/kube-controller-manager" \
    --kube-scheduler-binary "$bin/kube-scheduler" \
    --etcd-binary "$bin/etcd" \
    --kwok-controller-binary "$bin/kwok" \
    --kubeconfig "$kubeconfig" \
    -c "$here/kwok/stages.yaml" -c "$here/kwok/kwokctl.yaml" \
    --kube-authorization=true \
    --disable-qps-limits \
    --kube-apiserver-port "$api_port" --etcd-port "$etcd_port" \
    --kube-controller-manager-port "$kcm_port" --kube-scheduler-port "$sched_port" --controller-port "$kwok_port" \
    --extra-args "kube-apiserver=bind-address=127.0.0.1" \
    --extra-args "kube-controller-manager=bind-address=127.0.0.1" \
    --extra-args "kube-scheduler=bind-address=127.0.0.1" \
    --extra-args "kwok-controller=server-address=127.0.0.1:$kwok_port" \
    --extra-args "etcd=listen-client-urls=http://127.0.0.1:$etcd_port" \
    --extra-args "etcd=advertise-client-urls=http://127.0.0.1:$etcd_port" \
    --extra-args "etcd=listen-peer-urls=http://127.0.0.1:$etcd_peer_port" \
    --extra-args "etcd=initial-advertise-peer-urls=http://127.0.0.1:$etcd_peer_port" \
    --extra-args "etcd=initial-cluster=node0=http://127.0.0.1:$etcd_peer_port" \
    --extra-args "kube-apiserver=kubelet-preferred-address-types=InternalIP" \
    --extra-args "kube-apiserver=advertise-address=10.244.0.1" \
    --extra-args "kube-apiserver=kubelet-client-certificate=$KWOK_WORKDIR/clusters/$name/pki/admin.crt" \
    --extra-args "kube-apiserver=kubelet-client-key=$KWOK_WORKDIR/clusters/$name/pki/admin.key" \
    --extra-args "kwok-controller=manage-all-nodes=false" \
    --extra-args "kwok-controller=manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake" \
    --extra-args "kube-apiserver=audit-policy-file=$here/kwok/audit-policy.yaml" \
    --extra-args "kube-apiserver=audit-log-path=$state/audit.log" \
    --extra-args "kube-apiserver=audit-log-maxsize=100000" \
    --extra-args "kube-apiserver=enable-admission-plugins=OwnerReferencesPermissionEnforcement" \
    --extra-args "kube-controller-manager=leader-elect=false" \
    --extra-args "kube-scheduler=leader-elect=false" \
    --wait 120s -v WARN
  log "control plane ready after $((SECONDS - start)) s; adding simulated AKS nodes"
  kwok_nodes add --pool system --vm-size Standard_D4s_v5 --count 2 --mode system
  kwok_nodes add --pool gpu --vm-size Standard_ND96asr_v4 --count 4 --mode user
  "$bin/kubectl" --kubeconfig "$kubeconfig" wait --for=condition=Ready node --all --timeout=60s >/dev/null
  # The default ServiceAccount appears once the controller manager's token controller runs.
  for _ in $(seq 60); do
    "$bin/kubectl" --kubeconfig "$kubeconfig" get serviceaccount default -n default >/dev/null 2>&1 && break
    sleep 0.5
  done
  "$here/node.sh" up
  log "up in $((SECONDS - start)) s"
  usage_hint
}

down() {
  bin=$(binaries)
  local dir="$KWOK_WORKDIR/clusters/$name" pids=()
  # Kueue and the gang schedulers first (processes of their own, when a test started them),
  # then the real node: its containers, mounts and network go before the state folder does.
  "$here/kueue.sh" down >/dev/null 2>&1 || true
  "$here/gang-scheduler.sh" down >/dev/null 2>&1 || true
  "$here/volcano.sh" down >/dev/null 2>&1 || true
  "$here/node.sh" down
  if [ -d "$dir" ]; then
    for f in "$dir"/pids/*.pid; do [ -f "$f" ] && pids+=("$(cat "$f")"); done
    "$bin/kwokctl" delete cluster --name "$name" --kubeconfig "$kubeconfig" -v WARN || true
    # kwokctl sends SIGTERM and returns; wait for the processes so the ports are free again.
    for _ in $(seq 100); do
      alive=0
      for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
      [ "$alive" = 0 ] && break
      sleep 0.2
    done
    for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
  fi
  rm -rf "$state"
  log "down"
}

status() {
  bin=$(binaries)
  if healthy; then usage_hint; else log "not running"; return 1; fi
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  report) report ;;
  *) echo "usage: $0 up|down|status|report" >&2; exit 2 ;;
esac
