# syntax=docker/dockerfile:1
# Two images from one file:
#   docker build --target operator -t <registry>/ringmaster:<version> .
#   docker build --target trainer  -t <registry>/ringmaster-trainer:<version> .
# `operator` runs `ringmaster run` (and `ringmaster stage` in DataStage copy Jobs);
# `trainer` is what TrainingJob workers and launchers run (sshd, Open MPI, the trainer).

ARG RUST_VERSION=1.95
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04

# ---- build: both binaries, the operator static (musl) ----
FROM rust:${RUST_VERSION}-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends musl-tools && rm -rf /var/lib/apt/lists/* \
 && rustup target add x86_64-unknown-linux-musl
WORKDIR /src
COPY . .
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

# ---- trainer: CUDA runtime, Open MPI, sshd, NCCL (loaded at run time by the trainer) ----
FROM ${CUDA_IMAGE} AS trainer
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      openmpi-bin openssh-server openssh-client libnccl2 ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 # cudarc looks for libnccl.so; the package ships libnccl.so.2 only.
 && ln -s "$(ldconfig -p | awk '/libnccl.so.2 /{print $NF; exit}')" /usr/local/lib/libnccl.so \
 && ldconfig \
 && mkdir -p /run/sshd \
 && useradd --uid 1000 --create-home --shell /bin/bash trainer
COPY --from=build /out/ringmaster-trainer /usr/local/bin/ringmaster-trainer
USER 1000:1000
WORKDIR /home/trainer
ENTRYPOINT []
CMD ["ringmaster-trainer", "info"]
