"""A light tokenizer: HF `tokenizers` plus the model's Jinja chat template.

Importing `transformers` costs seconds per process; workers and the router only need this.
`transformers` is used once, to extract a tokenizer from a GGUF file into the cache folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _token_str(value) -> str | None:
    if isinstance(value, dict):  # older configs store AddedToken dicts
        return value.get("content")
    return value


class Tokenizer:
    """encode/decode, special tokens and chat template of one model (from a tokenizer folder)."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer as HFTokenizer

        folder = Path(folder)
        if not (folder / "tokenizer.json").exists():
            raise FileNotFoundError(
                f"{folder}: no tokenizer.json; a Hugging Face model folder needs its tokenizer "
                "files (tokenizer.json, tokenizer_config.json)"
            )
        self._tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.bos_token = _token_str(cfg.get("bos_token"))
        self.eos_token = _token_str(cfg.get("eos_token"))
        template = cfg.get("chat_template")
        if (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text()
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template: use the completions API instead")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message):
            raise ValueError(f"the chat template refused the messages: {message}")

        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"could not apply the chat template: {exc}") from None

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered conversation (special tokens are in the text already)."""
        return self.encode(self.render_chat(messages, add_generation_prompt))


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas, holding back an incomplete UTF-8
    character (shown as U+FFFD) until the next token completes it."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        delta, self.emitted = text[len(self.emitted) :], text
        return delta
