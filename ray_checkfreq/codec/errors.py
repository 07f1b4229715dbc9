"""Errors raised by the codec; every one keeps its constructor arguments in ``args``."""

from __future__ import annotations

from ray_checkfreq.errors import CheckFreqError


class CodecError(CheckFreqError):
    """The codec cannot encode a value, or refuses to decode a blob."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


class CorruptBlobError(CodecError):
    """A blob is truncated, bit-flipped or not a codec blob at all."""


class BaseMismatchError(CodecError):
    """A delta blob was decoded against a base other than the one it was encoded with."""
