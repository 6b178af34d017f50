"""Offline API: `LLM(...).generate(prompts, params)` and `.chat(messages, params)`."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.stops import TextStream


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
        # stop strings are found in the text as it grows; without any, it is decoded once
        texts = {s.request_id: self._text_stream(params) for s in seqs} if params.stop else {}
        for seq in seqs:
            self.engine.requests[seq.request_id] = seq
            self.engine.scheduler.add(seq)
        stopped = set()  # ended by a stop string
        while self.engine.has_work():
            for out in self.engine.step():
                self._watch_stops(out, texts, stopped)
        return [self._output(s, texts.get(s.request_id), s.request_id in stopped) for s in seqs]

    def _watch_stops(self, out, texts: dict[str, TextStream], stopped: set[str]) -> None:
        """A sequence whose text reached a stop string ends there (its token is its last)."""
        rid = out.seq.request_id
        if rid not in texts or rid in stopped:
            return
        texts[rid].push(out.new_token)
        if texts[rid].hit:
            stopped.add(rid)
            if not out.finished:
                self.engine.abort(rid)

    def _text_stream(self, params: SamplingParams) -> TextStream:
        eos = self.tokenizer.eos_token_id
        return TextStream(self.tokenizer, params.stop, set() if eos is None else {eos})

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

    def _output(self, seq, stream: TextStream | None, stopped: bool) -> RequestOutput:
        """`stream`: the output's text as it grew (cut before a stop string), if it had stops."""
        if stream is not None:
            text = stream.text
        else:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        return RequestOutput(
            seq.request_id,
            seq.token_ids[: seq.num_prompt_tokens],
            seq.output_token_ids,
            text,
            "stop" if stopped else seq.finish_reason,
        )
