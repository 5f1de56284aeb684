"""A continuous-batching LLM engine over a paged KV cache, for Triton's Python backend and on its own."""

from backend.config import EngineConfig
from backend.errors import EngineDeadError, EngineOverloadedError, EngineUnavailableError
from backend.llm_engine import LLMEngine
from backend.outputs import RequestMetrics, RequestOutput
from backend.request import Request, RequestStatus
from backend.sampling_params import SamplingParams
from backend.stats import EngineStats

__all__ = ["EngineConfig", "EngineDeadError", "EngineOverloadedError", "EngineStats", "EngineUnavailableError",
           "LLMEngine", "Request", "RequestMetrics", "RequestOutput", "RequestStatus", "SamplingParams"]
