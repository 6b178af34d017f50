"""A light tokenizer: HF `tokenizers` plus the model's Jinja chat template.

Importing `transformers` costs seconds per process; workers and the router only need this.
`transformers` is used once, to extract a tokenizer from a GGUF file into the cache folder.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATES = Path(__file__).parent / "templates"  # chat templates shipped with pdserve


def _token_str(value) -> str | None:
    if isinstance(value, dict):  # older configs store AddedToken dicts
        return value.get("content")
    return value


def load_chat_template(name_or_path: str) -> str:
    """A chat template's text: a shipped one by name (`llama3_json_tools`) or a .jinja file."""
    shipped = TEMPLATES / f"{name_or_path}.jinja"
    path = shipped if shipped.exists() else Path(name_or_path).expanduser()
    if not path.is_file():
        names = ", ".join(sorted(p.stem for p in TEMPLATES.glob("*.jinja")))
        raise FileNotFoundError(
            f"chat template {name_or_path!r} is neither a file nor a shipped template ({names})"
        )
    return path.read_text()


def _raise_exception(message):
    raise ValueError(f"the chat template refused the messages: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # as transformers does: jinja's own tojson escapes <, >, & and ' for HTML, which would
    # change what the model reads (tool descriptions, code in tool results)
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    return env.from_string(template)


def _template_message(msg: dict) -> dict:
    """`msg` as chat templates expect it: tool-call arguments as a dict (OpenAI sends a JSON
    string; HF templates write `arguments | tojson`), unset tool keys left out."""
    msg = {k: v for k, v in msg.items() if not (k in ("tool_calls", "tool_call_id") and not v)}
    if msg.get("tool_calls"):
        msg["tool_calls"] = [_with_dict_arguments(call) for call in msg["tool_calls"]]
    return msg


def _with_dict_arguments(call: dict) -> dict:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        return call  # the template shows the string as it is
    return {**call, "function": {**fn, "arguments": args}}


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
        self.path = folder / "tokenizer.json"
        self._tok = HFTokenizer.from_file(str(self.path))
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

    def with_chat_template(self, template: str) -> Tokenizer:
        """A copy of this tokenizer that renders chats with `template` instead."""
        other = copy.copy(self)
        other.chat_template = template
        return other

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        """The conversation as prompt text. `tools` (OpenAI tool dicts) reach the template only
        when given, so templates that test `tools is defined` see no tools otherwise."""
        if not self.chat_template:
            raise ValueError("this model has no chat template: use the completions API instead")
        extra = {} if tools is None else {"tools": tools}
        try:
            return _compile(self.chat_template).render(
                messages=[_template_message(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"could not apply the chat template: {exc}") from None

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> list[int]:
        """Token ids of the rendered conversation (special tokens are in the text already)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, tools))


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas, holding back an incomplete UTF-8
    character (shown as U+FFFD) until the next token completes it.

    Each token decodes a short window, not the whole output (as vLLM's incremental
    detokenizer): the tokens since the last text was released plus the ones before them
    (`prefix`), whose own text is cut off the front. Decoding everything so far made a
    token's cost grow with the output (a 2,000-token answer: ~2,000 tokens decoded a token,
    in the router's one thread); the window keeps the context a tokenizer's decoder needs
    (SentencePiece's leading-space rule, byte tokens of one character)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # the window's first token
        self.read = 0  # tokens whose text has been released

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix : self.read]) if self.read > self.prefix else ""
        text = decode(self.ids[self.prefix :])
        if text.endswith("\ufffd") or len(text) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]
