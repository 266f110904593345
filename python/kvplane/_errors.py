"""The exceptions of kvplane.

Every error the client raises is a ``kvplane.Error``. Its subclass says what
went wrong (one per error kind of the wire protocol, plus the buffer errors
found before any I/O), and each also subclasses the builtin a caller would
catch without knowing kvplane (``Unavailable`` is a ``ConnectionError``,
``Timeout`` a ``TimeoutError``, a bad buffer a ``ValueError``), so existing
``except`` clauses keep working.

``key`` (``bytes``) and ``index`` (the position in the batch) name the key or
buffer at fault when there is one; both are ``None`` for a whole-call error
such as a node that cannot be reached.
"""

from __future__ import annotations


class Error(Exception):
    """Any error of the kvplane client."""

    key: bytes | None
    index: int | None

    def __init__(self, message: str, *, key: bytes | None = None, index: int | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.index = index


class NotFound(Error, KeyError):
    """The key does not exist (``get_into`` answers ``None`` instead)."""

    def __str__(self) -> str:
        # KeyError would quote the message.
        return str(self.args[0]) if self.args else ""


class Timeout(Error, TimeoutError):
    """A node did not answer in time (the client's ``timeout``)."""


class Unavailable(Error, ConnectionError):
    """A node could not be reached, or the connection broke."""


class Invalid(Error, ValueError):
    """The request was malformed or refused (a key too long, a wrong token, lists of different lengths)."""


class Capacity(Error):
    """A size or memory limit was hit (a block larger than the node's largest, a full pool)."""


class Internal(Error):
    """A bug or an unexpected answer."""


class Unsupported(Error):
    """The node cannot do this at all."""


class Busy(Error):
    """The node is overloaded; try again after ``retry_after_ms`` (0: unknown)."""

    retry_after_ms: int = 0


class Denied(Error):
    """Not permitted."""


class Corrupt(Error):
    """What the node's second tier answered for the key failed its check (its
    length, checksum or the key it was stored under); nothing was served."""


class BadBuffer(Error, ValueError):
    """A buffer cannot be used for this call; raised before any I/O, or, for
    ``BufferTooSmall``, after the read, with that buffer left unwritten."""


class ReadOnlyBuffer(BadBuffer):
    """``get_into`` was given a read-only buffer (``bytes``, a read-only memoryview or array)."""


class NonContiguousBuffer(BadBuffer):
    """The buffer is not one C-contiguous run of memory (a strided slice, a transposed array)."""


class OverlappingBuffers(BadBuffer):
    """Two of ``get_into``'s buffers share memory (two views of one array, say)."""


class BufferTooSmall(BadBuffer):
    """A value is larger than the buffer given for it; that buffer was not written."""


class GpuError(Error, RuntimeError):
    """A CUDA driver call of a ``DeviceClient`` failed (the call and the driver's reason are in the message)."""


class GpuUnavailable(GpuError):
    """No GPU path here: the package was built without its ``cuda`` feature,
    or no NVIDIA driver or GPU answers (the reason is in the message)."""


__all__ = [
    "Error",
    "NotFound",
    "Timeout",
    "Unavailable",
    "Invalid",
    "Capacity",
    "Internal",
    "Unsupported",
    "Busy",
    "Denied",
    "Corrupt",
    "BadBuffer",
    "ReadOnlyBuffer",
    "NonContiguousBuffer",
    "OverlappingBuffers",
    "BufferTooSmall",
    "GpuError",
    "GpuUnavailable",
]
