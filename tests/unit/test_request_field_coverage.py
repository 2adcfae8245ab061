"""Every field of OpenAI's request bodies (as the official `openai` package types them) is either one the gateway
declares, and docs/api.md says what becomes of it, or refused with a 400 that names it: none is dropped silently."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from kvshuttle.services.gateway.apis.http_app import create_app
from kvshuttle.services.gateway.apis.openai.models import ChatCompletionIn, CompletionIn
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from tests.support.auth import open_guard
from tests.support.turn_fakes import CapturingRunner

API_DOC = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
CHAT_FIELDS = sorted(chat_create_params.CompletionCreateParamsBase.__annotations__)
COMPLETION_FIELDS = sorted(completion_create_params.CompletionCreateParamsBase.__annotations__)
ODD = {"__odd__": 1}  # a value no field takes as "nothing asked"


@pytest.mark.parametrize("model, path, field", [
    *((ChatCompletionIn, "/v1/chat/completions", f) for f in CHAT_FIELDS),
    *((CompletionIn, "/v1/completions", f) for f in COMPLETION_FIELDS),
])
async def test_each_openai_field_is_applied_or_refused_by_name(model, path, field):
    if field in model.model_fields:  # applied: the API page must say how
        assert f"`{field}`" in API_DOC, f"docs/api.md does not mention {field}"
        return
    base = {"messages": [{"role": "user", "content": "hi"}]} if model is ChatCompletionIn else {"prompt": "hi"}
    app = create_app(CapturingRunner(), "tiny", 8)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=open_guard(app)), base_url="http://gw") as client:
        resp = await client.post(path, json={**base, field: ODD})
    assert resp.status_code == 400, (field, resp.text)
    assert resp.json()["error"]["param"] == field and field in resp.json()["error"]["message"]
