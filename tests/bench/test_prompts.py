import pytest

from pdserve.bench.prompts import (
    FilePromptBuilder,
    approximate_builder,
    exact_builder,
    file_requests,
    load_prompt_builder,
    load_prompt_file,
)
from pdserve.bench.workload import LengthDist, RequestSpec


def spec(index: int, tokens: int) -> RequestSpec:
    return RequestSpec(index, 0.0, "chat", tokens, 1)


class SplitTokenizer:
    """Words longer than `max_len` letters are two tokens; everything else one per word."""

    def __init__(self, max_len: int = 99) -> None:
        self.max_len = max_len

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert add_special_tokens is False
        return [0 for w in text.split() for _ in range(1 if len(w) <= self.max_len else 2)]


class MergingTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [0] * max(1, len(text.split()) // 2)


def test_approximate_prompts_are_seeded_and_distinct():
    builder = approximate_builder(seed=4)
    assert not builder.exact
    text = builder.build(spec(0, 50))
    assert len(text.split()) == 50
    assert text == approximate_builder(seed=4).build(spec(0, 50))
    assert text != builder.build(spec(1, 50))
    assert text != approximate_builder(seed=5).build(spec(0, 50))


def test_exact_builder_keeps_single_token_words_only():
    builder = exact_builder(SplitTokenizer(max_len=4), seed=0, source="split")
    assert builder.exact
    assert builder.source == "split"
    assert all(len(w.strip()) <= 4 for w in builder.words)
    text = builder.build(spec(3, 777))
    assert len(SplitTokenizer(4).encode(text, add_special_tokens=False)) == 777


def test_a_tokenizer_that_merges_words_falls_back_to_approximate(caplog):
    builder = exact_builder(MergingTokenizer(), seed=0, source="merging")
    assert not builder.exact
    assert "does not give one token per word" in caplog.text


def test_unavailable_tokenizer_falls_back_with_a_warning(caplog, tmp_path):
    builder = load_prompt_builder(str(tmp_path / "missing.gguf"), seed=0)
    assert not builder.exact
    assert "no tokenizer" in caplog.text
    assert not load_prompt_builder("none", seed=0).exact


@pytest.mark.slow
def test_bundled_tokenizer_gives_exact_lengths():
    try:
        from pdserve.model.loader import load_tokenizer

        tokenizer = load_tokenizer(None)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"bundled tokenizer unavailable: {exc}")
    builder = exact_builder(tokenizer, seed=1, source="bundled")
    assert builder.exact
    for n in (1, 97, 3000):
        text = builder.build(spec(n, n))
        assert len(tokenizer.encode(text, add_special_tokens=False)) == n


def test_prompt_file_and_its_requests(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt": "one two three", "output_tokens": 7, "class": "qa"}\n\n'
        '{"prompt": "four five", "max_tokens": 2}\n'
    )
    prompts = load_prompt_file(path)
    assert [(p.prompt, p.output_tokens, p.klass) for p in prompts] == [
        ("one two three", 7, "qa"),
        ("four five", 2, "file"),
    ]
    specs = file_requests(prompts, LengthDist.fixed(9), 3, seed=0)
    assert [s[2:] for s in specs] == [("qa", 3, 7), ("file", 2, 2), ("qa", 3, 7)]
    builder = FilePromptBuilder(prompts, "file")
    assert [builder.build(s) for s in specs] == ["one two three", "four five", "one two three"]


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"prompt": 5}\n', r"p.jsonl:1: expected a JSON object with a string \"prompt\""),
        ('{"prompt": "x"}\nnot json\n', "p.jsonl:2: expected"),
        ('{"prompt": "x", "output_tokens": 0}\n', "p.jsonl:1: expected"),
        ("\n\n", "no prompts in the file"),
    ],
)
def test_prompt_file_errors_name_the_line(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_prompt_file(path)
