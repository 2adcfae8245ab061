"""The LoRA adapters live workers have registered (``Worker.adapters``), for the gateway's model catalog: followed
through the registry's worker watch, so an adapter a worker loads while running is served without a restart, and one
no live worker serves any more is not."""

from __future__ import annotations

from collections.abc import Mapping

from kvshuttle.services.common.worker_view import WorkerView


class RegisteredAdapters:
    """Adapter name -> the base models of the live workers that registered it (built once per change of the view)."""

    def __init__(self, view: WorkerView):
        self.view = view
        self._version = -1
        self._adapters: dict[str, frozenset[str]] = {}

    def adapters(self) -> Mapping[str, frozenset[str]]:
        if self._version != self.view.version:
            found: dict[str, set[str]] = {}
            for worker in self.view.all():
                for adapter in worker.adapters:
                    found.setdefault(adapter.name, set()).add(worker.model)
            self._adapters = {name: frozenset(bases) for name, bases in found.items()}
            self._version = self.view.version
        return self._adapters
