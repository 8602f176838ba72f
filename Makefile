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
DEBIAN_UNITS := $(SHARDSTACK_CACHE)/debian-units
UNIT_PACKAGES := prometheus-node-exporter prometheus prometheus-alertmanager haproxy munge slurmctld slurmdbd
# The stamp names the package list: a cache made for fewer packages is filled again.
UNITS_KEY := $(shell echo $(UNIT_PACKAGES) | sha1sum | cut -c1-8)

APT_PACKAGES := python3-venv python3-dev debootstrap systemd-container apt-cacher-ng iproute2 openssh-client nftables \
                util-linux prometheus prometheus-alertmanager haproxy git systemd-journal-remote \
                rsyslog rsyslog-elasticsearch
EXTRAS := train,serve,ops,dev
# Records each stage's wall time and exit code; `make test` ends with its table (.ci/budget.py).
BUDGET := python3 .ci/budget.py
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
# The vLLM engine's Python (tests/serve/test_vllm.py, bench/serve_engines.py): `make vllm-venv` links it here.
export SHARDSTACK_VLLM_PYTHON ?= $(abspath $(VENV))/vllm/bin/python

.PHONY: help setup apt venv vllm-venv demo test lint unit molecule e2e gpu-check pretrained clean

help:
	@echo "make demo   - set up, boot a 3-node lab, deploy site.yml on it, print a summary"
	@echo "make test   - set up, lint, unit + distributed + lab tests, molecule (default's verify runs tests/e2e)"
	@echo "make e2e    - the whole cluster on a 3-node lab: deploy, 2-node training, kill a worker, serve (~15 min)"
	@echo "make molecule - every molecule scenario (default + one per role), MOLECULE_JOBS=$(MOLECULE_JOBS) at a time"
	@echo "make bench-NAME [ARGS='…'] - run bench/NAME.py with what it needs (e.g. make bench-vs_deepspeed)"
	@echo "make pretrained - build the demo's pretrained Llama into $(SHARDSTACK_CACHE)/pretrained (tokenizer, data, CPU training, export)"
	@echo "make gpu-check - on a machine with NVIDIA GPUs: preflight, driver/CUDA/torch, NCCL training, serving (< 10 min)"
	@echo "make lint | unit | clean"

setup: apt venv $(DEBIAN_UNITS)/.ready-$(UNITS_KEY)

apt:
	@missing=""; for p in $(APT_PACKAGES); do dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "ok installed" || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then echo "apt: installing$$missing"; apt-get update -qq; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; fi

venv: $(STAMP)

# The unit files of the Debian packages the roles install, which tests/ops/test_unit_security.py scores with the
# roles' drop-ins (the packages themselves are not installed here).
$(DEBIAN_UNITS)/.ready-$(UNITS_KEY):
	rm -rf $(DEBIAN_UNITS).tmp && mkdir -p $(DEBIAN_UNITS).tmp $(DEBIAN_UNITS)
	cd $(DEBIAN_UNITS).tmp && apt-get download -qq $(UNIT_PACKAGES) && for d in *.deb; do dpkg-deb -x $$d root; done
	find $(DEBIAN_UNITS).tmp/root -path '*/systemd/system/*.service' -exec cp {} $(DEBIAN_UNITS)/ \;
	rm -rf $(DEBIAN_UNITS).tmp && touch $@

$(STAMP): pyproject.toml
	test -x $(BIN)/python || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	rm -f $(VENV)/.installed-* && touch $@

# A venv from a wheelhouse's dependencies as the nodes install them (hash-checked, --no-deps, offline), minus the
# shardstack wheel: this checkout's runtime/ runs in it (PYTHONPATH). Built once per lock under the cache; prints its
# path. $(1): the `shardstack wheelhouse` arguments, $(2): the cache name's prefix.
define venv_from_wheelhouse
deps=$$($(BIN)/shardstack wheelhouse $(1) --deps-only) || exit 1; dest=$(SHARDSTACK_CACHE)/venvs/$(2)-$$(basename $$deps); \
if [ ! -e $$dest/.ready ]; then echo "installing $$deps into $$dest" >&2; rm -rf $$dest.tmp; \
  python3 -m venv $$dest.tmp && $$dest.tmp/bin/pip install -q --no-index --no-deps --disable-pip-version-check \
    --require-hashes --find-links $$deps -r $$deps/deps.lock >&2 || exit 1; \
  touch $$dest.tmp/.ready && rm -rf $$dest && mv $$dest.tmp $$dest; fi; \
echo $$dest
endef

# The vLLM engine's venv as the nodes get it (`shardstack wheelhouse --venv vllm`; the lock leaves out the wheels
# vLLM requires but text generation never imports). 1.5 GB, linked from the venv.
vllm-venv: venv
	@dest=$$($(call venv_from_wheelhouse,--venv vllm,vllm)); ln -sfn $$dest $(VENV)/vllm

demo: setup
	$(BIN)/shardstack demo

lint: setup
	$(BUDGET) stage lint -- sh -ec 'ruff check runtime tests bench roles/dcgm_exporter/files .ci; yamllint -s .; \
	  ansible-lint --offline -q'

# pytest's exit code 5 ("no tests collected") fails the target like any other non-zero code. The slowest tests are
# listed at the end: make test has a 40-minute budget on 2 cores.
unit: setup vllm-venv
	$(BUDGET) stage unit -- pytest -q --durations=15 --junitxml=artifacts/budget/unit.xml

# Every scenario: `default` (site.yml on three lab nodes, the checks of every role it applies, then tests/e2e),
# `accelerators` (the GPU- and hardware-gated roles) and `slurm`. Each boots its own lab, named after the
# scenario, so MOLECULE_JOBS of them run side by side; the longest start first so the queues end together. One line
# per scenario here; the whole output in artifacts/molecule/<scenario>.log (a failed one's failed tasks below).
# SCENARIOS=… runs some of them; runs of disjoint lists may overlap (each cleans only its own files).
# SHARDSTACK_LAB_RELEASE=trixie boots their labs on Debian 13 (default bookworm; docs/lab.md, "Releases") and
# SHARDSTACK_LAB_ACCELERATOR their nodes' torch build (default auto), e.g.
# `SHARDSTACK_LAB_RELEASE=trixie SHARDSTACK_LAB_ACCELERATOR=cu130 make molecule SCENARIOS=slurm`.
MOLECULE_JOBS ?= 2
MOLECULE_FIRST := default accelerators slurm
SCENARIOS ?= $(MOLECULE_FIRST) $(filter-out $(MOLECULE_FIRST),$(patsubst molecule/%/molecule.yml,%,$(wildcard molecule/*/molecule.yml)))

molecule: setup
	@mkdir -p artifacts/molecule && rm -f $(foreach s,$(SCENARIOS),artifacts/molecule/$(s).*)
	@echo "molecule: $(words $(SCENARIOS)) scenario(s) ($(SCENARIOS)), $(MOLECULE_JOBS) at a time"
	@printf '%s\n' $(SCENARIOS) | xargs -P $(MOLECULE_JOBS) -I{} sh -c 'start=$$(date +%s); \
	  if molecule test -s {} >artifacts/molecule/{}.log 2>&1; then r=passed; else r=FAILED; touch artifacts/molecule/{}.failed; fi; \
	  echo "$$r $$(( $$(date +%s) - start ))" > artifacts/molecule/{}.result; \
	  echo "molecule {}: $$r in $$(( $$(date +%s) - start )) s"' ; \
	for s in $(SCENARIOS); do [ -e artifacts/molecule/$$s.failed ] || continue; \
	  echo "== $$s failed; its failed tasks, then the end of artifacts/molecule/$$s.log:"; \
	  grep -a -B2 -A30 -E '(fatal|failed): \[|FAILED!|ERROR!' artifacts/molecule/$$s.log | head -n 150 || true; \
	  tail -n 25 artifacts/molecule/$$s.log; done; \
	! ls $(foreach s,$(SCENARIOS),artifacts/molecule/$(s).failed) >/dev/null 2>&1

# The whole cluster on a 3-node lab of its own; `pytest` alone skips it (SHARDSTACK_E2E unset). `make test` runs the
# same suite once, in molecule default's verify, on the cluster that scenario deployed (no second site.yml run).
e2e: setup
	SHARDSTACK_E2E=1 pytest -x -s tests/e2e

# Three lanes on 2 cores: molecule default (the longest, its e2e inside); lint beside the unit tests (-O keeps each
# one's output together), then the other scenarios but accelerators, one at a time (slurm); accelerators (~400 s)
# beside them from the start. Two lanes (unit, accelerators, slurm in one) ended ~250 s after default (cc46: 2592 s);
# with three, default is the last to end (cc47, three from one queue: 2463 s; cc48 and cc49, these: 2453 s and
# 2173 s; bench/RESULTS.md).
# The budget is 40 minutes; the table of every stage's seconds and test counts comes last, also when a stage failed.
TEST_AFTER_UNIT = $(filter-out default accelerators,$(SCENARIOS))
test: setup
	@$(BUDGET) start
	@rc=0; printf '%s\n' default lint-unit $(filter accelerators,$(SCENARIOS)) | xargs -P 3 -I{} sh -c \
	  'if [ {} = lint-unit ]; then r=0; $(MAKE) --no-print-directory -j2 -O lint unit || r=$$?; \
	     $(if $(TEST_AFTER_UNIT),$(MAKE) --no-print-directory molecule SCENARIOS="$(TEST_AFTER_UNIT)" MOLECULE_JOBS=1 || r=$$?;) \
	     exit $$r; \
	   else $(MAKE) --no-print-directory molecule SCENARIOS={} MOLECULE_JOBS=1; fi' || rc=$$?; \
	  echo; $(BUDGET) table || echo 'budget: no table (.ci/budget.py failed)'; exit $$rc

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

# The Flask + gunicorn side of the comparison is no shardstack dependency: the `bench` extra, installed here.
bench-serve_vs_transformers: setup
	$(BIN)/python -c 'import flask, gunicorn, transformers' 2>/dev/null || $(BIN)/pip install -q -e ".[$(EXTRAS),bench]"
	$(BIN)/python bench/serve_vs_transformers.py $(ARGS)

# The built-in engine, vLLM and the Flask recipe on one model: the vLLM venv and the `bench` extra first.
bench-serve_engines: setup vllm-venv
	$(BIN)/python -c 'import flask, gunicorn, transformers' 2>/dev/null || $(BIN)/pip install -q -e ".[$(EXTRAS),bench]"
	$(BIN)/python bench/serve_engines.py $(ARGS)

bench-%: setup
	$(BIN)/python bench/$*.py $(ARGS)

# The demo's pretrained model, built with the project's own commands into $(SHARDSTACK_CACHE)/pretrained (reused while
# the recipe in shardstack/build/pretrained.py and the corpus are unchanged; `make demo` builds it when missing).
pretrained: setup
	$(BIN)/shardstack pretrained $(ARGS)

# docs/variables.md from every role's meta/argument_specs.yml (tests/ops/test_variables_doc.py fails while it is stale).
.PHONY: docs-variables
docs-variables: venv
	$(BIN)/python -m shardstack.build.variables --write docs/variables.md

# The GPU path on this machine (bench/gpu_selftest.py): JSON lines, non-zero if a check fails; without NVIDIA hardware
# only its CPU part runs. The preflight runs from the project's venv (ansible); the torch checks from a venv of the
# wheelhouse a node with this machine's driver gets (`--accelerator auto`: the class for the loaded driver branch),
# not the project venv's torch, whose CUDA build PyPI picks whatever the driver.
gpu-check: venv
	@row=$$(mktemp); trap 'rm -f $$row' EXIT; \
	$(BIN)/python bench/gpu_selftest.py --checks preflight | tee $$row && pre=0 || pre=$$?; \
	dest=$$($(call venv_from_wheelhouse,--accelerator auto,gpu-check)); \
	PYTHONPATH=$(CURDIR)/runtime $$dest/bin/python bench/gpu_selftest.py --preflight-row $$row \
	  --checks facts,cuda,train_nccl,serve_cuda,gpu_step && rc=0 || rc=$$?; exit $$(( pre || rc ))

clean:
	-for n in $$($(BIN)/shardstack lab list 2>/dev/null); do $(BIN)/shardstack lab down --name $$n; done
	rm -rf $(VENV) artifacts .cache
