"""grpolab: a GRPO trainer whose every intermediate quantity is checked."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # The Python API on first use: `import grpolab` stays light (no torch) for the commands.
    if name in ("GRPOTrainer", "GRPOConfig"):
        from grpolab import api

        return getattr(api, name)
    raise AttributeError(f"module 'grpolab' has no attribute {name!r}")


__all__ = ["GRPOConfig", "GRPOTrainer", "__version__"]
