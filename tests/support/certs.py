"""Throwaway certificate authorities for TLS tests: the local stack's own (services/devtools/local_ca.py), valid a day."""

from __future__ import annotations

from pathlib import Path

from kvshuttle.services.devtools.local_ca import CertFiles, LocalCA

__all__ = ["CertFiles", "TestCA"]


class TestCA(LocalCA):
    """A CA that signs server and client certificates into ``directory``."""

    __test__ = False  # not a pytest test class

    def __init__(self, directory: Path, name: str = "kvshuttle test CA"):
        super().__init__(directory, name, days=1.0)
