"""The offline API's `SamplingParams`: the one sampling type, defined (and validated) with the
control messages in pdserve/protocol/sampling.py, which the router and the workers share."""

from __future__ import annotations

from pdserve.protocol.sampling import MAX_LOGPROBS, SamplingError, SamplingParams

__all__ = ["MAX_LOGPROBS", "SamplingError", "SamplingParams"]
