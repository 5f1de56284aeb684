"""An OpenAI-compatible HTTP API in front of Triton: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` and ``/health``, mapped onto the ``llm`` model's streaming gRPC inputs and outputs.

The frontend only translates: sampling values go to the model as its ``sampling_parameters`` JSON input and
are validated there (a bad value comes back as the model's error, answered here as a 400)."""

from openai_frontend.app import create_app

__all__ = ["create_app"]
