# Ringmaster's build, test and local-run commands. See README.md.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

# Builds are cached outside the clone so CI and fresh clones reuse them.
RINGMASTER_CACHE ?= $(HOME)/.cache/ringmaster
export RINGMASTER_CACHE
export CARGO_TARGET_DIR ?= $(RINGMASTER_CACHE)/target
CARGO ?= cargo
# Two cores: one test binary's threads at a time keeps the e2e tests' cluster responsive.
TEST_THREADS ?= 2

.PHONY: help
help: ## List the targets
	@grep -hE '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

.PHONY: test
test: lint unit e2e ## Everything CI runs: lint, unit and fixture tests, end-to-end tests on the local cluster

.PHONY: lint
lint: ## cargo fmt --check and clippy with warnings denied
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

.PHONY: unit
unit: mpi azurite nvrtc ## Unit tests, validate-step fixture tests, CRD freshness, the trainer (with mpirun; its CUDA kernels run on a CPU emulation), the CUDA kernels compiled by NVRTC
	$(CARGO) test --locked -p ringmaster -- --test-threads=$(TEST_THREADS)
	$(CARGO) test --locked -p ringmaster-e2e --lib --bins
	$(CARGO) test --locked -p ringmaster-trainer -- --test-threads=$(TEST_THREADS)
	LD_LIBRARY_PATH=$(NVRTC_DIR)$${LD_LIBRARY_PATH:+:$$LD_LIBRARY_PATH} \
	  $(CARGO) test --locked -p ringmaster-trainer --features nvrtc-tests --test cuda_kernels

.PHONY: nvrtc
# The NVRTC the lent GPU machines' PyTorch (cu130) ships; the kernels are compiled for
# each GPU generation by it, which needs no GPU.
NVRTC_VERSION ?= 13.0.88
NVRTC_DIR := $(RINGMASTER_CACHE)/nvrtc-$(NVRTC_VERSION)
nvrtc: ## Install NVIDIA's NVRTC (the CUDA runtime compiler, PyPI wheel nvidia-cuda-nvrtc) into the cache for the kernels' compile check
	@test -f $(NVRTC_DIR)/libnvrtc.so.13 || { \
	  echo "installing nvidia-cuda-nvrtc==$(NVRTC_VERSION) (PyPI, 90 MB) for the CUDA kernels' compile check"; \
	  tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	  python3 -m pip download -q --no-deps --only-binary=:all: --dest "$$tmp" nvidia-cuda-nvrtc==$(NVRTC_VERSION) && \
	  python3 -c 'import glob, os, sys, zipfile; wheel, out = glob.glob(sys.argv[1] + "/*.whl")[0], sys.argv[1] + "/lib"; os.makedirs(out); z = zipfile.ZipFile(wheel); [open(os.path.join(out, os.path.basename(n)), "wb").write(z.read(n)) for n in z.namelist() if "/lib/" in n and ".alt." not in n]' "$$tmp" && \
	  mkdir -p $(RINGMASTER_CACHE) && rm -rf $(NVRTC_DIR) && mv "$$tmp/lib" $(NVRTC_DIR); }

.PHONY: mpi
mpi: ## Install Debian's Open MPI when mpirun is missing (the trainer's multi-rank tests use it)
	@command -v mpirun >/dev/null 2>&1 || { \
	  echo "installing Debian's openmpi-bin for the multi-rank tests"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq openmpi-bin >/dev/null; }

.PHONY: azurite
AZURITE_VERSION ?= 3.37.0
azurite: ## Install Azurite (Microsoft's Blob Storage emulator, npm) into the cache; the stager's tests start it on loopback
	@test -x $(RINGMASTER_CACHE)/azurite-$(AZURITE_VERSION)/node_modules/.bin/azurite-blob || { \
	  command -v npm >/dev/null 2>&1 || { \
	    echo "installing Debian's nodejs and npm for Azurite"; \
	    if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	    $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq nodejs npm >/dev/null; }; \
	  echo "installing azurite@$(AZURITE_VERSION) (npm)"; \
	  mkdir -p $(RINGMASTER_CACHE)/azurite-$(AZURITE_VERSION); \
	  npm install --prefix $(RINGMASTER_CACHE)/azurite-$(AZURITE_VERSION) --no-audit --no-fund --loglevel=error azurite@$(AZURITE_VERSION) >/dev/null; }

.PHONY: e2e
e2e: azurite ## End-to-end tests on the local cluster (started and stopped around them; KEEP_CLUSTER=1 keeps it)
	TEST_THREADS=$(TEST_THREADS) e2e/test.sh

.PHONY: run
run: ## The operator on the local cluster, working on a sample (SAMPLE=path to pick another)
	e2e/run.sh

.PHONY: cluster-up
cluster-up: ## Start the local control plane (builds it from source the first time)
	e2e/cluster.sh up

.PHONY: cluster-down
cluster-down: ## Stop the local control plane and remove its state
	e2e/cluster.sh down

.PHONY: tools
tools: ## Build the control plane's binaries into the cache
	e2e/tools/build.sh

.PHONY: crds
crds: ## Regenerate crds/ from the Rust types (and their copies in the chart and config/crd) and docs/api.md
	$(CARGO) run --quiet --locked -- crd --output-dir crds --api-reference docs/api.md
	cp crds/*.yaml charts/ringmaster/crds/
	cp crds/*.yaml config/crd/bases/

.PHONY: manifests
manifests: ## Regenerate the kustomize bases config/rbac and config/manager, and the monitoring component's ServiceMonitor, from the Helm chart
	e2e/tools/manifests.sh

.PHONY: build
build: ## Build the operator
	RINGMASTER_GIT_COMMIT=$$(git rev-parse --short HEAD 2>/dev/null || echo unknown) $(CARGO) build --locked

.PHONY: bench-operator
BENCH_JOBS ?= 100
BENCH_WORKERS ?= 4
BENCH_REPEATS ?= 3
bench-operator: ## Benchmark: Ringmaster next to Kubeflow MPI Operator (limits raised, then its defaults), BENCH_JOBS × BENCH_WORKERS jobs at once on the local cluster, BENCH_REPEATS times in alternating order, every run on a fresh cluster (median [min–max]); BENCH_BEFORE=<commit> adds Ringmaster as built at that commit; BENCH_ARGS="--report-seconds 120" adds the cost of running jobs' progress reports
	$(if $(BENCH_BEFORE),e2e/tools/ringmaster-at.sh $(BENCH_BEFORE) >/dev/null)
	$(CARGO) build --release --locked -p ringmaster -p ringmaster-e2e --bin ringmaster --bin bench-operator
	e2e/tools/peers.sh mpi-operator >/dev/null
	e2e/cluster.sh up
	RINGMASTER_KUBECONFIG=$(CURDIR)/e2e/.state/kubeconfig $(CARGO_TARGET_DIR)/release/bench-operator \
	  $(if $(BENCH_BEFORE),--ringmaster $(BENCH_BEFORE)=$$(e2e/tools/ringmaster-at.sh $(BENCH_BEFORE))) \
	  --ringmaster $(CARGO_TARGET_DIR)/release/ringmaster \
	  --mpi-operator $$(e2e/tools/peers.sh mpi-operator) \
	  --jobs $(BENCH_JOBS) --workers $(BENCH_WORKERS) --repeats $(BENCH_REPEATS) $(BENCH_ARGS)

.PHONY: bench-allreduce
bench-allreduce: mpi ## Benchmark: TCP-ring all-reduce vs Open MPI's MPI_Allreduce, 4 ranks, 4 KiB..256 MiB
	@command -v mpicc >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libopenmpi-dev >/dev/null; }
	$(CARGO) build --release --locked -p ringmaster-trainer
	TRAINER=$(CARGO_TARGET_DIR)/release/ringmaster-trainer trainer/bench/allreduce-vs-mpi.sh
	TRAINER=$(CARGO_TARGET_DIR)/release/ringmaster-trainer MPI_BTL=self,tcp trainer/bench/allreduce-vs-mpi.sh

.PHONY: bench-stage
bench-stage: azurite ## Benchmark: `ringmaster stage` from Azurite to disk (1,000 × 1 MiB, 4 × 256 MiB) next to azcopy and the Python SDK's parallel download_blob
	$(CARGO) build --release --locked -p ringmaster --bin ringmaster
	@test -x $(RINGMASTER_CACHE)/pysdk/bin/python || python3 -m venv $(RINGMASTER_CACHE)/pysdk
	@$(RINGMASTER_CACHE)/pysdk/bin/python -c 'import azure.storage.blob' 2>/dev/null || $(RINGMASTER_CACHE)/pysdk/bin/pip install -q azure-storage-blob
	azcopy=$$(e2e/tools/peers.sh azcopy) && \
	  $(RINGMASTER_CACHE)/pysdk/bin/python bench/stage-vs-sdk.py $(CARGO_TARGET_DIR)/release/ringmaster $(RINGMASTER_CACHE)/azurite-$(AZURITE_VERSION)/node_modules/.bin/azurite-blob --azcopy "$$azcopy"

.PHONY: gpu-bundle
gpu-bundle: ## Build the trainer and its GPU tests (release, stripped) into trainer/gpu/.bundle, to carry to a GPU machine
	$(CARGO) build --release --locked -p ringmaster-trainer
	$(CARGO) test --release --locked -p ringmaster-trainer --features gpu-tests --test gpu --no-run --message-format=json \
	  | python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin.readlines()) if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu"][-1])' > $(CARGO_TARGET_DIR)/gpu-tests.path
	mkdir -p trainer/gpu/.bundle
	cp $(CARGO_TARGET_DIR)/release/ringmaster-trainer trainer/gpu/.bundle/ringmaster-trainer
	cp "$$(cat $(CARGO_TARGET_DIR)/gpu-tests.path)" trainer/gpu/.bundle/gpu-tests
	strip trainer/gpu/.bundle/ringmaster-trainer trainer/gpu/.bundle/gpu-tests
	ls -l trainer/gpu/.bundle

.PHONY: test-gpu
test-gpu: gpu-bundle ## GPU tests (needs an NVIDIA GPU with cuDNN, cuBLAS, NVRTC, NCCL): the CUDA engine against the CPU one; never part of `make test`
	trainer/gpu/run.sh tests

.PHONY: bench-gpu
bench-gpu: gpu-bundle ## Benchmark on a GPU: ResNet-50 bf16 at 224 px, batch 256 and 128, ours next to PyTorch eager, fused SGD, CUDA graphs, torch.compile and max-autotune, 3 alternating repeats, memory by NVML
	trainer/gpu/run.sh bench

.PHONY: bench-loader
LOADER_DATA := $(RINGMASTER_CACHE)/imagenet-sized
bench-loader: ## Benchmark: the image-folder loader on 2,560 ImageNet-sized JPEGs (images/s, CPU cores busy) on all CPUs and on one; on a GPU machine `trainer/gpu/run.sh bench loader` adds nvJPEG
	$(CARGO) build --release --locked -p ringmaster-trainer
	test -d $(LOADER_DATA) || { rm -rf $(LOADER_DATA).tmp && \
	  $(CARGO_TARGET_DIR)/release/ringmaster-trainer make-dataset --out $(LOADER_DATA).tmp --classes 10 --per-class 256 --imagenet-sizes && \
	  mv $(LOADER_DATA).tmp $(LOADER_DATA); }
	$(CARGO_TARGET_DIR)/release/ringmaster-trainer bench-loader --data-dir $(LOADER_DATA) --batches 9
	RAYON_NUM_THREADS=1 $(CARGO_TARGET_DIR)/release/ringmaster-trainer bench-loader --data-dir $(LOADER_DATA) --batches 2

.PHONY: bench-trainer
bench-trainer: ## Benchmark: CPU images/s of ResNet-18 at 64×64 and ResNet-50 at 224×224, batch 32 (release)
	$(CARGO) build --release --locked -p ringmaster-trainer
	$(CARGO_TARGET_DIR)/release/ringmaster-trainer train --model resnet18 --image-size 64 --batch-size 32 --steps 10 --synthetic --log-every 1000
	$(CARGO_TARGET_DIR)/release/ringmaster-trainer train --model resnet50 --image-size 224 --batch-size 32 --steps 3 --synthetic --log-every 1000
