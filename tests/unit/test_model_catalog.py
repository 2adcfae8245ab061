"""The models one gateway serves (services/gateway/turns/catalog.py): found by name, the first the default, an
unknown one a 404 model_not_found."""

from __future__ import annotations

import pytest
from kvshuttle.services.gateway.turns import TurnError, TurnRequest
from kvshuttle.services.gateway.turns.builder import TurnBuilder
from kvshuttle.services.gateway.turns.catalog import ModelCatalog, ServedModel


def served(name: str) -> ServedModel:
    return ServedModel(name, runner=f"runner-{name}", builder=TurnBuilder(name))  # type: ignore[arg-type]


def test_models_by_name_the_first_the_default():
    catalog = ModelCatalog([served("agent"), served("tiny")])
    assert catalog.names == ["agent", "tiny"] and len(catalog) == 2
    assert catalog.get(None).name == catalog.get("").name == "agent" and catalog.get("tiny").name == "tiny"
    assert catalog.runner_of(TurnRequest(model="tiny")) == "runner-tiny"
    assert catalog.runner_of(TurnRequest()) == "runner-agent"
    with pytest.raises(TurnError) as err:
        catalog.get("gpt-4o")
    assert err.value.http_status == 404 and err.value.api_code == "model_not_found"
    assert "'gpt-4o' does not exist or you do not have access to it; this gateway serves 'agent', 'tiny'" in (
        err.value.message)
    with pytest.raises(TurnError):  # Anthropic's model is required: an empty one is unknown too
        catalog.get("", required=True)


def test_a_catalog_refuses_no_model_a_model_twice_and_a_builder_of_another():
    for models, words in (([], "at least one"), ([served("a"), served("a")], "served twice"),
                          ([ServedModel("a", None, TurnBuilder("b"))], "its builder serves 'b'")):  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=words):
            ModelCatalog(models)


def test_a_key_limited_to_some_models_sees_only_those():
    catalog = ModelCatalog([served("agent"), served("tiny"), served("big")])
    assert [m.name for m in catalog.usable({"tiny", "big"})] == ["tiny", "big"]
    assert catalog.get(None, allowed={"tiny", "big"}).name == "tiny"  # the default is not this key's: its first
    assert catalog.get(None, allowed={"agent", "big"}).name == "agent"
    with pytest.raises(TurnError) as err:
        catalog.get("agent", allowed={"tiny"})
    assert err.value.api_code == "model_not_found" and "serves 'tiny'" in err.value.message
    assert "'big'" not in err.value.message  # what other keys may use is not told
    with pytest.raises(TurnError) as err:
        catalog.get(None, allowed={"other"})  # a key whose models this gateway does not serve
    assert "no model to this key" in err.value.message


class Adapters:
    """Registered adapters as the gateway's worker view lists them: name -> base models."""

    def __init__(self, **adapters: set[str]):
        self.listed = {name.replace("_", "-"): frozenset(bases) for name, bases in adapters.items()}

    def adapters(self):
        return self.listed


def test_registered_adapters_are_served_on_their_base_models_runner_under_their_own_name():
    """Issue #37: an adapter live workers of a served model registered is served by name, with its base model's
    runner and rules; its turns name the adapter and run under it (engine_sampling's adapter); it lists after the
    base models with its parent. One of an unserved model, or registered for two served models, is not served."""
    source = Adapters(sql_lora={"tiny"}, other_lora={"elsewhere"}, twice={"tiny", "agent"})
    catalog = ModelCatalog([served("agent"), served("tiny")], source)
    lora = catalog.get("sql-lora")
    assert (lora.name, lora.parent, lora.runner) == ("sql-lora", "tiny", "runner-tiny")
    assert catalog.get("sql-lora") is lora  # built once
    req = lora.builder.request(messages=[])
    assert (req.model, req.base_model, req.engine_sampling()["adapter"]) == ("sql-lora", "tiny", "sql-lora")
    base = catalog.get("tiny").builder.request(messages=[])
    assert (base.model, base.base_model, base.engine_sampling()["adapter"]) == ("tiny", "", None)
    assert catalog.runner_of(req) == "runner-tiny"
    assert [(m.name, m.parent) for m in catalog.usable()] == [("agent", ""), ("tiny", ""), ("sql-lora", "tiny")]
    assert [m.name for m in catalog.usable({"sql-lora"})] == ["sql-lora"]
    with pytest.raises(TurnError) as err:
        catalog.get("other-lora")  # its base model is not served here
    assert err.value.api_code == "model_not_found"
    with pytest.raises(TurnError) as err:
        catalog.get("twice")
    assert err.value.http_status == 503 and "more than one base model (agent, tiny)" in err.value.message
    with pytest.raises(TurnError) as err:
        catalog.get("sql-lora", allowed={"tiny"})  # a key limited to the base model
    assert err.value.api_code == "model_not_found"
    source.listed = {}  # unloaded everywhere
    with pytest.raises(TurnError):
        catalog.get("sql-lora")
    assert [m.name for m in catalog.usable()] == ["agent", "tiny"]
