"""Python client of kvplane nodes and clusters.

Made for inference engines that keep their KV cache in one large tensor and
move blocks of it by batch::

    import kvplane

    with kvplane.Client("127.0.0.1:9600") as kv:
        view = memoryview(kv_tensor_as_uint8_numpy)          # or a bytearray
        blocks = [view[i * BLOCK:(i + 1) * BLOCK] for i in range(n)]
        kv.put_from(keys, blocks)                            # sends from the tensor's memory
        matched, lease_ms = kv.match_prefix(keys, lease_ms=5000)
        lengths = kv.get_into(keys[:matched], blocks[:matched])  # bytes written, or None

A buffer is anything with the buffer protocol: ``bytearray``, ``memoryview``,
numpy arrays; a torch CPU tensor through ``t.view(torch.uint8).numpy()`` (or
``memoryview`` of that). Calls release the GIL while they wait for the
network. ``Client(seeds, cluster=True)`` routes keys over a cluster's slot
table. ``kvplane.aio.Client`` offers the same calls as asyncio coroutines.

On a GPU machine, ``DeviceClient("unix:///path/node.sock", device=0)`` moves
blocks between device memory (``tensor.data_ptr()``) and a node on the same
host through pinned shared memory (``put_from_device``, ``get_into_device``);
the package must be built with its ``cuda`` feature for that
(``gpu_unavailable_reason()`` says why it cannot work, or ``None``).

Errors are ``kvplane.Error`` subclasses (see ``kvplane._errors``).
"""

from __future__ import annotations

from . import _errors
from ._errors import *  # noqa: F403 -- the exceptions, as listed in _errors.__all__
from ._native import Client, DeviceClient, __version__, gpu_unavailable_reason

Key = str | bytes
"""A key: ``str`` (sent as its UTF-8 bytes) or ``bytes``."""

__all__ = ["Client", "DeviceClient", "Key", "gpu_unavailable_reason", "__version__"]
__all__ += _errors.__all__

# Last: kvplane.aio uses the names above.
from . import aio  # noqa: E402
