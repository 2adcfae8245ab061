# kvshuttle: `make demo` runs the whole local stack and a multi-turn conversation; `make test` runs every test.
PY := .venv/bin/python

.PHONY: install demo up bench test test-fast protos lint chart chart-schema docs clean

install:
	@bash scripts/bootstrap.sh

demo: install
	@$(PY) -m kvshuttle.services.commands demo

up: install
	@$(PY) -m kvshuttle.services.commands up

bench: install
	@$(PY) -m kvshuttle.services.commands bench

test: install
	@$(PY) -m pytest

test-fast: install
	@$(PY) -m pytest -m "not e2e"

protos:
	@$(PY) protos/generate.py

lint:
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
