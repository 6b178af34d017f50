"""pdserve: LLM serving with prefill and decode disaggregated.

`from pdserve import LLM, SamplingParams` is the offline API; the imports are lazy so that
`pdserve --help` and the simulator do not pay for torch.
"""

from __future__ import annotations

from pdserve import envs as _envs

_envs.bound_kernel_caches()  # before any kernel exists: every pdserve import comes through here

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
