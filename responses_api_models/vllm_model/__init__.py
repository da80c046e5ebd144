"""The vLLM model adapter: OpenAI-compatible endpoints that keep every token id exact."""
