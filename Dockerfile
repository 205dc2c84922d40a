# syntax=docker/dockerfile:1
# Two images from one file:
#   docker build --target operator -t <registry>/ringmaster:<version> .
#   docker build --target trainer  -t <registry>/ringmaster-trainer:<version> .
# `operator` runs `ringmaster run` (and `ringmaster stage` in DataStage copy Jobs);
# `trainer` is what TrainingJob workers and launchers run (sshd, Open MPI, the trainer).

ARG RUST_VERSION=1.95
# cuDNN's variant: the CUDA engine needs cuDNN 9 beside cuBLAS and NVRTC (the plain runtime
# image has no cuDNN).
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

# ---- build: both binaries, the operator static (musl) ----
FROM rust:${RUST_VERSION}-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends musl-tools && rm -rf /var/lib/apt/lists/* \
 && rustup target add x86_64-unknown-linux-musl
WORKDIR /src
COPY . .
# The commit ringmaster_build_info names: --build-arg RINGMASTER_GIT_COMMIT=$(git rev-parse --short HEAD).
ARG RINGMASTER_GIT_COMMIT=unknown
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --target x86_64-unknown-linux-musl -p ringmaster --bin ringmaster \
 && cargo build --release --locked -p ringmaster-trainer --bin ringmaster-trainer \
 && mkdir -p /out \
 && cp target/x86_64-unknown-linux-musl/release/ringmaster /out/ \
 && cp target/release/ringmaster-trainer /out/

# ---- operator: a static binary on distroless, non-root ----
FROM gcr.io/distroless/static-debian12:nonroot AS operator
COPY --from=build /out/ringmaster /usr/local/bin/ringmaster
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/ringmaster"]
CMD ["run"]

# ---- trainer: CUDA runtime with cuDNN, Open MPI, sshd, NCCL (loaded at run time by the trainer) ----
FROM ${CUDA_IMAGE} AS trainer
# One recipe with the local cluster's real node (e2e/tools/image.sh runs it in a Debian root
# filesystem): Open MPI, sshd, the non-root user `trainer`; NCCL here (the CUDA image's repository).
COPY trainer/image/setup.sh /tmp/setup.sh
RUN sh /tmp/setup.sh libnccl2 && rm /tmp/setup.sh
COPY --from=build /out/ringmaster-trainer /usr/local/bin/ringmaster-trainer
USER 1000:1000
WORKDIR /home/trainer
ENTRYPOINT []
CMD ["ringmaster-trainer", "info"]
