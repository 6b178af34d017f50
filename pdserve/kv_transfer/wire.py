"""The socket protocol of the tcp (and nixl control) connector: typed frames, size limits, the
handshake with layout check and optional HMAC challenge-response, and the shared secret.

Every frame is a 4-byte big-endian length followed by one msgpack-encoded message; frames over
`MAX_FRAME_BYTES` are refused before they are read. Handshake, on every new connection:

    receiver -> ServerHello(nonce_r, auth)           sender -> ClientHello(layout, nonce_s, mac_s)
    receiver -> Accept(mac_r, its layout) | Refuse(reason)

with mac_s = HMAC(secret, "client" | nonce_r | nonce_s) and mac_r = HMAC(secret, "server" |
nonce_s | nonce_r), both empty without a secret. Each side refuses a peer that does not prove the
secret it holds itself, so a sender with a secret never sends KV to an impostor either. After the
handshake the sender streams `LayerHeader` frames (+ raw block bytes for tcp) and the receiver
answers each with one `LayerAck`, in order. The handshake authenticates the peer; it does not
encrypt or MAC the block bytes, so on an untrusted network run the fabric inside a VPN/tunnel.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import select
import socket
import struct
from typing import TypeVar

import msgspec

from pdserve import envs
from pdserve.kv_transfer.layout import KVLayout

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 64 * 1024
MIN_SECRET_BYTES = 16
HOW_TO_SET_SECRET = (
    f"set the same shared secret (at least {MIN_SECRET_BYTES} bytes) on every worker: "
    f"export {envs.SECRET}=$(openssl rand -hex 32), or put it in a file readable only by the "
    f"service user and export {envs.SECRET_FILE}=/path/to/file"
)
_LEN = struct.Struct("!I")
T = TypeVar("T")


class ProtocolError(ConnectionError):
    """The peer broke the protocol (oversized or malformed frame, unexpected message)."""


class HandshakeRefused(ConnectionError):
    """The peer refused us (or we refused it); the message says why and what to do."""


class ServerHello(msgspec.Struct, tag="server_hello", frozen=True):
    version: int
    nonce: bytes
    auth: bool


class ClientHello(msgspec.Struct, tag="client_hello", frozen=True):
    version: int
    layout: KVLayout
    nonce: bytes
    mac: bytes
    extra: bytes = b""  # backend data, e.g. the sender's NIXL agent metadata


class Accept(msgspec.Struct, tag="accept", frozen=True):
    mac: bytes
    layout: KVLayout | None = None  # the receiver's (which rank, so which heads); a store: None


class Refuse(msgspec.Struct, tag="refuse", frozen=True):
    reason: str


class LayerHeader(msgspec.Struct, tag="layer", frozen=True):
    transfer_id: str
    layer: int
    src_block_ids: list[int]
    dst_block_ids: list[int]
    nbytes: int  # payload that follows (tcp) or that the receiver reads (nixl)
    encoding: str = "raw"  # "raw" block bytes, or "fp8" (fp8.py; tcp only)


class LayerAck(msgspec.Struct, tag="ack", frozen=True):
    transfer_id: str
    layer: int
    error: str | None = None


Message = ServerHello | ClientHello | Accept | Refuse | LayerHeader | LayerAck
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def secret_from_env() -> bytes | None:
    """The shared secret from $PDSERVE_SECRET or the file named by $PDSERVE_SECRET_FILE."""
    value, path = envs.secret_text(), envs.secret_file()
    if value is None and path is None:
        return None
    if value is not None:
        secret = value.encode()
    else:
        try:
            with open(path, "rb") as f:  # type: ignore[arg-type]
                secret = f.read().strip()
        except OSError as exc:
            raise ValueError(f"cannot read {envs.SECRET_FILE}={path}: {exc.strerror}") from exc
    check_secret(secret)
    return secret


def resolve_secret(secret: bytes | None) -> bytes | None:
    """`secret` if given, else the one from the environment (or None); checked for length."""
    secret = secret if secret is not None else secret_from_env()
    check_secret(secret)
    return secret


def check_secret(secret: bytes | None) -> None:
    if secret is not None and len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the KV transfer secret is too short; {HOW_TO_SET_SECRET}")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from outside


def parse_endpoint(endpoint: str, scheme: str) -> tuple[str, int]:
    """("host", port) from "scheme://host:port"; ValueError saying the expected form."""
    prefix = f"{scheme}://"
    host, _, port = endpoint.removeprefix(prefix).rpartition(":")
    if not endpoint.startswith(prefix) or not host or not port.isdigit():
        raise ValueError(f"bad KV endpoint {endpoint!r}: expected {prefix}HOST:PORT")
    return host.strip("[]"), int(port)


def send_frame(sock: socket.socket, msg: Message) -> None:
    data = _encoder.encode(msg)
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_frame(sock: socket.socket, kind: type[T]) -> T:
    """Read one frame and check it is a `kind` (a Refuse becomes HandshakeRefused)."""
    size = _LEN.unpack(recv_exact(sock, _LEN.size))[0]
    if size > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {size} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        msg = _decoder.decode(recv_exact(sock, size))
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"malformed frame: {exc}") from exc
    if isinstance(msg, Refuse) and kind is not Refuse:
        raise HandshakeRefused(msg.reason)
    if not isinstance(msg, kind):
        raise ProtocolError(f"expected {kind.__name__}, got {type(msg).__name__}")
    return msg


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return buf


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` from the socket (straight into the caller's memory, no staging copy)."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"peer closed the connection ({got} of {n} bytes read)")
        got += k


def shutdown_socket(sock: socket.socket) -> None:
    """Wake any thread blocked on `sock` (recv returns, sendall raises)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed or never connected


def wait_hangup(sock: socket.socket, timeout_s: float) -> bool:
    """Wait up to `timeout_s` for the peer to close or reset `sock`: True if it did. Sees the
    hang-up behind bytes not yet read (POLLRDHUP), so it reads nothing."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(timeout_s * 1000))


def _mac(secret: bytes | None, label: bytes, a: bytes, b: bytes) -> bytes:
    if secret is None:
        return b""
    return hmac.new(secret, label + a + b, hashlib.sha256).digest()


def client_handshake(
    sock: socket.socket, layout: KVLayout, secret: bytes | None, extra: bytes = b""
) -> KVLayout | None:
    """Sender side: returns the receiver's layout (None from the KV store). Raises
    HandshakeRefused with the receiver's reason, or if it is unproven."""
    hello = recv_frame(sock, ServerHello)
    if hello.version != PROTOCOL_VERSION:
        raise HandshakeRefused(f"receiver speaks KV protocol v{hello.version}, we speak v1")
    nonce = secrets.token_bytes(32)
    mac = _mac(secret, b"client", hello.nonce, nonce)
    send_frame(sock, ClientHello(PROTOCOL_VERSION, layout, nonce, mac, extra))
    accept = recv_frame(sock, Accept)
    if secret is not None and not hmac.compare_digest(
        accept.mac, _mac(secret, b"server", nonce, hello.nonce)
    ):
        raise HandshakeRefused(f"the receiver did not prove the shared secret; {HOW_TO_SET_SECRET}")
    return accept.layout


def server_handshake(
    sock: socket.socket, layout: KVLayout | None, secret: bytes | None
) -> ClientHello:
    """Receiver side. Returns the sender's hello, or sends Refuse and raises HandshakeRefused
    (a layout this receiver's heads cannot be filled from: `KVLayout.segments_from`). `layout`
    None takes every layout (the KV store: the layout is part of each key)."""
    nonce = secrets.token_bytes(32)
    send_frame(sock, ServerHello(PROTOCOL_VERSION, nonce, secret is not None))
    hello = recv_frame(sock, ClientHello)
    reason = None
    if secret is not None and not hmac.compare_digest(
        hello.mac, _mac(secret, b"client", nonce, hello.nonce)
    ):
        reason = f"KV receiver refused an unauthenticated sender; {HOW_TO_SET_SECRET}"
    elif hello.version != PROTOCOL_VERSION:
        reason = f"sender speaks KV protocol v{hello.version}, this receiver speaks v1"
    elif layout is not None:
        try:
            layout.segments_from(hello.layout)
        except ValueError as exc:
            reason = str(exc)
    if reason is not None:
        send_frame(sock, Refuse(reason))
        raise HandshakeRefused(reason)
    send_frame(sock, Accept(_mac(secret, b"server", hello.nonce, nonce), layout))
    return hello
