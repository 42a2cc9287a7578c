"""PCM WAV files: the header (format and where the samples lie) read without the samples.

The standard library's `wave` (Python 3.11) refuses the WAVE_FORMAT_EXTENSIBLE header that
converters write for 24- and 32-bit or multichannel PCM, and raises an empty RuntimeError on a
chunk whose size runs past the file (as a streaming writer leaves it): so the RIFF chunks are
read here, each failure as a WavError whose message is the reason.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import BinaryIO

PCM, EXTENSIBLE = 0x0001, 0xFFFE
# The sub-format GUID of an extensible header's integer PCM: 00000001-0000-0010-8000-00aa00389b71.
PCM_SUBFORMAT = bytes.fromhex("0100000000001000800000aa00389b71")
UNKNOWN_SIZE = 0xFFFFFFFF  # a streaming writer's data size: the samples run to the end of the file
MAX_FMT_BYTES = 1024  # a format chunk is 16, 18 or 40 bytes; more is not a WAV header


class WavError(ValueError):
    """A file that is not a usable PCM WAV; the message is the reason."""


@dataclass(frozen=True)
class WavHeader:
    channels: int
    width: int           # bytes per sample: 1 (unsigned), 2, 3 or 4 (signed), little-endian
    rate: int            # samples per second
    frames: int          # samples per channel, as the header says
    data_offset: int     # where the samples start in the file
    file_size: int

    @property
    def data_bytes(self) -> int:
        return self.frames * self.channels * self.width

    @property
    def complete(self) -> bool:
        """Whether the file holds every sample the header says (a cut file does not)."""
        return self.data_offset + self.data_bytes <= self.file_size


def read_header(f: BinaryIO) -> WavHeader:
    """The header of the WAV file `f` (at its start); reads the chunks before the samples only. The
    samples may be fewer than the header says (`WavHeader.complete`)."""
    file_size = os.fstat(f.fileno()).st_size
    riff = f.read(12)
    if len(riff) < 12:
        raise WavError("ends inside its header")
    if riff[:4] != b"RIFF" or riff[8:12] != b"WAVE":
        raise WavError("not a RIFF WAVE file")
    fmt, pos = None, 12
    while True:
        chunk = f.read(8)
        if len(chunk) < 8:
            raise WavError("ends inside its header" if fmt is None else "no data chunk")
        cid, size = chunk[:4], struct.unpack("<I", chunk[4:])[0]
        pos += 8
        if cid == b"fmt ":
            if not 16 <= size <= MAX_FMT_BYTES:
                raise WavError(f"a format chunk of {size} bytes")
            body = f.read(size + (size & 1))[:size]  # with its pad byte, if its size is odd
            if len(body) < size:
                raise WavError("ends inside its header")
            fmt = _format(body)
        elif cid == b"data":
            if fmt is None:
                raise WavError("the samples come before the format chunk")
            channels, width, rate = fmt
            if size == UNKNOWN_SIZE:
                size = max(0, file_size - pos)
            return WavHeader(channels, width, rate, size // (channels * width), pos, file_size)
        else:  # another chunk (LIST, fact, ...): skipped, with its pad byte
            f.seek(size + (size & 1), 1)
        pos += size + (size & 1)
        if pos > file_size:
            raise WavError("ends inside its header")


def _format(body: bytes):
    """(channels, bytes per sample, rate) of a format chunk; WavError unless it is integer PCM."""
    tag, channels, rate, _, block_align, bits = struct.unpack("<HHIIHH", body[:16])
    if tag == EXTENSIBLE:
        if len(body) < 40 or body[24:40] != PCM_SUBFORMAT:
            raise WavError("an extensible format that is not integer PCM")
    elif tag != PCM:
        raise WavError(f"unknown format: {tag}")
    if channels < 1 or rate < 1:
        raise WavError(f"{channels} channel(s) at {rate} Hz")
    width = (bits + 7) // 8
    if width not in (1, 2, 3, 4):
        raise WavError(f"{bits}-bit samples (8 to 32-bit PCM expected)")
    if block_align != channels * width:
        raise WavError(f"frames of {block_align} bytes for {channels} channel(s) of {bits}-bit samples")
    return channels, width, rate
