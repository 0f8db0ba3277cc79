"""gapless: an LLM inference server whose token streams never stall."""

from gapless.engine.config import EngineConfig
from gapless.engine.engine import Engine
from gapless.engine.llm import LLM, RequestOutput
from gapless.engine.sampling_params import SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
