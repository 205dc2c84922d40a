#!/usr/bin/env bash
# Builds the peers Ringmaster's benchmarks and tests run beside it, from their published Go
# modules, into a cache outside the repository keyed by version (a binary already there is
# not rebuilt), and prints the binary's path on stdout:
#   e2e/tools/peers.sh mpi-operator   Kubeflow MPI Operator (github.com/kubeflow/mpi-operator)
#   e2e/tools/peers.sh azcopy         azcopy (github.com/Azure/azure-storage-azcopy/v10)
#   e2e/tools/peers.sh kueue          Kueue (sigs.k8s.io/kueue), which TrainingJobs queue in
#   e2e/tools/peers.sh scheduler-plugins
#                                     the scheduler-plugins scheduler (sigs.k8s.io/scheduler-
#                                     plugins), which gang-schedules TrainingJobs' pods
#   e2e/tools/peers.sh volcano        Volcano's scheduler (volcano.sh/volcano), which gang-
#                                     schedules TrainingJobs' pods in its queues, and its
#                                     controller manager (<binary>.controller-manager), whose
#                                     queue and PodGroup controllers keep their state
#   e2e/tools/peers.sh kube-network-policies
#                                     the NetworkPolicy engine the real node runs (sigs.k8s.io/
#                                     kube-network-policies), see e2e/node.sh
# The proxy here serves these exact versions but refuses their version lists, which
# `go install module@version` asks for, so each builds from a module of ours (its folder
# here pins the version). MPI Operator's CRD is copied beside its binary
# (<binary>.crd.yaml); Kueue's install, rendered from its own kustomization (config/default)
# and cut to what a controller run outside the cluster needs, too (<binary>.manifests.yaml,
# see e2e/kueue.sh); the PodGroup CRD the scheduler-plugins scheduler reads, too
# (<binary>.crd.yaml, see e2e/gang-scheduler.sh); Volcano's CRDs too (<binary>.crds.yaml,
# see e2e/volcano.sh). MPI Operator is patched in one place only: its health server listens
# on 127.0.0.1 instead of every interface, as servers here must. Volcano builds as its own
# main module (its replace lines are its go.mod's), save one: its API module, which its
# published module leaves out (a nested module of its repository), comes from the proxy at
# the version pinned below instead. kube-network-policies is patched as
# kube-network-policies/kube-network-policies.patch says (this kernel has no nftables queue
# expression; $KUBECONFIG).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${RINGMASTER_CACHE:-$HOME/.cache/ringmaster}
export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local
log() { printf '[peers] %s\n' "$*" >&2; }

# Kueue's own install (kustomize config/default, as its release manifests are made), kept to
# what Kueue run as a process on this machine needs: its namespace, CRDs, webhook
# configurations and the Secret its certificate manager fills. Its Deployment, RBAC and
# Services stay out (e2e/kueue.sh makes the webhook Service, pointing at the process). Every
# webhook's service reference gets the port the process serves on (@WEBHOOK_PORT@, filled in
# by e2e/kueue.sh) instead of 443.
kueue_manifests() {
  local kubectl
  kubectl="$("$here/build.sh")/kubectl"
  "$kubectl" kustomize "$1/config/default" |
    awk 'BEGIN { RS = "\n---\n"; ORS = "\n---\n" }
         /(^|\n)kind: (Namespace|CustomResourceDefinition|MutatingWebhookConfiguration|ValidatingWebhookConfiguration|Secret)\n/' |
    sed '/^ *name: kueue-webhook-service$/{n;s/^\( *\)namespace: kueue-system$/&\n\1port: @WEBHOOK_PORT@/}'
}

peer=${1:-}
case "$peer" in
  mpi-operator) module=github.com/kubeflow/mpi-operator package=$module/cmd/mpi-operator ;;
  azcopy) module=github.com/Azure/azure-storage-azcopy/v10 package=$module ;;
  kueue) module=sigs.k8s.io/kueue package=$module/cmd/kueue ;;
  scheduler-plugins) module=sigs.k8s.io/scheduler-plugins package=$module/cmd/scheduler ;;
  volcano) module=volcano.sh/volcano package=./cmd/scheduler ;;
  kube-network-policies) module=sigs.k8s.io/kube-network-policies package=$module/cmd ;;
  *) echo "usage: $0 mpi-operator|azcopy|kueue|scheduler-plugins|volcano|kube-network-policies" >&2; exit 2 ;;
esac
# Volcano v1.15.1 (DESIGN's) needs volcano.sh/apis v1.15.1, which the proxy does not serve;
# v1.14.1 builds with the served v1.14.0.
volcano_version=v1.14.1 volcano_apis_version=v1.14.0
if [ "$peer" = volcano ]; then
  version=$volcano_version
else
  version=$(sed -n "s|^require $module \(v[^ ]*\)$|\1|p" "$here/$peer/go.mod")
fi
[ -n "$version" ] || { log "no version of $module in $here/$peer/go.mod"; exit 1; }
out="$cache/bin/peers/$peer-$version"
# A patched peer is rebuilt when its patch changes.
[ ! -f "$here/$peer/$peer.patch" ] || out+="-$(sha256sum "$here/$peer/$peer.patch" | cut -c1-8)"
complete() {
  [ -x "$out" ] || return 1
  { [ "$peer" != kueue ] || [ -s "$out.manifests.yaml" ]; } &&
    { [ "$peer" != scheduler-plugins ] || [ -s "$out.crd.yaml" ]; } &&
    { [ "$peer" != volcano ] || { [ -x "$out.controller-manager" ] && [ -s "$out.crds.yaml" ]; }; }
}
if ! complete; then
  started=$SECONDS
  log "building $peer $version from $module (first time: a few minutes on 2 cores)"
  work=$(mktemp -d)
  trap 'chmod -R u+w "$work" 2>/dev/null; rm -rf "$work"' EXIT
  build_dir=$work
  if [ "$peer" != volcano ]; then
    cp "$here/$peer/go.mod" "$here/$peer/go.sum" "$here/$peer/tools.go" "$work/"
  fi
  if [ "$peer" = mpi-operator ]; then
    source_dir=$(cd "$work" && go mod download -json "$module@$version" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
    cp -r "$source_dir" "$work/src" && chmod -R u+w "$work/src"
    server="$work/src/cmd/mpi-operator/app/server.go"
    grep -q 'fmt.Sprintf(":%d", healthCheckPort)' "$server" || { log "the health server's address moved in $version: update the patch"; exit 1; }
    sed -i 's|fmt.Sprintf(":%d", healthCheckPort)|fmt.Sprintf("127.0.0.1:%d", healthCheckPort)|' "$server"
    (cd "$work" && go mod edit -replace "$module=./src")
    # Its CRD travels with the binary: bench-operator installs it.
    mkdir -p "$(dirname "$out")"
    cp "$work/src/manifests/base/kubeflow.org_mpijobs.yaml" "$out.crd.yaml"
  fi
  if [ "$peer" = kube-network-policies ]; then
    source_dir=$(cd "$work" && go mod download -json "$module@$version" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
    cp -r "$source_dir" "$work/src" && chmod -R u+w "$work/src"
    (cd "$work/src" && patch -s -p1 <"$here/$peer/$peer.patch") || { log "the patch no longer applies to $version: update it"; exit 1; }
    (cd "$work" && go mod edit -replace "$module=./src")
  fi
  if [ "$peer" = kueue ]; then
    source_dir=$(cd "$work" && go mod download -json "$module@$version" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
    mkdir -p "$(dirname "$out")"
    kueue_manifests "$source_dir" > "$out.manifests.yaml.tmp" || { log "rendering Kueue's manifests failed"; exit 1; }
    mv "$out.manifests.yaml.tmp" "$out.manifests.yaml"
  fi
  if [ "$peer" = scheduler-plugins ]; then
    source_dir=$(cd "$work" && go mod download -json "$module@$version" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
    mkdir -p "$(dirname "$out")"
    cp "$source_dir/config/crd/bases/scheduling.x-k8s.io_podgroups.yaml" "$out.crd.yaml"
  fi
  if [ "$peer" = volcano ]; then
    source_dir=$(cd "$work" && go mod download -json "$module@$version" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
    cp -r "$source_dir" "$work/src" && chmod -R u+w "$work/src"
    (cd "$work/src" && go mod edit -dropreplace volcano.sh/apis -require "volcano.sh/apis@$volcano_apis_version")
    mkdir -p "$(dirname "$out")"
    (cd "$work/src" && go build -trimpath -ldflags "-s -w" -o "$out.controller-manager" ./cmd/controller-manager >&2)
    for crd in "$work"/src/config/crd/volcano/bases/*.yaml; do echo "---"; cat "$crd"; done > "$out.crds.yaml"
    build_dir="$work/src"
  fi
  mkdir -p "$(dirname "$out")"
  (cd "$build_dir" && go build -trimpath -ldflags "-s -w" -o "$out" "$package" >&2)
  log "built $peer $version in $((SECONDS - started)) s"
fi
echo "$out"
