"""The models one gateway serves (ModelCatalog): each with its own turn runner (tokenizer, chat template, context
length, the workers it plans on) and turn builder (parsers, default answer limit). A request names its model; an
unknown one is a 404 ``model_not_found`` on every API (docs/models.md)."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

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


class ModelCatalog:
    """The served models by name; the first is the default of a request that names none (as vLLM serves its first
    served model name)."""

    def __init__(self, served: Sequence[ServedModel]):
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
        """The served models a caller may use (``allowed``: its key's models; None: every one)."""
        return [m for m in self._by_name.values() if allowed is None or m.name in allowed]

    def get(self, model: str | None, *, required: bool = False,
            allowed: Collection[str] | None = None) -> ServedModel:
        """The served model ``model`` names, among those ``allowed`` (the caller's key's; None: every one); none
        named: the default (the first allowed), unless ``required`` (Anthropic's APIs). Else a 404
        ``model_not_found`` (OpenAI's code; the APIs spell it their own way), the same whether the model is not
        served or not the caller's: an answer never tells a caller which models other keys may use."""
        found = self._by_name.get(model or "") if model or required else self.default
        if found is not None and (allowed is None or found.name in allowed):  # every turn: no list built
            return found
        usable = self.usable(allowed)
        if not model and not required and usable:
            return usable[0]  # the default is not the caller's: its first
        served = ", ".join(repr(m.name) for m in usable) or "no model to this key"
        raise TurnError(404, grpc.StatusCode.NOT_FOUND,
                        f"The model {model!r} does not exist or you do not have access to it; this gateway "
                        f"serves {served}", api_code="model_not_found")
