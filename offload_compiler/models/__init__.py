"""Models trinity ships for its demo, tests, benchmarks and the plan command."""

from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
