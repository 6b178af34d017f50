"""Offline API: `LLM(...).generate(prompts, params)` and `.chat(messages, params)`."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None


class LLM:
    """A whole engine in this process. `model=None` is the bundled SmolLM2-135M-Instruct."""

    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        config: EngineConfig | None = None,
        **engine_kwargs,
    ):
        config = config or EngineConfig(model=model, dtype=dtype, device=device, **engine_kwargs)
        self.engine = LLMEngine(config)
        self.model_config = self.engine.model_config

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | None = None,
    ) -> list[RequestOutput]:
        """Completions for every prompt (strings or token-id lists), in order, batched."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        seqs = [self.engine.make_sequence(p, params) for p in prompts]  # validate all first
        for seq in seqs:
            self.engine.requests[seq.request_id] = seq
            self.engine.scheduler.add(seq)
        while self.engine.has_work():
            self.engine.step()
        return [self._output(s) for s in seqs]

    def chat(
        self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Applies the model's chat template (with the assistant turn opened) and generates."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c) for c in convs]
        return self.generate(prompts, params)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        if not messages:
            raise ValueError("chat needs at least one message")
        return self.tokenizer.apply_chat_template(messages)

    def _output(self, seq) -> RequestOutput:
        text = (
            seq.output_text
            if seq.params.stop and seq.finish_reason == "stop" and seq.output_text
            else None
        )
        if text is None:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        return RequestOutput(
            seq.request_id,
            seq.token_ids[: seq.num_prompt_tokens],
            seq.output_token_ids,
            text,
            seq.finish_reason,
        )
