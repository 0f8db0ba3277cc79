"""OpenAI-compatible HTTP server over the chunked-prefill engine."""
