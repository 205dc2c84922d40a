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
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

.PHONY: test
test: lint unit ## Everything CI runs: format and lint checks, unit and fixture tests

.PHONY: lint
lint: ## cargo fmt --check and clippy with warnings denied
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets --locked -- -D warnings

.PHONY: unit
unit: ## Unit tests, validate-step fixture tests, CRD freshness
	$(CARGO) test --locked -- --test-threads=$(TEST_THREADS)

.PHONY: crds
crds: ## Regenerate crds/ from the Rust types
	$(CARGO) run --quiet --locked -- crd --output-dir crds

.PHONY: build
build: ## Build the operator
	$(CARGO) build --locked
