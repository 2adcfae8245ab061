"""What the agent tests (tests/e2e/agents/) share besides their stack fixture: the API keys of the agent stack's
gateway, and more gateways on that stack."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from kvshuttle.services.devtools.stack import Stack

RUN_KEYS = [f"run-{i}" for i in range(8)]  # one tenant each (test_agents.own_tenant)
KEYS = [("unused", "agents"), *((k, k.replace("-", "")) for k in RUN_KEYS)]


@asynccontextmanager
async def gateways(stack: Stack, flags: dict[str, list[str]]) -> AsyncIterator[dict[str, str]]:
    """One more gateway (no API keys) per name in ``flags``, each with its gateway flags, on ``stack``'s registry,
    scheduler and workers: {name: base URL}; stopped on exit."""
    children = []
    try:
        async def spawn(name: str) -> tuple[str, str]:
            child, url = await stack.spawn_gateway(f"gateway-{name}", *flags[name])
            children.append(child)
            return name, url

        yield dict(await asyncio.gather(*map(spawn, flags)))
    finally:
        for child in children:
            await child.stop()
