# Each target does all of its own set-up: Debian packages, the virtualenv, the Go build (cached).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: demo test unit setup deps build fleet-up fleet-down clean

# The demo gate on the local fleet: the policy that spares the service passes; the field note's
# policy (pod deletion refuses /dev/shm, drain fallback) fails at the application stage.
DEMO_TARGET ?= 580.95.05
demo: setup build
	$(VENV)/bin/gpucanary fleet up
	$(VENV)/bin/gpucanary fleet status
	$(VENV)/bin/gpucanary run --gpucanary-policy=fixtures/policies/default.yaml \
		--gpucanary-driver-version=$(DEMO_TARGET) --gpucanary-probe-interval-s=10
	$(VENV)/bin/gpucanary run --gpucanary-policy=fixtures/policies/field-note.yaml \
		--gpucanary-driver-version=$(DEMO_TARGET) --gpucanary-probe-interval-s=10; \
		test $$? -eq 1 && echo "demo: the field-note policy was stopped by the gate, as it should be"

test: setup build
	$(VENV)/bin/lint-imports
	$(PY) -m pytest $(PYTEST_ARGS)

unit: setup
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

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
	bash ci/build-operator.sh >/dev/null
	bash ci/build-kubelet.sh >/dev/null
	bash ci/build-actionlint.sh >/dev/null

fleet-up: setup build
	$(VENV)/bin/gpucanary fleet up

fleet-down: setup
	$(VENV)/bin/gpucanary fleet down

clean: fleet-down
	rm -rf $(VENV) reports
