"""The gateway's front ends: the HTTP APIs (OpenAI, Anthropic, Responses) on one app, the gRPC API, the REST bridge."""
