"""Internal channels: loopback by default; a non-loopback bind without PDSERVE_SECRET is refused
with a message saying how to set it; with a secret, unsigned, wrongly signed, tampered or
malformed control frames are dropped (checked on a live router, through the real socket)."""

from __future__ import annotations

import msgspec
import pytest
from chaos.fakes import FakePrefill
from servers import run_serve

from pdserve.kv_transfer.base import KVLayout
from pdserve.protocol import messages as m
from pdserve.protocol.channel import Codec, require_secret_for

from .conftest import SECRET

NO_SECRET_ENV = {"PDSERVE_SECRET": None, "PDSERVE_SECRET_FILE": None}  # unset for run_serve


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_secret(host):
    require_secret_for(host, None)  # does not raise


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.com", "127.0.0.1.nip.io"])
def test_non_loopback_without_secret_is_refused_with_how_to(host):
    with pytest.raises(ValueError, match="PDSERVE_SECRET") as info:
        require_secret_for(host, None)
    assert "PDSERVE_SECRET_FILE" in str(info.value)
    require_secret_for(host, SECRET.encode())  # with a secret it is allowed


def test_serve_on_a_public_control_host_without_secret_exits_with_how_to():
    r = run_serve("--control-host", "0.0.0.0", env=NO_SECRET_ENV)
    assert r.returncode == 2
    assert "PDSERVE_SECRET" in r.stderr and "0.0.0.0" in r.stderr


def test_kv_receiver_on_a_public_host_without_secret_is_refused(monkeypatch):
    from pdserve.kv_transfer.tcp_receiver import TcpReceiver

    monkeypatch.delenv("PDSERVE_SECRET", raising=False)
    monkeypatch.delenv("PDSERVE_SECRET_FILE", raising=False)
    layout = KVLayout("x", "float32", 1, 16, 1, 8)
    with pytest.raises(ValueError, match="PDSERVE_SECRET"):
        TcpReceiver(layout, [], [], "0.0.0.0")


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


BOGUS = KVLayout("forged-model", "float32", 1, 16, 1, 8)


@pytest.mark.slow
@pytest.mark.parametrize("signer", [None, b"a wrong secret, long enough for any check"])
def test_live_router_ignores_unsigned_or_wrongly_signed_registration(secured, signer):
    fake = FakePrefill(secured.control_endpoint, "forged", "stall", BOGUS, secret=signer)
    try:
        assert fake.register(timeout_s=1.5) is None  # dropped: no answer at all
    finally:
        fake.close()
    assert "forged" not in secured.health()


@pytest.mark.slow
def test_live_router_answers_a_correctly_signed_registration(secured):
    """The control for the test above: the same frame, signed, reaches the router (which then
    refuses the forged layout, naming the mismatch)."""
    fake = FakePrefill(secured.control_endpoint, "forged", "stall", BOGUS, secret=SECRET.encode())
    try:
        ack = fake.register(timeout_s=10)
    finally:
        fake.close()
    assert ack is not None and not ack.ok
    assert "model_fingerprint" in ack.error
