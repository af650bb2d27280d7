"""grpolab: a GRPO trainer whose every intermediate quantity is checked."""

__version__ = "0.1.0"
