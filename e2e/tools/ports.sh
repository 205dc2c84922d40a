# shellcheck shell=bash
# Every port the local cluster's processes listen on, in one place (sourced by cluster.sh,
# node.sh, kueue.sh, gang-scheduler.sh and volcano.sh).
#
# They count from RINGMASTER_PORT_BASE (default 26400: the API server is
# https://127.0.0.1:26443). The default lies below the kernel's ephemeral range
# (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 on Debian): a port inside it can be
# held as the local end of any outgoing connection on this machine (a kubectl, a test, the
# operator talking to the API server) at the moment a process here wants to listen on it,
# and that process then fails with "address already in use".
base=${RINGMASTER_PORT_BASE:-26400}
# cluster.sh: the control plane.
api_port=$((base + 43)) kwok_port=$((base + 47)) kcm_port=$((base + 57)) sched_port=$((base + 59))
etcd_port=$((base + 79)) etcd_peer_port=$((base + 80))
# node.sh: the real node.
kubelet_healthz=$((base + 48)) kubelet_port=$((base + 50))
proxy_metrics=$((base + 52)) proxy_healthz=$((base + 53)) netpol_metrics=$((base + 54))
# kueue.sh, gang-scheduler.sh, volcano.sh: the peers run beside the control plane.
kueue_webhook_port=$((base + 61)) kueue_health_port=$((base + 62))
gang_scheduler_port=$((base + 63))
volcano_scheduler_metrics=$((base + 64)) volcano_scheduler_health=$((base + 65))
volcano_manager_metrics=$((base + 66)) volcano_manager_health=$((base + 67))
