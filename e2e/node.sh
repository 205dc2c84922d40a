#!/usr/bin/env bash
# The local cluster's real node: a kubelet with containerd, runc and CNI on this machine,
# joined to the control plane cluster.sh runs, beside the KWOK nodes. Pods scheduled here
# really run: sshd answers, mpirun starts ranks over ssh, the trainer all-reduces, the stager
# copies. cluster.sh calls `up` after the control plane and `down` before it stops.
#
#   e2e/node.sh up       start CoreDNS, containerd, the kubelet, kube-proxy and the NetworkPolicy
#                        engine; import the images
#   e2e/node.sh down     stop them, remove every container, mount, network and rule they made
#
# The node is `real-node-0`, labelled `ringmaster.dev/real-node=true` and tainted
# `ringmaster.dev/real-node=true:NoSchedule`: only pods that ask for it land here.
#
# Networking stays on this machine: pods get addresses in 10.244.0.0/24 on the bridge
# `rmcni0` (10.244.0.1, made here, with no uplink), routes only to that subnet and to the
# Service range, no masquerading. The kubelet, CoreDNS and the tests' Azurite listen on
# 10.244.0.1 because a pod's own network namespace cannot reach the host's loopback; the
# kubelet also refuses a loopback node address. Every other listener stays on 127.0.0.1.
#
# NetworkPolicies are enforced for the node's pods by kube-network-policies (the Kubernetes
# SIG Network's engine, built by tools/peers.sh), run as a process like kube-proxy: the first
# packet of each connection to or from a pod a policy selects goes to it through an NFQUEUE,
# and it accepts or drops the connection by the policies.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
state="$here/.state/node"
kubeconfig="$here/.state/kubeconfig"
cluster_dir="$here/.state/kwok/clusters/ringmaster"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-${RINGMASTER_CACHE:-$HOME/.cache/ringmaster}/target}
node=real-node-0
bridge=rmcni0 subnet=10.244.0.0/24 gateway=10.244.0.1
# The Service range kwokctl gives the API server; pods route it to the host, where kube-proxy
# turns Service addresses into endpoints.
service_range=${RINGMASTER_SERVICE_RANGE:-10.0.0.0/24}
# shellcheck source=tools/ports.sh
source "$here/tools/ports.sh"
REAL_NODE_LABEL=ringmaster.dev/real-node

log() { printf '[node] %s\n' "$*" >&2; }

# shellcheck source=tools/need.sh
source "$here/tools/need.sh"
# shellcheck source=tools/pidfile.sh
source "$here/tools/pidfile.sh"

# start NAME COMMAND...: runs it in its own session, logging to $state/logs/NAME.log.
start() {
  local name=$1; shift
  setsid "$@" >"$state/logs/$name.log" 2>&1 </dev/null &
  echo $! >"$state/pids/$name.pid"
}

# wait_for WHAT SECONDS COMMAND...: polls until the command succeeds.
wait_for() {
  local what=$1 seconds=$2; shift 2
  for _ in $(seq $((seconds * 5))); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  log "$what did not come up in $seconds s; its log:"
  tail -30 "$state/logs/$what.log" >&2 || true
  return 1
}

kubectl() { "$bin/kubectl" --kubeconfig "$kubeconfig" "$@"; }
ctr() { "$bin/ctr" --address "$state/containerd/containerd.sock" --namespace k8s.io "$@"; }

images() {
  log "building ringmaster-trainer (release) and ringmaster for the node's image"
  cargo build --quiet --locked --manifest-path "$root/Cargo.toml" --release -p ringmaster-trainer
  cargo build --quiet --locked --manifest-path "$root/Cargo.toml" -p ringmaster --bin ringmaster
  "$here/tools/image.sh" "$CARGO_TARGET_DIR/release/ringmaster-trainer" "$CARGO_TARGET_DIR/debug/ringmaster"
}

node_certificate() {
  # The kubelet's identity as the Node authorizer expects it: system:node:<name> in system:nodes.
  local pki="$cluster_dir/pki" dir="$state/pki"
  mkdir -p "$dir"
  openssl req -new -newkey rsa:2048 -nodes -keyout "$dir/kubelet.key" -out "$dir/kubelet.csr" \
    -subj "/O=system:nodes/CN=system:node:$node" 2>/dev/null
  openssl x509 -req -in "$dir/kubelet.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
    -days 7 -out "$dir/kubelet.crt" 2>/dev/null
  local server; server=$(kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}')
  cat >"$state/kubelet.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters: [{name: local, cluster: {server: "$server", certificate-authority: "$pki/ca.crt"}}]
users: [{name: $node, user: {client-certificate: "$dir/kubelet.crt", client-key: "$dir/kubelet.key"}}]
contexts: [{name: local, context: {cluster: local, user: $node}}]
current-context: local
EOF
}

network() {
  ip link show "$bridge" >/dev/null 2>&1 || ip link add "$bridge" type bridge
  ip addr show dev "$bridge" | grep -q " $gateway/" || ip addr add "$gateway/24" dev "$bridge"
  ip link set "$bridge" up
  mkdir -p "$state/cni"
  # Pods route their subnet (on the bridge) and the Service range (to the host) and nothing
  # else: no default route, no masquerade.
  cat >"$state/cni/10-ringmaster.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "ringmaster-real-node",
  "plugins": [
    {"type": "bridge", "bridge": "$bridge", "isGateway": true, "ipMasq": false,
     "ipam": {"type": "host-local", "ranges": [[{"subnet": "$subnet", "gateway": "$gateway"}]],
              "routes": [{"dst": "$service_range"}],
              "dataDir": "$state/cni-ipam"}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
}

api_relay() {
  # The `kubernetes` Service's endpoint is the address the API server advertises, 10.244.0.1:
  # a TCP relay there hands connections to the API server on 127.0.0.1 (TLS passes through).
  local port; port=$(kubectl config view --minify -o jsonpath='{.clusters[0].cluster.server}')
  port=${port##*:}
  start api-relay socat "TCP-LISTEN:$port,bind=$gateway,fork,reuseaddr" "TCP:127.0.0.1:$port"
}

guard() {
  # Listeners on 10.244.0.1 answer this machine and its pods only, whatever reaches eth0.
  iptables -N RINGMASTER-NODE 2>/dev/null || iptables -F RINGMASTER-NODE
  iptables -A RINGMASTER-NODE -i lo -j RETURN
  iptables -A RINGMASTER-NODE -i "$bridge" -j RETURN
  iptables -A RINGMASTER-NODE -d "$subnet" -j DROP
  iptables -C INPUT -j RINGMASTER-NODE 2>/dev/null || iptables -I INPUT -j RINGMASTER-NODE
}

unguard() {
  iptables -D INPUT -j RINGMASTER-NODE 2>/dev/null || true
  iptables -F RINGMASTER-NODE 2>/dev/null || true
  iptables -X RINGMASTER-NODE 2>/dev/null || true
}

coredns() {
  # Kubernetes' DNS for pods on the real node (headless Services' per-pod names: the hostfile
  # and the readiness probe use them). Names outside cluster.local are refused, not forwarded.
  cat >"$state/Corefile" <<EOF
cluster.local:53 in-addr.arpa:53 {
  bind $gateway
  errors
  kubernetes cluster.local in-addr.arpa {
    kubeconfig $kubeconfig
  }
}
EOF
  start coredns "$bin/coredns" -conf "$state/Corefile"
}

containerd() {
  mkdir -p "$state/containerd"
  cat >"$state/containerd/config.toml" <<EOF
version = 3
root = "$state/containerd/root"
state = "$state/containerd/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.erofs"]
[grpc]
  address = "$state/containerd/containerd.sock"
[ttrpc]
  address = "$state/containerd/containerd.sock.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
[plugins."io.containerd.cri.v1.runtime"]
  netns_mounts_under_state_dir = true
  # Root here lacks CAP_SYS_RESOURCE, so runc cannot set the negative OOM scores the kubelet
  # asks for (-998 for the sandbox); this keeps them at containerd's own (0) instead.
  restrict_oom_score_adj = true
  # As containerd 1.7 (the AKS node images') leaves it: a user other than root opens no port
  # below 1024 unless the pod's own sysctls say so. containerd 2 opens them all by default,
  # which would hide what a job needs on AKS.
  enable_unprivileged_ports = false
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "$(command -v runc)"
        SystemdCgroup = false
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "$state/cni"
[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    sandbox = "ringmaster.local/pause:3.10"
EOF
  # The runc shim is found on PATH.
  PATH="$bin:$PATH" start containerd "$bin/containerd" --config "$state/containerd/config.toml"
  wait_for containerd 30 "$bin/ctr" --address "$state/containerd/containerd.sock" version
}

kubelet() {
  mkdir -p "$state/kubelet" "$state/pod-logs"
  : >"$state/resolv.conf"
  cat >"$state/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $gateway
port: $kubelet_port
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $kubelet_healthz
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: "$cluster_dir/pki/ca.crt"}
authorization: {mode: Webhook}
containerRuntimeEndpoint: unix://$state/containerd/containerd.sock
cgroupDriver: cgroupfs
# This machine has cgroup v1 (hybrid); kubelet 1.35+ refuses it unless told.
failCgroupV1: false
failSwapOn: false
clusterDomain: cluster.local
clusterDNS: [$gateway]
resolvConf: "$state/resolv.conf"
podLogsDir: "$state/pod-logs"
maxPods: 40
serializeImagePulls: false
# Images are imported, never pulled: nothing may collect them.
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}
nodeStatusUpdateFrequency: 4s
registerWithTaints:
- {key: $REAL_NODE_LABEL, value: "true", effect: NoSchedule}
EOF
  start kubelet "$bin/kubelet" --config "$state/kubelet.yaml" --kubeconfig "$state/kubelet.kubeconfig" \
    --root-dir "$state/kubelet" --cert-dir "$state/pki" --hostname-override "$node" \
    --node-ip "$gateway" --node-labels "$REAL_NODE_LABEL=true"
}

# The nftables table (family inet) kube-network-policies keeps: its default name.
netpol_table=kube-network-policies

netpol() {
  # Upstream runs it as a DaemonSet with the in-cluster configuration; here it is a process
  # with the cluster's kubeconfig (its patch reads $KUBECONFIG). It queues the connections of
  # the pods policies select only, and drops them when it is not running (upstream's default,
  # not --fail-open), as on a node where it runs. It also learns pod addresses from containerd
  # as an NRI plugin (containerd's socket, /var/run/nri/nri.sock), before the API server has
  # them.
  KUBECONFIG="$kubeconfig" start kube-network-policies "$netpol_bin" --hostname-override "$node" \
    --metrics-bind-address "127.0.0.1:$netpol_metrics"
  # Its table is there once its informers have synced: the policies in force from then on.
  wait_for kube-network-policies 60 nft list table inet "$netpol_table"
}

unnetpol() {
  kill_pidfile kube-network-policies
  # It removes its table on SIGINT only; whatever stopped it, the table goes.
  nft delete table inet "$netpol_table" 2>/dev/null || true
}

kube_proxy() {
  start kube-proxy "$bin/kube-proxy" --kubeconfig "$kubeconfig" --hostname-override "$node" \
    --proxy-mode iptables --cluster-cidr "$subnet" --conntrack-max-per-core 0 \
    --metrics-bind-address "127.0.0.1:$proxy_metrics" --healthz-bind-address "127.0.0.1:$proxy_healthz"
}

up() {
  bin=$("$here/tools/build.sh")
  if pidfile_running "$state/pids/kubelet.pid"; then
    log "already up"; return 0
  fi
  local started=$SECONDS
  need runc containernetworking-plugins catatonit debootstrap iptables conntrack socat nftables
  netpol_bin=$("$here/tools/peers.sh" kube-network-policies)
  local archive; archive=$(images)
  mkdir -p "$state/logs" "$state/pids"
  log "starting the real node $node: CoreDNS, containerd, kubelet, kube-proxy, kube-network-policies"
  node_certificate
  network
  guard
  api_relay
  coredns
  containerd
  log "importing the images"
  ctr images import --no-unpack=false "$archive" >/dev/null
  kubelet
  kube_proxy
  netpol
  wait_for kubelet 60 kubectl get node "$node"
  kubectl wait --for=condition=Ready node "$node" --timeout=90s >/dev/null \
    || { tail -30 "$state/logs/kubelet.log" >&2; return 1; }
  log "real node $node ready after $((SECONDS - started)) s"
}

# kill_pidfile NAME: stops a process started by `start` and waits for it.
kill_pidfile() { pidfile_stop "$state/pids/$1.pid"; }

down() {
  [ -d "$state" ] || { ip link del "$bridge" 2>/dev/null || true; return 0; }
  bin=$("$here/tools/build.sh")
  unnetpol
  kill_pidfile kube-proxy
  "$bin/kube-proxy" --cleanup >/dev/null 2>&1 || true
  kill_pidfile kubelet
  # Every container the kubelet left: kill its task, then remove it.
  if [ -S "$state/containerd/containerd.sock" ]; then
    for id in $(ctr tasks ls -q 2>/dev/null); do ctr tasks kill -s SIGKILL "$id" >/dev/null 2>&1 || true; done
    sleep 0.5
    for id in $(ctr tasks ls -q 2>/dev/null); do ctr tasks delete -f "$id" >/dev/null 2>&1 || true; done
    for id in $(ctr containers ls -q 2>/dev/null); do ctr containers delete "$id" >/dev/null 2>&1 || true; done
  fi
  kill_pidfile containerd
  pkill -9 -f "containerd-shim-runc-v2 .*$state/containerd" 2>/dev/null || true
  kill_pidfile coredns
  kill_pidfile api-relay
  unguard
  # Mounts the kubelet and containerd made (volumes, root filesystems, network namespaces).
  findmnt -rn -o TARGET | grep "^$state/" | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
  ip link del "$bridge" 2>/dev/null || true
  rm -rf "$state"
  log "real node down"
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
