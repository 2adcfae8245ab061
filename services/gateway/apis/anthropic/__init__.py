"""Anthropic's Messages API: request bodies, the prompt they make, the answer as content blocks, the routes."""
