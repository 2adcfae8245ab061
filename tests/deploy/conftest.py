"""tests/deploy: the worker install of test_installs.py starts as soon as the session is collected."""

from __future__ import annotations

import pytest
from kvshuttle.services.commands.installs import INSTALLS

from tests.support.clean_venv import install_early

WORKER_TEST = "test_the_worker_install_then_with_bench"


def pytest_collection_finish(session: pytest.Session) -> None:
    """When the session will check the worker install, its pip install (minutes, mostly one core) starts now, in a
    thread, beside the slow and end-to-end tests that `make test` runs before tests/deploy."""
    if any(getattr(item, "originalname", item.name) == WORKER_TEST for item in session.items):
        (worker,) = (i for i in INSTALLS if i.extras == ("worker",))
        install_early(session.config._tmp_path_factory.mktemp("worker"), worker.extras)
