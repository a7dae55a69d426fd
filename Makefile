# tfps developer entry points. `make demo` and `make test` do all the set-up on a fresh machine.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
export TFPS_CACHE ?= $(HOME)/.cache/tfps
# The repository's operator/ folder (package tfps.operator) would shadow the standard library's
# `operator` for `python -m`/`-c` run from the repository root: keep the cwd off sys.path.
export PYTHONSAFEPATH := 1
# pip builds the PS's C kernels (runtime/*.c, runtime/*.h) into the editable install: a change of them reinstalls.
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml $(sort $(wildcard runtime/*.c runtime/*.h)) | sha1sum | cut -c1-12)

.PHONY: test unit integration e2e reliability demo venv cluster-tools system-deps lint bench clean-cluster images fuzz

$(STAMP): pyproject.toml $(wildcard runtime/*.c runtime/*.h)
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[all]'
	@$(PY) -c 'import tfps.runtime._rows' 2>/dev/null || { echo "venv: the PS's C update kernels (runtime/_rows.c) did not build: install gcc and Python's headers (hack/install-system-deps.sh)" >&2; exit 1; }
	@rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)

system-deps:
	hack/install-system-deps.sh

# Everything the tests need from the Go module proxy, into $(TFPS_CACHE)/bin and $(TFPS_CACHE)/crds:
# the control plane's and the node's binaries, kwok, the gang backends' CRDs, Kueue.
cluster-tools:
	hack/build-cluster.sh
	hack/build-node.sh
	hack/build-gang-crds.sh
	hack/build-kueue.sh

# pytest exits 5 when it collects nothing; that is not a failure of the suite.
test: system-deps venv cluster-tools images
	$(PY) -m pytest tests -q; rc=$$?; [ $$rc -eq 5 ] && rc=0; exit $$rc

unit: venv
	$(PY) -m pytest tests/unit -q

integration: system-deps venv cluster-tools images
	$(PY) -m pytest tests/integration -q

e2e: system-deps venv cluster-tools images
	$(PY) -m pytest tests/e2e -q

# Faults injected during real training runs, invalid input refused, data lost: the tests, then
# the report (hack/reliability.py). The fault tests restart the control plane: keep this session alone.
RELIABILITY_TESTS := tests/e2e/test_faults.py tests/integration/test_checkpoint_crash.py \
	tests/integration/test_runtime_ps_input.py tests/integration/test_operator_validation.py
reliability: system-deps venv cluster-tools images
	TFPS_RELIABILITY_REPORT=$(CURDIR)/.tfps/reliability.json $(PY) -m pytest $(RELIABILITY_TESTS) -q; rc=$$?; \
	echo; $(PY) hack/reliability.py $(CURDIR)/.tfps/reliability.json; exit $$rc

# Builds only what the demo needs (hack/build-demo.sh): the local cluster's binaries (Go, CPU-bound)
# beside the venv and the images (network- and disk-bound), or no cluster binaries at all when
# KUBECONFIG points at a cluster that answers. Not kwok, the gang CRDs nor Kueue (cluster-tools).
demo: system-deps
	MAKE="$(MAKE)" hack/build-demo.sh
	hack/demo.sh

bench: venv
	$(VENV)/bin/tfps bench

# The fuzz targets of the PS's request path (tests/fuzz/), each FUZZ_SECONDS on the sanitized
# builds of its C kernels (hack/build-sanitized.sh: UBSan, then ASan+UBSan): any crash, sanitizer
# report or unexpected exception fails. `make fuzz FUZZ_SECONDS=600` for a long run.
FUZZ_SECONDS ?= 30
fuzz: venv
	$(PY) tests/fuzz/run.py --seconds $(FUZZ_SECONDS)

# ruff (format, then pyflakes, line length, bugbear, complexity, imports, pyupgrade, simplify:
# pyproject.toml), mypy on the API and the operator, the docs site built strictly (a broken link
# fails), hadolint for the Dockerfiles, helm lint for the chart (skipped, saying so, until
# hack/build-cluster.sh has built helm). Zero findings.
HELM ?= $(firstword $(wildcard $(TFPS_CACHE)/bin/current/helm $(TFPS_CACHE)/bin/helm-*/helm) $(TFPS_CACHE)/bin/current/helm)
lint: venv
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	@mkdir -p .tfps/mypy/tfps && for p in api operator runtime; do ln -sfn ../../../$$p .tfps/mypy/tfps/$$p; done
	$(VENV)/bin/mypy
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir .tfps/site
	$(VENV)/bin/hadolint images/*/Dockerfile
	@if [ -x "$(HELM)" ]; then $(HELM) lint --strict charts/tfps; \
	else echo "lint: helm not built yet ($(HELM)): run hack/build-cluster.sh; skipped helm lint"; fi

# The operator, PS and worker images, built with buildah (no daemon, no registry) into
# docker-archives under $(TFPS_CACHE)/images/; rebuilt only when their inputs change.
images: system-deps
	hack/build-images.sh

clean-cluster:
	hack/cluster.sh down || true
