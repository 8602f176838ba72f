# Thin entry points; the logic lives in Python (runtime/shardstack) and Ansible (site.yml, roles/).
# Everything runs as root on Debian 12: the lab needs namespaces, bridges and mounts.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

VENV   ?= .venv
BIN    := $(VENV)/bin
export PATH := $(abspath $(BIN)):$(PATH)
export ANSIBLE_CONFIG := $(abspath ansible.cfg)
# Heavy artifacts (node image, apt cache) live outside the clone so the next run or clone reuses them.
export SHARDSTACK_CACHE ?= /var/cache/shardstack

APT_PACKAGES := python3-venv python3-dev debootstrap systemd-container apt-cacher-ng iproute2 openssh-client \
                util-linux prometheus prometheus-alertmanager haproxy git
EXTRAS := train,serve,ops,dev
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: help setup apt venv demo test lint unit molecule e2e gpu-check clean

help:
	@echo "make demo   - set up, boot a 3-node lab, deploy site.yml on it, print a summary"
	@echo "make test   - set up, lint, unit + distributed + lab tests, molecule, e2e"
	@echo "make e2e    - the whole cluster on a 3-node lab: deploy, 2-node training, kill a worker, serve (~9 min)"
	@echo "make molecule - every molecule scenario (default + one per role), MOLECULE_JOBS=$(MOLECULE_JOBS) at a time"
	@echo "make bench-NAME [ARGS='…'] - run bench/NAME.py with what it needs (e.g. make bench-vs_deepspeed)"
	@echo "make gpu-check - on a machine with NVIDIA GPUs: preflight, driver/CUDA/torch, NCCL training, serving (< 10 min)"
	@echo "make lint | unit | clean"

setup: apt venv

apt:
	@missing=""; for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "apt: installing$$missing"; apt-get update -qq; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; fi

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	rm -f $(VENV)/.installed-* && touch $@

demo: setup
	$(BIN)/shardstack demo

lint: setup
	ruff check runtime tests bench
	yamllint -s .
	ansible-lint --offline -q

# pytest's exit code 5 ("no tests collected") fails the target like any other non-zero code.
unit: setup
	pytest -q

# Every scenario: `default` (site.yml on three lab nodes) and one per role. Each boots its own lab, named after the
# scenario, so MOLECULE_JOBS of them run side by side; the longest start first so the two queues end together.
# One line per scenario here; the whole output in artifacts/molecule/<scenario>.log (the tail of a failed one below).
MOLECULE_JOBS ?= 2
MOLECULE_FIRST := default training_runtime inference_service rdma os_baseline prometheus
SCENARIOS := $(MOLECULE_FIRST) $(filter-out $(MOLECULE_FIRST),$(patsubst molecule/%/molecule.yml,%,$(wildcard molecule/*/molecule.yml)))

molecule: setup
	@rm -rf artifacts/molecule && mkdir -p artifacts/molecule
	@echo "molecule: $(words $(SCENARIOS)) scenarios, $(MOLECULE_JOBS) at a time"
	@printf '%s\n' $(SCENARIOS) | xargs -P $(MOLECULE_JOBS) -I{} sh -c 'start=$$(date +%s); \
	  if molecule test -s {} >artifacts/molecule/{}.log 2>&1; then r=passed; else r=FAILED; touch artifacts/molecule/{}.failed; fi; \
	  echo "molecule {}: $$r in $$(( $$(date +%s) - start )) s"' ; \
	for f in artifacts/molecule/*.failed; do [ -e "$$f" ] || continue; s=$$(basename $$f .failed); \
	  echo "== $$s failed, the end of artifacts/molecule/$$s.log:"; tail -n 60 artifacts/molecule/$$s.log; done; \
	! ls artifacts/molecule/*.failed >/dev/null 2>&1

# The whole cluster on a 3-node lab; `pytest` alone skips it (SHARDSTACK_E2E unset), so it runs once here.
e2e: setup
	SHARDSTACK_E2E=1 pytest -x -s tests/e2e

test: lint unit molecule e2e

# Benchmarks: `make bench-memory ARGS='--world-size 2'` runs bench/memory.py from the project venv. DeepSpeed is no
# shardstack dependency: its comparison gets a bench-only venv in the cache, built here once.
BENCH_DS_VENV := $(SHARDSTACK_CACHE)/bench-ds-venv

$(BENCH_DS_VENV)/.ready:
	python3 -m venv $(BENCH_DS_VENV)
	$(BENCH_DS_VENV)/bin/pip install -q torch==2.13.0 numpy pyyaml
	DS_BUILD_OPS=0 $(BENCH_DS_VENV)/bin/pip install -q --no-build-isolation deepspeed
	touch $@

bench-vs_deepspeed: setup $(BENCH_DS_VENV)/.ready
	$(BIN)/python bench/vs_deepspeed.py --ds-python $(BENCH_DS_VENV)/bin/python $(ARGS)

bench-%: setup
	$(BIN)/python bench/$*.py $(ARGS)

# The GPU path on this machine (bench/gpu_selftest.py): JSON lines, non-zero if a GPU check fails; without NVIDIA
# hardware only its CPU part runs. Needs only python3-venv, not the lab's packages.
gpu-check: venv
	$(BIN)/python bench/gpu_selftest.py

clean:
	-for n in $$($(BIN)/shardstack lab list 2>/dev/null); do $(BIN)/shardstack lab down --name $$n; done
	rm -rf $(VENV) artifacts .cache
