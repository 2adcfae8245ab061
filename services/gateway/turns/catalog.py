"""The models one gateway serves (ModelCatalog): each with its own turn runner (tokenizer, chat template, context
length, the workers it plans on) and turn builder (parsers, default answer limit). A request names its model; an
unknown one is a 404 ``model_not_found`` on every API (docs/models.md).

Besides its base models, a gateway serves every LoRA adapter that live workers of one of them have registered
(``Worker.adapters``, followed as workers come, go and change their adapters): an adapter's turns run on its base
model's runner and builder (its tokenizer, template and parsers), under the adapter's name."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
from kvshuttle.services.gateway.turns.builder import TurnBuilder
from kvshuttle.services.gateway.turns.errors import TurnError
from kvshuttle.services.gateway.turns.request import TurnRequest
from kvshuttle.services.gateway.turns.runner import TurnRunner


@dataclass(frozen=True)
class ServedModel:
    """One model clients name (``name``), the runner its turns run on and the builder that makes them."""

    name: str
    runner: TurnRunner
    builder: TurnBuilder
    parent: str = ""  # an adapter's base model ("": a base model)


class AdapterSource(Protocol):
    """The adapters live workers have registered, by name: their base models (more than one: ambiguous)."""

    def adapters(self) -> Mapping[str, frozenset[str]]: ...


class ModelCatalog:
    """The served models by name; the first is the default of a request that names none (as vLLM serves its first
    served model name)."""

    def __init__(self, served: Sequence[ServedModel], adapters: AdapterSource | None = None):
        if not served:
            raise ValueError("a gateway serves at least one model")
        self._by_name: dict[str, ServedModel] = {}
        for model in served:
            if model.name in self._by_name:
                raise ValueError(f"model {model.name!r} is served twice")
            if model.builder.served_model != model.name:
                raise ValueError(f"model {model.name!r}: its builder serves {model.builder.served_model!r}")
            self._by_name[model.name] = model
        self.default = served[0]
        self._adapters = adapters
        self._adapter_models: dict[tuple[str, str], ServedModel] = {}  # (adapter, base): built on first use

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def runner_of(self, req: TurnRequest) -> TurnRunner:
        """The runner of the model ``req`` is for (the builder set it)."""
        return self.get(req.model).runner

    def usable(self, allowed: Collection[str] | None = None) -> list[ServedModel]:
        """The served models a caller may use (``allowed``: its key's models; None: every one): the base models,
        then the adapters registered now (by name)."""
        found = [m for m in self._by_name.values() if allowed is None or m.name in allowed]
        if self._adapters is not None:
            for name, bases in sorted(self._adapters.adapters().items()):
                if (allowed is None or name in allowed) and name not in self._by_name and len(bases) == 1:
                    adapter = self._adapter(name, next(iter(bases)))
                    if adapter is not None:
                        found.append(adapter)
        return found

    def _adapter(self, name: str, base: str) -> ServedModel | None:
        """The served model of adapter ``name`` of ``base`` (None: this gateway does not serve ``base``)."""
        key = (name, base)
        found = self._adapter_models.get(key)
        if found is None:
            parent = self._by_name.get(base)
            if parent is None:
                return None
            found = self._adapter_models[key] = ServedModel(name, parent.runner, parent.builder.for_adapter(name),
                                                            parent=base)
        return found

    def _registered_adapter(self, name: str) -> ServedModel | None:
        """The adapter ``name`` as live workers register it now (None: none does, for a model served here)."""
        if self._adapters is None:
            return None
        bases = self._adapters.adapters().get(name)
        if not bases:
            return None
        served = sorted(b for b in bases if b in self._by_name)
        if len(served) > 1:
            raise TurnError(503, grpc.StatusCode.UNAVAILABLE,
                            f"adapter {name!r} is registered for more than one base model ({', '.join(served)}): "
                            "its workers' --lora-modules must name it for one")
        return self._adapter(name, served[0]) if served else None

    def get(self, model: str | None, *, required: bool = False,
            allowed: Collection[str] | None = None) -> ServedModel:
        """The served model ``model`` names, among those ``allowed`` (the caller's key's; None: every one); none
        named: the default (the first allowed), unless ``required`` (Anthropic's APIs). Else a 404
        ``model_not_found`` (OpenAI's code; the APIs spell it their own way), the same whether the model is not
        served or not the caller's: an answer never tells a caller which models other keys may use."""
        found = self._by_name.get(model or "") if model or required else self.default
        if found is None and model:
            found = self._registered_adapter(model)
        if found is not None and (allowed is None or found.name in allowed):  # every turn: no list built
            return found
        usable = self.usable(allowed)
        if not model and not required and usable:
            return usable[0]  # the default is not the caller's: its first
        served = ", ".join(repr(m.name) for m in usable) or "no model to this key"
        raise TurnError(404, grpc.StatusCode.NOT_FOUND,
                        f"The model {model!r} does not exist or you do not have access to it; this gateway "
                        f"serves {served}", api_code="model_not_found")
