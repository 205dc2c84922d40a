#!/usr/bin/env bash
# Bus bandwidth of ringmaster-trainer's TCP ring next to Open MPI's MPI_Allreduce, same sizes,
# same rank count, same machine, in one run (`make bench-allreduce`). Loopback only.
#   RANKS (4), MIN (4096), MAX (268435456), FACTOR (4), ITERATIONS (10)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
ranks=${RANKS:-4} min=${MIN:-4096} max=${MAX:-268435456} factor=${FACTOR:-4} iterations=${ITERATIONS:-10}
trainer=${TRAINER:?path to a release ringmaster-trainer}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mpicc -O2 -o "$work/mpi_allreduce" "$here/mpi_allreduce.c"
btl=${MPI_BTL:-self,vader,tcp}  # self,tcp: Open MPI over loopback TCP like the ring
mpi=(mpirun -np "$ranks" --oversubscribe --bind-to none --mca btl "$btl" --mca btl_tcp_if_include lo)
"${mpi[@]}" "$work/mpi_allreduce" "$min" "$max" "$factor" "$iterations" 3
RINGMASTER_RENDEZVOUS=127.0.0.1:29517 "${mpi[@]}" "$trainer" bench-allreduce \
  --min-bytes "$min" --max-bytes "$max" --step-factor "$factor" --iterations "$iterations" --warmup 3 --check
