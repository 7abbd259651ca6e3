# Each target does all of its own set-up: Debian packages, the virtualenv, the Go builds (cached).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
# The GPU Operator release the fleet builds and runs: v26.7.0, v26.3.3, v25.10.1 or v25.3.4.
GPUCANARY_OPERATOR_RELEASE ?= v26.7.0
OPERATOR_RELEASES := v26.7.0 v26.3.3 v25.10.1 v25.3.4

.PHONY: demo test docs unit kill-matrix diagnosis-matrix test-dra test-kubelet-pool setup deps build build-operators test-releases fleet-up fleet-down clean

# The demo gate on the local fleet's real kubelet GPU node (its default pool): the policy that spares
# the service passes; the field note's policy (pod deletion refuses /dev/shm, drain fallback) fails
# at the application stage.
DEMO_TARGET ?= 580.95.05
demo: setup build
	$(VENV)/bin/gpucanary fleet up
	$(VENV)/bin/gpucanary fleet status
	$(VENV)/bin/gpucanary run --gpucanary-policy=fixtures/policies/default.yaml \
		--gpucanary-driver-version=$(DEMO_TARGET) --gpucanary-probe-interval-s=10
	$(VENV)/bin/gpucanary run --gpucanary-policy=fixtures/policies/field-note.yaml \
		--gpucanary-driver-version=$(DEMO_TARGET) --gpucanary-probe-interval-s=10; \
		test $$? -eq 1 && echo "demo: the field-note policy was stopped by the gate, as it should be"

# Three worker processes, whole files each, one fleet per worker (tests/conftest.py): the end-to-end
# files mostly wait on the GPU Operator's 2-minute requeue, so a third fleet on 2 cores shortens the run.
# Files go out in collection order, the longest first (tests/e2e_fixtures.py), not xdist's by test count.
TEST_WORKERS ?= 3
test: setup build
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check pytest_gpucanary
	$(VENV)/bin/ruff format --check pytest_gpucanary
	$(VENV)/bin/mypy
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# Every step boundary x SIGINT/SIGTERM/SIGKILL, the crash-after-write samples and the control-plane
# faults on the local fleet (hours); `make test` runs a subset of each.
kill-matrix: setup build
	GPUCANARY_KILL_MATRIX=1 $(PY) -m pytest tests/canary/test_faults.py tests/canary/test_control_plane_faults.py \
		tests/canary/test_canary_gate.py::test_cleanup_hands_a_killed_runs_pool_back_to_the_default_nvidiadriver -rA $(PYTEST_ARGS)

# Every cause of a stuck rollout the watcher names on the kubelet pool: in ClusterPolicy mode one run each, in
# NVIDIADriver mode two at a time (`make test` runs the no-image case in both modes, and the driver held in
# NVIDIADriver mode).
diagnosis-matrix: setup build
	GPUCANARY_DIAGNOSIS_MATRIX=1 $(PY) -m pytest tests/canary/test_clusterpolicy_mode.py tests/canary/test_kubelet_pool.py \
		-k driver_that_cannot_come -rA $(PYTEST_ARGS)

# Every DRA run on a fleet whose GPU nodes offer their GPUs through DRA (`make test` runs the passing one).
test-dra: setup build
	GPUCANARY_DRA_VARIANTS=1 $(PY) -m pytest tests/canary/test_dra_cluster.py -rA $(PYTEST_ARGS)

# Both demo policies at once on two real kubelet nodes as canary pools (part of `make test`; alone here).
test-kubelet-pool: setup build
	$(PY) -m pytest tests/canary/test_kubelet_pool.py -rA $(PYTEST_ARGS)

# The documentation site (docs/, mkdocs.yml), warnings as errors, built outside the repository; `make test` builds
# it too (tests/docs/test_docs_site.py).
docs: setup
	$(VENV)/bin/mkdocs build --strict --site-dir $(HOME)/.cache/gpucanary/site

unit: setup
	$(PY) -m pytest -m "not e2e" $(PYTEST_ARGS)

setup: deps $(VENV)/.installed

deps:
	bash ci/install-deps.sh
	bash ci/install-node-deps.sh

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

build:
	bash ci/build.sh >/dev/null
	bash ci/build-operator.sh $(GPUCANARY_OPERATOR_RELEASE) >/dev/null
	bash ci/build-kubelet.sh >/dev/null
	bash ci/build-nvml-shim.sh >/dev/null
	bash ci/build-device-plugin.sh >/dev/null
	bash ci/build-nfd-master.sh >/dev/null
	bash ci/build-actionlint.sh >/dev/null
	bash ci/fetch-pushgateway.sh >/dev/null
	bash ci/build-helm.sh >/dev/null

# Every release, one build at a time (each takes minutes cold; a warm cache builds nothing).
build-operators:
	for release in $(OPERATOR_RELEASES); do bash ci/build-operator.sh $$release >/dev/null || exit 1; done

# The upgrade, ClusterPolicy-mode and fleet smoke tests once per release, each on a fleet of that
# release, one after the other; ends with each release's results, wall time and time-in-state table.
RELEASES_DIR ?= reports/releases
test-releases: setup build build-operators
	$(PY) tests/bench/release_matrix.py $(RELEASES_DIR) $(OPERATOR_RELEASES) -- $(PYTEST_ARGS)

fleet-up: setup build
	GPUCANARY_OPERATOR_RELEASE=$(GPUCANARY_OPERATOR_RELEASE) $(VENV)/bin/gpucanary fleet up

fleet-down: setup
	$(VENV)/bin/gpucanary fleet down

clean: fleet-down
	rm -rf $(VENV) reports
