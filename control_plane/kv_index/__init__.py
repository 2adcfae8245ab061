"""What each prefill worker holds in its prefix cache, from vLLM's KV events (pure): ``hashing`` (vLLM's block
hashes, reproduced), ``events`` (vLLM's event batches, decoded; ``msgpack_reader``, ``cbor``: the two encodings,
standard library only), ``index`` (per-worker views, their order checks and bounds, prefix scores)."""
