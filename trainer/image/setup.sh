#!/bin/sh
# Sets up the trainer image's root filesystem: Open MPI, sshd and client, the InfiniBand
# user space NCCL needs, the non-root user `trainer` (uid 1000). One recipe, run by the Dockerfile's `trainer` stage and by
# e2e/tools/image.sh inside a Debian root filesystem made by debootstrap, so the image the
# end-to-end tests run on the real node is set up the way the published one is.
# Arguments: more Debian/Ubuntu packages to install (libnccl2 in the CUDA image, mpich in the
# e2e image).
set -eu
apt-get update
# InfiniBand: NCCL's IB transport dlopens libibverbs.so.1, which loads the NIC's provider
# from ibverbs-providers (libmlx5 for the ConnectX NICs of Azure's ND and HB sizes);
# without them NCCL falls back to sockets on an InfiniBand node. rdma-core brings the
# RDMA configuration files, ibverbs-utils `ibv_devinfo` to see the devices from a pod.
DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
  openmpi-bin openssh-server openssh-client ca-certificates \
  rdma-core libibverbs1 ibverbs-providers ibverbs-utils "$@"
rm -rf /var/lib/apt/lists/*
# Pods bring their own host key (the job's Secret): no key baked into an image is shared.
rm -f /etc/ssh/ssh_host_*
# cudarc looks for libnccl.so; the package ships libnccl.so.2 only.
nccl=$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')
if [ -n "$nccl" ]; then ln -sf "$nccl" /usr/local/lib/libnccl.so && ldconfig; fi
# sshd's privilege-separation directory, for images run as root.
mkdir -p /run/sshd
# Ubuntu images (the CUDA base) already have uid 1000 (`ubuntu`).
if getent passwd 1000 >/dev/null && [ "$(getent passwd 1000 | cut -d: -f1)" != trainer ]; then
  userdel --remove "$(getent passwd 1000 | cut -d: -f1)"
fi
useradd --uid 1000 --user-group --create-home --shell /bin/bash trainer
# useradd locks the password ("!"), and sshd without PAM refuses a locked account even for
# key logins; "*" means no password can be used, without locking the account.
usermod --password '*' trainer
