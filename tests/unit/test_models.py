"""Which names a worker answers to (control_plane/models.py): its base model and its LoRA adapters."""

from __future__ import annotations

from kvshuttle.control_plane import models
from kvshuttle.v1 import common_pb2


def test_a_worker_serves_its_base_model_and_each_adapter_by_name():
    w = common_pb2.Worker(model="base", adapters=[common_pb2.LoraAdapter(name="sql", id=1, path="/a/sql"),
                                                  common_pb2.LoraAdapter(name="chat", id=2)])
    assert [m for m in ("base", "sql", "chat", "other", "") if models.serves(w, m)] == ["base", "sql", "chat"]
    assert models.adapter(w, "sql").id == 1 and models.adapter(w, "base") is None and models.adapter(w, "x") is None
    assert models.served_names(w) == ["base", "sql", "chat"]
    assert models.served_names(common_pb2.Worker()) == [] and not models.serves(common_pb2.Worker(model="a"), "b")
