"""SamplingParams is the one sampling type: validated once when made (a worker decoding it off
the wire too), and it travels in the control messages as it is."""

from __future__ import annotations

import msgspec
import pytest

from pdserve import SamplingParams as Exported
from pdserve.engine.guided import GuideSpec
from pdserve.engine.sampling_params import SamplingParams as Engine
from pdserve.protocol import messages as m
from pdserve.protocol.sampling import SamplingError, SamplingParams


def test_one_type_under_every_name():
    assert Exported is Engine is SamplingParams is m.Params


def test_admit_carries_it_through_the_wire():
    params = SamplingParams(
        max_tokens=3, stop=["a"], logit_bias=[(1, 2)], guide=GuideSpec("regex", "a+"), seed=4
    )
    assert params.stop == ("a",) and params.logit_bias == ((1, 2.0),)
    admit = m.Admit("r", [1, 2], params, True, 1.0)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(admit), type=m.Message)
    assert back == admit and back.params is not params


def test_a_worker_refuses_a_bad_value_off_the_wire():
    frame = msgspec.msgpack.encode(m.Prefill("r", [1], SamplingParams(), ["e"], [0], 0))
    bad = frame.replace(msgspec.msgpack.encode(0.0), msgspec.msgpack.encode(9.0), 1)
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        msgspec.msgpack.decode(bad, type=m.Message)


@pytest.mark.parametrize(
    ("kwargs", "param", "rule"),
    [
        ({"temperature": 2.5}, "temperature", "must be >= 0 (0 = greedy) and <= 2, got 2.5"),
        ({"top_k": 2**31}, "top_k", "must be in [0, 2^31) (0 = off), got 2147483648"),
        ({"seed": -1}, "seed", "must be in [0, 2^63), got -1"),
        ({"logit_bias": [(3, 101)]}, "logit_bias", "values must be in [-100, 100], got 101.0"),
        ({"logprobs": 21}, "logprobs", "must be in [0, 20], got 21"),
        ({"stop": [""]}, "stop", "must be non-empty strings, got ''"),
    ],
)
def test_a_bad_value_names_its_field(kwargs, param, rule):
    with pytest.raises(SamplingError) as caught:
        SamplingParams(**kwargs)
    assert (caught.value.param, caught.value.rule) == (param, rule)
    assert str(caught.value) == f"{param} {rule}"
