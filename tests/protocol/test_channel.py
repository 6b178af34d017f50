"""The signed control channel (`protocol/channel.py`): loopback binds need no secret, others are
refused without one with a message saying how to set it; the codec accepts only frames signed
with its secret and drops malformed, unknown and oversized ones. On a live router:
tests/security/test_control_channel.py."""

from __future__ import annotations

import msgspec
import pytest
from security.conftest import SECRET  # the security suite's secret: one for every signed frame

from pdserve.protocol import messages as m
from pdserve.protocol.channel import Codec, require_secret_for


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_secret(host):
    require_secret_for(host, None)  # does not raise


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.com", "127.0.0.1.nip.io"])
def test_non_loopback_without_secret_is_refused_with_how_to(host):
    with pytest.raises(ValueError, match="PDSERVE_SECRET") as info:
        require_secret_for(host, None)
    assert "PDSERVE_SECRET_FILE" in str(info.value)
    require_secret_for(host, SECRET.encode())  # with a secret it is allowed


def frames_of(msg, secret: bytes) -> list[bytes]:
    return Codec(secret).encode(msg)


@pytest.fixture
def abort():
    return m.Abort("r0")


def test_codec_accepts_only_frames_signed_with_its_secret(abort):
    codec = Codec(SECRET.encode())
    mac, payload = frames_of(abort, SECRET.encode())
    assert codec.decode([mac, payload]) == abort
    assert codec.decode([payload]) is None  # unsigned
    assert codec.decode(frames_of(abort, b"another secret of enough length!")) is None
    tampered = msgspec.msgpack.encode(m.Abort("r1"))
    assert codec.decode([mac, tampered]) is None  # a valid MAC of another payload
    assert codec.decode([mac[:-1], payload]) is None
    assert codec.decode([mac, payload, b""]) is None


def test_codec_drops_malformed_and_unknown_messages():
    codec = Codec(None)
    assert codec.decode([b"\xc1"]) is None  # not msgpack
    assert codec.decode([msgspec.msgpack.encode({"type": "Evil", "code": "rm -rf /"})]) is None
    assert codec.decode([msgspec.msgpack.encode({"type": "Abort"})]) is None  # field missing
    assert codec.decode([msgspec.msgpack.encode({"type": "Abort", "request_id": 3})]) is None


def test_codec_drops_oversized_frames():
    big = m.Abort("r" * (m.MAX_MESSAGE_BYTES + 1))
    assert Codec(None).decode(Codec(None).encode(big)) is None
