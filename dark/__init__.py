"""dark: serve a language model and teach it LoRA skills from corrections, at the same time."""
from .config import EngineConfig, LoraConfig
from .engine.sequence import SamplingParams
from .errors import DarkError, InvalidRequestError, ModelLoadError, PromptTooLongError, UnknownAdapterError
from .llm import AsyncOnlineLLM, Completion, OnlineLLM

__all__ = [
    "OnlineLLM", "AsyncOnlineLLM", "SamplingParams", "EngineConfig", "LoraConfig", "Completion",
    "DarkError", "InvalidRequestError", "ModelLoadError", "PromptTooLongError", "UnknownAdapterError",
]
__version__ = "0.1.0"
