"""Models trinity ships for its demo, tests, benchmarks and the plan command."""

from .gpt import GPT, GPTConfig
from .llama import Llama, LlamaConfig

__all__ = ["GPT", "GPTConfig", "Llama", "LlamaConfig"]
