"""The router's tokenizer side: a chat request's conversation through the chat template (with
its tools), the /tokenize and /detokenize endpoints, and a token's text for logprobs."""

from __future__ import annotations

import functools
import json

from pdserve.engine.guided import GuideSpec
from pdserve.model.tokenizer import Tokenizer
from pdserve.router import tools
from pdserve.router.openai_api.errors import APIError
from pdserve.router.openai_api.fields import messages_of
from pdserve.router.openai_api.plans import check_token_ids
from pdserve.router.openai_api.schemas import ChatRequest, DetokenizeRequest, TokenizeRequest


class Prompts:
    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        # a token's text in logprobs (special tokens shown)
        self.token_text = functools.lru_cache(maxsize=1 << 16)(
            lambda t: tokenizer.decode([t], skip_special_tokens=False)
        )

    def chat_ids(
        self, req, tool_list: list | None, add_generation_prompt: bool = True
    ) -> list[int]:
        """The conversation of a chat or /tokenize request through the chat template."""
        try:
            return self.tok.apply_chat_template(
                messages_of(req), add_generation_prompt, tools=tool_list
            )
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages") from None

    def render(self, req: ChatRequest) -> tuple[list[int], bool, GuideSpec | None]:
        """A chat request's prompt ids, whether its answer may be a tool call, and the
        constraint that forces one (tool_choice required or named)."""
        try:
            tools.check_tools(req.tools, req.tool_choice)
        except tools.ToolError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        choice = req.tool_choice or ("auto" if req.tools else "none")
        use = bool(req.tools) and choice != "none"
        if use and not tools.template_supports_tools(self.tok.chat_template):
            raise APIError(
                400,
                "this model's chat template does not support tools; start pdserve with "
                "--chat-template llama3_json_tools (or a template file that renders `tools`)",
                param="tools",
            )
        ids = self.chat_ids(req, tools.tools_for_template(req.tools) if use else None)
        schema = tools.tool_call_schema(req.tools, choice) if use else None
        return ids, use, GuideSpec("json_schema", json.dumps(schema)) if schema else None

    def tokenize(self, req: TokenizeRequest, max_model_len: int | None) -> dict:
        """vLLM's answer shape (`count`, `max_model_len`, `tokens`), which holds llama.cpp's."""
        given = [k for k in ("prompt", "content", "messages") if getattr(req, k) is not None]
        if len(given) != 1:
            raise APIError(400, "send exactly one of prompt, content or messages")
        if req.messages is not None:
            listed = tools.tools_for_template(req.tools) if req.tools else None
            ids = self.chat_ids(req, listed, req.add_generation_prompt)
        else:
            ids = self.tok.encode(req.prompt or req.content or "", req.add_special_tokens)
        out = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [self.token_text(t) for t in ids]
        return out

    def detokenize(self, req: DetokenizeRequest) -> dict:
        """vLLM's `prompt` and llama.cpp's `content`: the same text."""
        check_token_ids(req.tokens, "tokens", self.tok.vocab_size)
        text = self.tok.decode(req.tokens)
        return {"prompt": text, "content": text}
