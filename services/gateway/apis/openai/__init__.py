"""OpenAI's Chat Completions and Completions API: request bodies, routes, the answer as messages, chunks, logprobs."""
