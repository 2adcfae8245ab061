"""Typed configs as a command parses them (services/common/config.py), with an environment of the test's choosing."""

from __future__ import annotations

import argparse
from typing import TypeVar

from kvshuttle.services.common.config import add_arguments, from_namespace

T = TypeVar("T")


def parse_config(cls: type[T], *argv: str, environ: dict[str, str] | None = None) -> T:
    """``cls`` from these command-line flags and ``environ`` (default: none; not the test process's), validated:
    what ``load`` does, with ConfigError raised instead of argparse's exit."""
    parser = argparse.ArgumentParser()
    add_arguments(cls, parser)
    return from_namespace(cls, parser.parse_args(list(argv)), {} if environ is None else environ)
