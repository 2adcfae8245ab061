# kvshuttle: `make demo` runs the whole local stack and a multi-turn conversation; `make test` runs every test,
# `make test-fast` the quick ones (unit, integration).
PY := .venv/bin/python

.PHONY: install install-demo demo up bench test test-fast protos lint chart chart-schema docs clean

install:
	@bash scripts/bootstrap.sh

# What `make demo` and `make up` need, and no more (no test or bench tools): a newcomer's first run is shorter.
install-demo:
	@bash scripts/bootstrap.sh demo

# MODEL: the model variant `make demo`, `make up` and `make bench` run. `make demo` and `make up` run a real model
# (SmolLM2-135M-Instruct, `smollm2`) unless told otherwise (`make demo MODEL=tiny`: a tiny random Llama, faster, its
# answers noise); `make bench` runs the command's default (tiny) unless told. ARGS: more flags for the command.
MODEL ?=
ARGS ?=
MODEL_FLAG = $(if $(MODEL),--model-variant $(MODEL))
DEMO_MODEL_FLAG = --model-variant $(or $(MODEL),smollm2)

demo: install-demo
	@$(PY) -m kvshuttle.services.commands demo $(DEMO_MODEL_FLAG) $(ARGS)

up: install-demo
	@$(PY) -m kvshuttle.services.commands up $(DEMO_MODEL_FLAG) $(ARGS)

bench: install
	@$(PY) -m kvshuttle.services.commands bench $(MODEL_FLAG) $(ARGS)

# Every test; CI runs this (.ci/run). Two passes: tests/unit and tests/integration in parallel (2 workers), then
# tests/slow, tests/e2e and tests/deploy in one process (the e2e tests share one vLLM pair per session). Both passes
# always run; each ends with its time by folder (tests/conftest.py).
test: install
	@$(PY) -m pytest -n 2 tests/unit tests/integration; fast=$$?; \
	$(PY) -m pytest --durations=25 tests/slow tests/e2e tests/deploy; rest=$$?; \
	exit $$(( fast || rest ))

# The inner loop: tests/unit and tests/integration (real etcd and Redis) in parallel, under 2 minutes on 2 cores;
# not tests/slow (subprocesses, model builds), tests/e2e (vLLM) or tests/deploy (Helm, wheel, docs site). Workers:
# the integration tests mostly wait on their servers, so twice the cores pays; `make test-fast JOBS=8` for more.
# Each worker loads pytest's plugins: the two that only tests/e2e use (~2 s a process) are left out.
JOBS ?= 4
test-fast: install
	@$(PY) -m pytest -n $(JOBS) -p no:schemathesis -p no:langsmith_plugin tests/unit tests/integration

protos:
	@$(PY) protos/generate.py

lint:
	@.venv/bin/ruff check .
	@cd protos && ../.venv/bin/buf lint

# The Helm chart's checks (lint, render 3 profiles, offline schema validation, command-line parity): tests/deploy.
chart: install
	@$(PY) -m pytest tests/deploy -q

# Regenerate the `settings` schemas in deploy/helm/kvshuttle/values.schema.json from the commands' configs.
chart-schema:
	@$(PY) deploy/helm/schema.py

# The documentation site (docs/, mkdocs.yml) into var/site; the reference pages are generated from the code.
docs: install
	@$(PY) -m mkdocs build --strict

clean:
	rm -rf var/stack var/workers .pytest_cache
