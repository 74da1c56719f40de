"""A minimal TensorBoard scalar writer for machines without the ``tensorboard`` package.

``torch.utils.tensorboard`` needs ``tensorboard`` installed; this writes the same event files
(``events.out.tfevents.<time>.<host>``) for scalars only, so that the run directory opens in
TensorBoard wherever it is installed later. Format: TFRecord framing (``uint64`` length, masked
CRC-32C of the length, the bytes, masked CRC-32C of the bytes) around ``tensorflow.Event``
protocol buffers, encoded by hand:

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
    Summary { repeated Value value = 1; }
    Value   { string tag = 1; float simple_value = 2; }
"""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import List, Tuple

__all__ = ["ScalarEventWriter", "crc32c", "read_scalar_events"]


def _crc_table() -> List[int]:
    poly = 0x82F63B78  # CRC-32C (Castagnoli), reflected
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int = 0, file_version: str = "", summary: bytes = b"") -> bytes:
    out = b"\x09" + struct.pack("<d", wall_time)
    if step:
        out += b"\x10" + _varint(step)
    if file_version:
        out += _field_bytes(3, file_version.encode())
    if summary:
        out += _field_bytes(5, summary)
    return out


class ScalarEventWriter:
    """``add_scalar(tag, value, step)`` into a new event file under ``logdir``."""

    def __init__(self, logdir: str):
        os.makedirs(logdir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}.ds_infcl"
        self.path = os.path.join(logdir, name)
        self._f = open(self.path, "ab")
        self._write(_event(time.time(), file_version="brain.Event:2"))

    def _write(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._f.write(header + struct.pack("<I", _masked(header)) + data + struct.pack("<I", _masked(data)))
        self._f.flush()

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        value_msg = _field_bytes(1, tag.encode()) + b"\x15" + struct.pack("<f", float(value))
        self._write(_event(time.time(), int(step), summary=_field_bytes(1, value_msg)))

    def close(self) -> None:
        self._f.close()


def _read_varint(buf: bytes, i: int) -> Tuple[int, int]:
    shift = n = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def _fields(buf: bytes):
    i = 0
    while i < len(buf):
        key, i = _read_varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(buf, i)
        elif wire == 1:
            value, i = buf[i : i + 8], i + 8
        elif wire == 5:
            value, i = buf[i : i + 4], i + 4
        elif wire == 2:
            n, i = _read_varint(buf, i)
            value, i = buf[i : i + n], i + n
        else:
            raise ValueError(f"unsupported wire type {wire}")
        yield number, value


def read_scalar_events(path: str) -> List[Tuple[str, int, float]]:
    """``(tag, step, value)`` of every scalar in an event file, checking the CRCs (tests use it)."""
    out = []
    with open(path, "rb") as f:
        data = f.read()
    i = 0
    while i < len(data):
        header = data[i : i + 8]
        (n,) = struct.unpack("<Q", header)
        if struct.unpack("<I", data[i + 8 : i + 12])[0] != _masked(header):
            raise ValueError(f"{path}: bad length CRC at byte {i}")
        record = data[i + 12 : i + 12 + n]
        if struct.unpack("<I", data[i + 12 + n : i + 16 + n])[0] != _masked(record):
            raise ValueError(f"{path}: bad data CRC at byte {i}")
        i += 16 + n
        step, summary = 0, None
        for number, value in _fields(record):
            if number == 2:
                step = value
            elif number == 5:
                summary = value
        if summary is None:
            continue
        for number, value_msg in _fields(summary):
            tag, scalar = None, None
            for n2, v2 in _fields(value_msg):
                if n2 == 1:
                    tag = v2.decode()
                elif n2 == 2:
                    (scalar,) = struct.unpack("<f", v2)
            out.append((tag, step, scalar))
    return out
