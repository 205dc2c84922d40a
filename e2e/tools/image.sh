#!/usr/bin/env bash
# Builds the real node's container images as an OCI image archive, without a Docker engine
# or a registry, for `ctr images import` (e2e/node.sh). Prints the archive's path on stdout;
# progress goes to stderr.
#
#   ringmaster.local/pause:3.10
#       the pod sandbox: Debian's static catatonit in pause mode (`catatonit -P`).
#   ringmaster.local/ringmaster-trainer:e2e        (runs as uid 1000, as the Dockerfile's)
#   ringmaster.local/ringmaster-trainer:e2e-root   (the same files, run as root)
#   ringmaster.local/ringmaster:e2e                (the same files, run as the Dockerfile's
#       operator image is: `ringmaster` as entrypoint, uid 65532; DataStage copy Jobs run it)
#   ringmaster.local/pytorch:e2e                   (uid 1000: a user's PyTorch image built on
#       the trainer's, as config/samples/pytorch-ddp/Dockerfile builds one: the same layers
#       plus PyTorch and the sample's train.py at /opt/ringmaster/samples/pytorch-ddp/)
#       layer 1: Debian bookworm from debootstrap, set up by trainer/image/setup.sh (the
#                script the Dockerfile's trainer stage runs) with MPICH added; cached by the
#                script's hash, made once (a few minutes: packages come from the Debian
#                mirror).
#       layer 2: /usr/local/bin/ringmaster-trainer and /usr/local/bin/ringmaster, the
#                binaries given; remade when they change.
#       pytorch's layer between them: Debian's python3-torch (PyTorch 1.13, CPU, built with
#                gloo) installed over layer 1, the files it made or changed; cached by layer
#                1's key. PyPI's only Linux x86_64 wheel of PyTorch is the CUDA one, which
#                pulls ~3 GB of NVIDIA libraries; the CPU wheels are on download.pytorch.org,
#                which this project's machines cannot reach.
#       pytorch's last layer: the samples' scripts (config/samples/pytorch-ddp).
#
# Usage: image.sh TRAINER_BINARY RINGMASTER_BINARY
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
cache=${RINGMASTER_CACHE:-$HOME/.cache/ringmaster}/images
trainer_bin=${1:?usage: image.sh TRAINER_BINARY RINGMASTER_BINARY}
ringmaster_bin=${2:?usage: image.sh TRAINER_BINARY RINGMASTER_BINARY}
setup="$root/trainer/image/setup.sh"
suite=bookworm
mirror=${RINGMASTER_DEBIAN_MIRROR:-http://deb.debian.org/debian}
extra_packages=(mpich)
mkdir -p "$cache"

log() { printf '[image] %s\n' "$*" >&2; }
sha() { sha256sum "$1" | cut -d' ' -f1; }
# Runs a command in root filesystem $1 with the host's resolver, /proc, and no service
# started by packages' scripts, its output to $2; on failure shows that output's tail and
# exits. The root filesystem is left as it was but for what the command did.
chroot_run() {
  local rootfs=$1 output=$2 status=0
  shift 2
  cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
  printf '#!/bin/sh\nexit 101\n' >"$rootfs/usr/sbin/policy-rc.d"
  chmod +x "$rootfs/usr/sbin/policy-rc.d"
  mount -t proc proc "$rootfs/proc"
  chroot "$rootfs" "$@" >"$output" 2>&1 || status=$?
  umount "$rootfs/proc"
  rm -f "$rootfs/usr/sbin/policy-rc.d"
  : >"$rootfs/etc/resolv.conf"
  if [ "$status" -ne 0 ]; then tail -30 "$output" >&2; exit 1; fi
}
# shellcheck source=need.sh
source "$here/need.sh"
need debootstrap catatonit

# Layer 1: the root filesystem. Its name holds what decides its contents.
base_key=$(printf '%s %s %s\n' "$suite" "${extra_packages[*]}" "$(sha "$setup")" | sha256sum | cut -c1-16)
base="$cache/trainer-base-$base_key.tar"
if [ ! -f "$base" ]; then
  started=$SECONDS
  log "making the trainer image's root filesystem: debootstrap $suite, then trainer/image/setup.sh (first time: a few minutes)"
  work=$(mktemp -d "$cache/rootfs.XXXXXX")
  trap 'umount "$work/rootfs/proc" 2>/dev/null || true; rm -rf "$work"' EXIT
  debootstrap --variant=minbase "$suite" "$work/rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
    || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
  cp "$setup" "$work/rootfs/tmp/setup.sh"
  chroot_run "$work/rootfs" "$work/setup.log" /bin/sh /tmp/setup.sh "${extra_packages[@]}"
  rm -f "$work/rootfs/tmp/setup.sh"
  rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/log/"*
  tar --numeric-owner --xattrs -C "$work/rootfs" -cf "$base.partial" .
  mv "$base.partial" "$base"
  rm -rf "$work"; trap - EXIT
  log "root filesystem made in $((SECONDS - started)) s ($(du -h "$base" | cut -f1))"
fi

# PyTorch's layer: what installing python3-torch over layer 1 made or changed (by ctime:
# everything unpacked from layer 1 is older than the marker).
torch_packages=(python3-torch)
# The package's own tests (libtorch-test) and apt's caches are of no use in the image.
torch_recipe="apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends ${torch_packages[*]} && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb /var/log/* /usr/lib/libtorch-test"
torch_key=$(printf '%s %s\n' "$base_key" "$torch_recipe" | sha256sum | cut -c1-16)
torch_layer="$cache/pytorch-layer-$torch_key.tar"
if [ ! -f "$torch_layer" ]; then
  started=$SECONDS
  log "making the PyTorch image's layer: Debian's ${torch_packages[*]} over the trainer's (first time: a few minutes)"
  work=$(mktemp -d "$cache/torch.XXXXXX")
  trap 'umount "$work/rootfs/proc" 2>/dev/null || true; rm -rf "$work"' EXIT
  mkdir "$work/rootfs"
  tar --numeric-owner --xattrs -C "$work/rootfs" -xf "$base"
  touch "$work/marker"
  sleep 1
  chroot_run "$work/rootfs" "$work/install.log" /bin/sh -c "$torch_recipe"
  (cd "$work/rootfs" && find . -mindepth 1 -cnewer "$work/marker" ! -path './proc/*' ! -path './tmp/*' -print0 \
    | tar --numeric-owner --xattrs --null --no-recursion -T - -cf "$torch_layer.partial")
  mv "$torch_layer.partial" "$torch_layer"
  rm -rf "$work"; trap - EXIT
  log "PyTorch's layer made in $((SECONDS - started)) s ($(du -h "$torch_layer" | cut -f1))"
fi
samples="$root/config/samples/pytorch-ddp"

# Layer 2 and the archive, named by what they hold.
key=$(printf '%s %s %s %s %s\n' "$base_key" "$(sha "$trainer_bin")" "$(sha "$ringmaster_bin")" "$torch_key" "$(cat "$samples"/*.py | sha256sum)" | sha256sum | cut -c1-16)
archive="$cache/ringmaster-node-images-$key.tar"
if [ -f "$archive" ]; then echo "$archive"; exit 0; fi
log "packing the images (trainer and ringmaster binaries changed)"
work=$(mktemp -d "$cache/oci.XXXXXX")
trap 'rm -rf "$work"' EXIT
blobs="$work/layout/blobs/sha256"
mkdir -p "$blobs" "$work/bins/usr/local/bin" "$work/pause"
# Adds a file as a blob; prints `"digest":"sha256:…","size":N`.
blob() {
  local digest size
  digest=$(sha "$1"); size=$(stat -c %s "$1")
  mv "$1" "$blobs/$digest"
  printf '"digest":"sha256:%s","size":%s' "$digest" "$size"
}
layer_of_tar() { ln "$1" "$work/layer.tar" 2>/dev/null || cp "$1" "$work/layer.tar"; blob "$work/layer.tar"; }
diff_id() { sed 's/.*"digest":"\([^"]*\)".*/\1/' <<<"$1"; }

install -m 0755 "$trainer_bin" "$work/bins/usr/local/bin/ringmaster-trainer"
install -m 0755 "$ringmaster_bin" "$work/bins/usr/local/bin/ringmaster"
strip --strip-debug "$work/bins/usr/local/bin/"* 2>/dev/null || true
tar --numeric-owner --owner=0 --group=0 -C "$work/bins" -cf "$work/bins.tar" .
base_layer=$(layer_of_tar "$base")
bins_layer=$(layer_of_tar "$work/bins.tar")
catatonit=$(command -v catatonit || echo /usr/bin/catatonit)
install -m 0755 "$catatonit" "$work/pause/pause"
tar --numeric-owner --owner=0 --group=0 -C "$work/pause" -cf "$work/pause.tar" .
pause_layer=$(layer_of_tar "$work/pause.tar")
torch_layer_blob=$(layer_of_tar "$torch_layer")
mkdir -p "$work/samples/opt/ringmaster/samples/pytorch-ddp"
install -m 0644 "$samples"/*.py "$work/samples/opt/ringmaster/samples/pytorch-ddp/"
tar --numeric-owner --owner=0 --group=0 -C "$work/samples" -cf "$work/samples.tar" .
samples_layer=$(layer_of_tar "$work/samples.tar")

tar_layer='"mediaType":"application/vnd.oci.image.layer.v1.tar"'
# image NAME USER CONFIG-EXTRA LAYER... → one manifest entry for index.json
image() {
  local name=$1 user=$2 extra=$3; shift 3
  local diffs=() layers=() l
  for l in "$@"; do diffs+=("\"$(diff_id "$l")\""); layers+=("{$tar_layer,$l}"); done
  local IFS=,
  printf '{"architecture":"amd64","os":"linux","config":{"User":"%s","Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]%s},"rootfs":{"type":"layers","diff_ids":[%s]}}' \
    "$user" "$extra" "${diffs[*]}" >"$work/config.json"
  local config; config=$(blob "$work/config.json")
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json",%s},"layers":[%s]}' \
    "$config" "${layers[*]}" >"$work/manifest.json"
  local manifest; manifest=$(blob "$work/manifest.json")
  printf '{"mediaType":"application/vnd.oci.image.manifest.v1+json",%s,"annotations":{"io.containerd.image.name":"%s","org.opencontainers.image.ref.name":"%s"}}' \
    "$manifest" "$name" "${name##*:}"
}
trainer_config=',"WorkingDir":"/home/trainer","Cmd":["ringmaster-trainer","info"]'
entries=(
  "$(image ringmaster.local/pause:3.10 0:0 ',"Entrypoint":["/pause","-P"]' "$pause_layer")"
  "$(image ringmaster.local/ringmaster-trainer:e2e 1000:1000 "$trainer_config" "$base_layer" "$bins_layer")"
  "$(image ringmaster.local/ringmaster-trainer:e2e-root 0:0 "$trainer_config" "$base_layer" "$bins_layer")"
  "$(image ringmaster.local/ringmaster:e2e 65532:65532 ',"Entrypoint":["/usr/local/bin/ringmaster"],"Cmd":["run"]' "$base_layer" "$bins_layer")"
  "$(image ringmaster.local/pytorch:e2e 1000:1000 "$trainer_config" "$base_layer" "$torch_layer_blob" "$bins_layer" "$samples_layer")"
)
(IFS=,; printf '{"schemaVersion":2,"manifests":[%s]}' "${entries[*]}") >"$work/layout/index.json"
printf '{"imageLayoutVersion":"1.0.0"}' >"$work/layout/oci-layout"
tar -C "$work/layout" -cf "$archive.partial" .
mv "$archive.partial" "$archive"
# Older archives of other binaries are of no further use.
find "$cache" -maxdepth 1 -name 'ringmaster-node-images-*.tar' ! -name "${archive##*/}" -delete
log "images packed: $(du -h "$archive" | cut -f1)"
echo "$archive"
