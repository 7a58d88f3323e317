"""The engine: requests in, tokens out, with continuous batching over a paged KV cache."""
