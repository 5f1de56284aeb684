"""Client library for the `llm` model: streams completions over gRPC or HTTP with tritonclient / requests."""

from client.llm_client import Delta, LLMClient, LLMError

__all__ = ["Delta", "LLMClient", "LLMError"]
