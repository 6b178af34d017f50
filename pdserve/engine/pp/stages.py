"""Which layers each stage of a pipeline-parallel engine holds: an even split, or the counts of
`--pp-layer-partition` ("15,15"); which weights it is given (`stage_weights`). Torch-free:
`pdserve serve` checks a partition against the model before it starts any worker."""

from __future__ import annotations

import re

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class StagePlace:
    """A process's place in a pipeline: its `stage` and every stage's `layers`. `PPGroup` is
    one (with the stage's messages); so, bare, is a rank of a stage that is itself a
    tensor-parallel group, other than its first (which holds the stage's `PPGroup`)."""

    def __init__(self, stage: int, layers: list[range]) -> None:
        self.stage, self.layers = stage, layers

    @property
    def size(self) -> int:
        return len(self.layers)

    @property
    def held(self) -> range:
        return self.layers[self.stage]


def parse_partition(text: str) -> list[int]:
    """ "15,15" -> [15, 15]; ValueError naming what is wrong (not integers, a count under 1)."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--pp-layer-partition {text!r}: give each stage's layer count, comma-separated "
            "(e.g. 15,15)"
        ) from None
    if any(c < 1 for c in counts):
        raise ValueError(f"--pp-layer-partition {text!r}: every stage needs at least one layer")
    return counts


def stage_layers(num_layers: int, size: int, partition: str | None = None) -> list[range]:
    """The layers of each of `size` stages, in order, covering [0, num_layers) once. Even:
    the first `num_layers % size` stages hold one layer more. ValueError, saying what to
    change, when `size` exceeds the layers or `partition` does not split them in `size`."""
    if size < 1:
        raise ValueError(f"--pipeline-parallel-size must be >= 1, got {size}")
    if size > num_layers:
        raise ValueError(
            f"--pipeline-parallel-size {size} is larger than the model's {num_layers} layers: "
            f"every stage needs at least one layer (use at most {num_layers})"
        )
    if partition is None:
        per, extra = divmod(num_layers, size)
        counts = [per + (s < extra) for s in range(size)]
    else:
        counts = parse_partition(partition)
        if len(counts) != size:
            raise ValueError(
                f"--pp-layer-partition {partition!r} names {len(counts)} stages, but "
                f"--pipeline-parallel-size is {size}: give one count per stage"
            )
        if sum(counts) != num_layers:
            raise ValueError(
                f"--pp-layer-partition {partition!r} adds up to {sum(counts)} layers; the model "
                f"has {num_layers}: the counts must add up to it"
            )
    out, start = [], 0
    for c in counts:
        out.append(range(start, start + c))
        start += c
    return out


def stage_weights(weights: dict, layers: range, first: bool) -> dict:
    """The weights a stage builds its part from: its layers' (and the model-wide ones but the
    embeddings and head on a stage other than the first: it neither embeds nor samples)."""
    out = {}
    for name, w in weights.items():
        m = _LAYER.match(name)
        if m is not None:
            if int(m.group(1)) in layers:
                out[name] = w
        elif first or name not in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = w
    return out
