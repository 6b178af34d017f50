"""The SSD tier's files: one file per block under `store_dir/<layout key>/<hash>.kvb`.

File format (all of it covered by the trailing checksum):

    MAGIC (8 bytes) | header length (4 bytes, big-endian) | RecordHeader (msgpack) | payload
    | SHA-256 of everything before it (32 bytes)

A file is written under a temporary name and renamed into place, without fsync: after a crash
a file may be torn or stale, which the checksum catches. Startup (`scan`) checks each file's
header and size (and, with `verify`, its checksum); every read checks the checksum before a
byte is served. A file that fails either check is deleted and never served.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import msgspec

from pdserve.kv_store.config import Key, layout_key, payload_bytes
from pdserve.kv_store.protocol import BlockMeta
from pdserve.kv_transfer.layout import KVLayout

log = logging.getLogger("pdserve.kv_store")
MAGIC = b"PDKVBLK1"
SUFFIX = ".kvb"
_HEAD = struct.Struct("!8sI")
_DIGEST_BYTES = 32
_MAX_HEADER_BYTES = 1 << 20
_HASH_MASK = (1 << 64) - 1


class CorruptRecord(ValueError):
    """A block file is torn, truncated, foreign or fails its checksum."""


class RecordHeader(msgspec.Struct, frozen=True):
    layout: KVLayout
    meta: BlockMeta
    payload_nbytes: int


class Scanned(NamedTuple):
    """A block file found at startup."""

    key: Key
    layout: KVLayout
    meta: BlockMeta
    size: int
    mtime: float


_decoder = msgspec.msgpack.Decoder(RecordHeader)


def _digest(*parts: bytes | memoryview) -> bytes:
    # SHA-256 rather than blake2b: with the SHA extensions of current x86 and ARM CPUs it ran
    # 2.6x faster here (790 vs 306 MB/s on a 360 KiB block), and every SSD read pays for it.
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.digest()


class SsdFiles:
    """Reads, writes and lists block files under `root`. Holds no index: the store does."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def path(self, key: Key) -> Path:
        return self.root / key.layout_key / f"{key.block_hash & _HASH_MASK:016x}{SUFFIX}"

    @staticmethod
    def encode_head(layout: KVLayout, meta: BlockMeta, nbytes: int) -> bytes:
        """Magic, length and header of a record: what precedes its payload in the file."""
        header = msgspec.msgpack.encode(RecordHeader(layout, meta, nbytes))
        return _HEAD.pack(MAGIC, len(header)) + header

    @staticmethod
    def file_size(head: bytes, nbytes: int) -> int:
        return len(head) + nbytes + _DIGEST_BYTES

    def write(self, key: Key, head: bytes, payload: bytes | memoryview) -> None:
        """Write one record (OSError on failure; a partial temporary file is removed)."""
        path = self.path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(payload)
                f.write(_digest(head, payload))
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def read(self, key: Key, nbytes: int) -> memoryview:
        """The payload of `key`'s file after checking header and checksum (CorruptRecord)."""
        try:
            with open(self.path(key), "rb") as f:
                buf = bytearray(os.fstat(f.fileno()).st_size)
                got = f.readinto(buf)
        except OSError as exc:
            raise CorruptRecord(f"cannot read {self.path(key).name}: {exc}") from exc
        view = memoryview(buf)[:got]
        header, start = self._parse_head(view, len(view), key)
        if header.payload_nbytes != nbytes:
            raise CorruptRecord(f"{self.path(key).name}: payload size differs from the index")
        end = start + nbytes
        if _digest(view[:end]) != view[end:]:
            raise CorruptRecord(f"{self.path(key).name}: checksum mismatch")
        return view[start:end]

    def delete(self, key: Key) -> None:
        self.path(key).unlink(missing_ok=True)

    def _parse_head(self, buf, file_size: int, key: Key | None) -> tuple[RecordHeader, int]:
        """Header of a record whose first bytes are `buf`; checks everything but the checksum."""
        if len(buf) < _HEAD.size:
            raise CorruptRecord("file shorter than its header")
        magic, hlen = _HEAD.unpack(bytes(buf[: _HEAD.size]))
        if magic != MAGIC or hlen > _MAX_HEADER_BYTES or len(buf) < _HEAD.size + hlen:
            raise CorruptRecord("bad magic or header length")
        try:
            header = _decoder.decode(buf[_HEAD.size : _HEAD.size + hlen])
        except (msgspec.DecodeError, ValueError) as exc:
            raise CorruptRecord(f"bad header: {exc}") from exc
        start = _HEAD.size + hlen
        if header.payload_nbytes != payload_bytes(header.layout):
            raise CorruptRecord("payload size does not match the layout")
        if file_size != start + header.payload_nbytes + _DIGEST_BYTES:
            raise CorruptRecord(f"file is {file_size} bytes, its header implies another size")
        if len(header.meta.token_ids) != header.layout.block_size:
            raise CorruptRecord("token count differs from the block size")
        found = Key(layout_key(header.layout), header.meta.block_hash)
        if key is not None and found != key:
            raise CorruptRecord("the file holds another block than its name says")
        return header, start

    def scan(self, verify: bool) -> tuple[list[Scanned], int]:
        """Every valid block file, oldest first, and how many bad files were deleted."""
        found, dropped = [], 0
        for path in self._files():
            try:
                found.append(self._check(path, verify))
            except CorruptRecord as exc:
                log.warning("KV store: dropping %s: %s", path, exc)
                path.unlink(missing_ok=True)
                dropped += 1
        found.sort(key=lambda s: s.mtime)
        return found, dropped

    def _files(self) -> Iterator[Path]:
        for sub in sorted(p for p in self.root.iterdir() if p.is_dir()):
            for path in sorted(sub.iterdir()):
                if path.suffix == ".tmp":  # a write cut short by a crash
                    path.unlink(missing_ok=True)
                elif path.suffix == SUFFIX:
                    yield path

    def _check(self, path: Path, verify: bool) -> Scanned:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            first = f.read(_HEAD.size)
            if len(first) == _HEAD.size:  # only the header: the payload is checked on read
                first += f.read(min(_HEAD.unpack(first)[1], _MAX_HEADER_BYTES))
        header, _ = self._parse_head(first, st.st_size, None)
        key = Key(layout_key(header.layout), header.meta.block_hash)
        if self.path(key) != path:
            raise CorruptRecord("the file holds another block than its name says")
        if verify:
            self.read(key, header.payload_nbytes)
        return Scanned(key, header.layout, header.meta, st.st_size, st.st_mtime)
