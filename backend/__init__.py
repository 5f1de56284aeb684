"""A continuous-batching LLM engine over a paged KV cache, for Triton's Python backend and on its own."""

from backend.config import EngineConfig
from backend.llm_engine import EngineStats, LLMEngine
from backend.outputs import RequestMetrics, RequestOutput
from backend.request import Request, RequestStatus
from backend.sampling_params import SamplingParams

__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "Request", "RequestMetrics", "RequestOutput",
           "RequestStatus", "SamplingParams"]
