#!/usr/bin/env bash
# Builds the local control plane's binaries from upstream Go modules into a cache outside
# the repository, keyed by version; a binary already in the cache is not rebuilt.
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubectl,
#   kubelet, kube-proxy                                               (k8s.io/kubernetes)
#   etcd                                                              (go.etcd.io/etcd/server/v3)
#   kwok, kwokctl                                                     (sigs.k8s.io/kwok, patched: kwok/kwok.patch)
#   helm                                                              (helm.sh/helm/v3)
#   containerd, containerd-shim-runc-v2, ctr                          (github.com/containerd/containerd/v2)
#   coredns                                                           (github.com/coredns/coredns)
# Prints the folder holding them all on stdout (cluster.sh captures it); what it builds, and
# how long each build took, goes to stderr. Versions live in e2e/versions.env.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# Each step builds in a temporary module folder ($work); a failed step removes it too.
work=""
trap '[ -z "$work" ] || rm -rf "$work"' EXIT
# shellcheck source=../versions.env
source "$here/../versions.env"
cache=${RINGMASTER_CACHE:-$HOME/.cache/ringmaster}
bin="$cache/bin/k8s-$KUBERNETES_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION"
mkdir -p "$bin"
export CGO_ENABLED=0 GOFLAGS=-mod=mod GOTOOLCHAIN=local

log() { printf '[build] %s\n' "$*" >&2; }
# A build announces itself before it starts (go prints nothing while it compiles) and says
# how long it took when it is done.
building() { started=$SECONDS; log "building $*"; }
built() { log "built $1 in $((SECONDS - started)) s"; }

k8s_cmds=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy)
missing=()
for c in "${k8s_cmds[@]}"; do [ -x "$bin/$c" ] || missing+=("k8s.io/kubernetes/cmd/$c"); done
if [ ${#missing[@]} -gt 0 ]; then
  building "Kubernetes $KUBERNETES_VERSION: ${missing[*]##*/} (first time: about 5-15 minutes on 2 cores)"
  minor=${KUBERNETES_VERSION#v1.}; minor=${minor%%.*}
  work=$(mktemp -d); cp "$here/kubernetes/go.mod" "$here/kubernetes/tools.go" "$work/"
  [ -f "$here/kubernetes/go.sum" ] && cp "$here/kubernetes/go.sum" "$work/"
  (cd "$work" && go build -trimpath -tags selinux,notest \
    -ldflags "-s -w -X k8s.io/component-base/version.gitVersion=$KUBERNETES_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean" \
    -o "$bin/" "${missing[@]}" >&2)
  rm -rf "$work"
  built "Kubernetes $KUBERNETES_VERSION"
fi

if [ ! -x "$bin/etcd" ]; then
  building "etcd $ETCD_VERSION"
  work=$(mktemp -d); cp "$here/etcd/go.mod" "$here/etcd/tools.go" "$work/"
  [ -f "$here/etcd/go.sum" ] && cp "$here/etcd/go.sum" "$work/"
  (cd "$work" && go build -trimpath -ldflags "-s -w" -o "$bin/etcd" go.etcd.io/etcd/server/v3 >&2)
  rm -rf "$work"
  built "etcd $ETCD_VERSION"
fi

# KWOK is built from its module's source with kwok/kwok.patch applied (why: the patch's
# header), and built again when the patch changes.
kwok_patch="$here/kwok/kwok.patch"
kwok_stamp="$bin/kwok.patch.sha256"
if [ ! -x "$bin/kwok" ] || [ ! -x "$bin/kwokctl" ] ||
  [ "$(cat "$kwok_stamp" 2>/dev/null)" != "$(sha256sum <"$kwok_patch")" ]; then
  building "KWOK $KWOK_VERSION (with kwok/kwok.patch)"
  work=$(mktemp -d)
  source_dir=$(cd "$work" && GOFLAGS= go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" |
    sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
  cp -r "$source_dir" "$work/src" && chmod -R u+w "$work/src"
  (cd "$work/src" && patch -s -p1 <"$kwok_patch") ||
    { log "kwok/kwok.patch no longer applies to KWOK $KWOK_VERSION: update it"; exit 1; }
  (cd "$work/src" && go build -trimpath -ldflags "-s -w" -o "$bin/" ./cmd/kwok ./cmd/kwokctl >&2)
  rm -rf "$work"
  sha256sum <"$kwok_patch" >"$kwok_stamp"
  built "KWOK $KWOK_VERSION"
fi
if [ ! -x "$bin/helm" ] || ! "$bin/helm" version --short 2>/dev/null | grep -q "^$HELM_VERSION"; then
  building "Helm $HELM_VERSION"
  GOBIN="$bin" GOFLAGS= go install -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2
  built "Helm $HELM_VERSION"
fi
# The real node's runtime and the cluster's DNS (e2e/node.sh). runc and the CNI plugins are
# Debian's (installed by node.sh), as a distribution's kubelet would use them.
# (Versions are read into a variable first: `grep -q` closing the pipe early would fail it.)
if [ "$("$bin/containerd" --version 2>/dev/null || true)" != "containerd github.com/containerd/containerd/v2 $CONTAINERD_VERSION " ]; then
  building "containerd $CONTAINERD_VERSION"
  work=$(mktemp -d); cp "$here/containerd/go.mod" "$here/containerd/go.sum" "$here/containerd/tools.go" "$work/"
  (cd "$work" && go build -trimpath -tags "no_btrfs no_devmapper no_zfs" \
    -ldflags "-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION" \
    -o "$bin/" github.com/containerd/containerd/v2/cmd/containerd \
    github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
    github.com/containerd/containerd/v2/cmd/ctr >&2)
  rm -rf "$work"
  built "containerd $CONTAINERD_VERSION"
fi
if [ "$("$bin/coredns" -version 2>/dev/null | head -1 || true)" != "CoreDNS-${COREDNS_VERSION#v}" ]; then
  building "CoreDNS $COREDNS_VERSION"
  GOBIN="$bin" GOFLAGS= go install -trimpath -ldflags "-s -w" \
    "github.com/coredns/coredns@$COREDNS_VERSION" >&2
  built "CoreDNS $COREDNS_VERSION"
fi
echo "$bin"
