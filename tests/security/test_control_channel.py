"""Internal channels, as the security suite sees them: a non-loopback bind without PDSERVE_SECRET
is refused with a message saying how to set it, by `pdserve serve` and by the KV receiver; a live
router drops unsigned or wrongly signed control frames (through the real socket). The codec's
own checks (loopback, signatures, malformed frames): tests/protocol/test_channel.py."""

from __future__ import annotations

import pytest
from chaos.fakes import FakePrefill
from servers import run_serve

from pdserve.kv_transfer.layout import KVLayout

from .conftest import SECRET

NO_SECRET_ENV = {"PDSERVE_SECRET": None, "PDSERVE_SECRET_FILE": None}  # unset for run_serve


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
