"""The gateway's HTTP edge: API keys, tenant limits, input checks, error shapes, SSE, metrics and tracing."""
