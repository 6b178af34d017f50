"""One serializer for the control plane: msgpack frames, optionally HMAC-signed.

When a secret is configured every frame carries an HMAC-SHA256 of its payload and unsigned or
wrongly signed frames are dropped. Binding a non-loopback address without a secret is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import logging

import msgspec

from pdserve.kv_transfer import wire
from pdserve.protocol.messages import MAX_MESSAGE_BYTES, Message

log = logging.getLogger(__name__)
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def resolve_secret(secret: bytes | None = None) -> bytes | None:
    """An explicit secret, else $PDSERVE_SECRET / $PDSERVE_SECRET_FILE; the same rules (and
    minimum length) as the KV fabric, so one secret serves both planes."""
    return wire.resolve_secret(secret)


is_loopback = wire.is_loopback


def require_secret_for(host: str, secret: bytes | None) -> None:
    if not is_loopback(host) and not secret:
        raise ValueError(
            f"refusing to bind internal channels on {host} without authentication: "
            f"{wire.HOW_TO_SET_SECRET}; or bind 127.0.0.1"
        )


class Codec:
    def __init__(self, secret: bytes | None = None):
        self.secret = secret

    def encode(self, msg) -> list[bytes]:
        payload = _encoder.encode(msg)
        if self.secret is None:
            return [payload]
        return [hmac.new(self.secret, payload, hashlib.sha256).digest(), payload]

    def decode(self, frames: list[bytes]):
        """The message, or None for a frame that is unsigned, forged, oversized or malformed."""
        if self.secret is not None:
            if len(frames) != 2:
                return None
            mac, payload = frames
            if not hmac.compare_digest(
                mac, hmac.new(self.secret, payload, hashlib.sha256).digest()
            ):
                log.warning("dropped a control message with a bad signature")
                return None
        elif len(frames) != 1:
            return None
        else:
            payload = frames[0]
        if len(payload) > MAX_MESSAGE_BYTES:
            return None
        try:
            return _decoder.decode(payload)
        except msgspec.DecodeError:
            log.warning("dropped a malformed control message")
            return None
