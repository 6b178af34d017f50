"""One choice's answer built from its pieces: logprob shapes, echo, tool calls, stream deltas."""

from pdserve.protocol import messages as m
from pdserve.router.output import Choice, Piece

TEXT = {1: "a", 2: "b", 3: "{", 4: '"name": "f", "parameters": {"x": 1}}', 5: "hi"}


def token_text(t: int) -> str:
    return TEXT.get(t, f"<{t}>")


def pieces(tokens, finish="stop"):
    out = [Piece(token_text(t), None, t, m.Logprobs(-0.5, [(t, -0.5), (9, -1.5)])) for t in tokens]
    return out[:-1] + [out[-1]._replace(finish=finish)]


def test_chat_logprobs_are_content_entries_with_top_logprobs():
    c = Choice(0, chat=True, token_text=token_text, want_logprobs=True)
    for piece in pieces([1, 2]):
        c.add(piece)
    whole = c.whole()
    assert whole["message"] == {"role": "assistant", "content": "ab"}
    entry = whole["logprobs"]["content"][1]
    assert entry["token"] == "b" and entry["logprob"] == -0.5 and entry["bytes"] == [98]
    assert [t["token"] for t in entry["top_logprobs"]] == ["b", "<9>"]


def test_completion_echo_puts_the_prompt_first_with_a_null_first_logprob():
    c = Choice(0, chat=False, token_text=token_text, want_logprobs=True)
    c.prepend("ab", [1, 2], [m.Logprobs(-2.0, [(2, -2.0)])])
    for piece in pieces([5]):
        c.add(piece)
    lp = c.whole()["logprobs"]
    assert c.whole()["text"] == "abhi"
    assert lp["tokens"] == ["a", "b", "hi"] and lp["token_logprobs"] == [None, -2.0, -0.5]
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"b": -2.0}
    assert lp["text_offset"] == [0, 1, 2]


def test_a_tool_call_is_held_back_while_streaming_then_sent_as_tool_calls():
    c = Choice(0, chat=True, token_text=token_text, tools=True)
    deltas = []
    for piece in pieces([3, 4]):
        c.add(piece)
        deltas.append(c.delta())
    assert deltas[0] is None  # "{" could still be a tool call
    last = deltas[1]
    assert last["finish_reason"] == "tool_calls" and last["delta"]["role"] == "assistant"
    (call,) = last["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert "content" not in last["delta"]
    assert c.whole()["message"]["content"] is None


def test_text_that_is_no_tool_call_streams_as_content_once_it_cannot_be_one():
    c = Choice(0, chat=True, token_text=token_text, tools=True)
    c.add(Piece(" ", None, 7, None))
    assert c.delta() is None  # whitespace: could still open a call
    c.add(Piece("hi {", None, 5, None))
    assert c.delta()["delta"] == {"role": "assistant", "content": " hi {"}
    c.add(Piece(" x", "stop", 5, None))
    assert c.delta() == {"index": 0, "finish_reason": "stop", "logprobs": None,
                         "delta": {"content": " x"}}  # fmt: skip


def test_max_tokens_zero_echo_keeps_only_the_prompt():
    c = Choice(0, chat=False, token_text=token_text, keep_output=False)
    c.prepend("ab", [1, 2], None)
    c.add(pieces([5], finish="length")[0])
    assert c.whole()["text"] == "ab" and c.whole()["finish_reason"] == "length"
