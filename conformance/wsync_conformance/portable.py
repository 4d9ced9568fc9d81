"""What a pickled scheme holds: it must be configuration, not models, threads, sockets or buffers."""

from __future__ import annotations

import io
import mmap
import multiprocessing.connection
import pickle
import socket
import threading
from typing import Any

import torch
from wsync_core.weights import is_tensordict

__all__ = ["inspect_pickle", "MAX_PICKLE_BYTES"]

#: a pickled scheme is configuration: a few KiB at most, whatever the model's size
MAX_PICKLE_BYTES = 64 * 1024

_FORBIDDEN: tuple[type, ...] = (
    torch.Tensor, torch.UntypedStorage, torch.TypedStorage, torch.nn.Module,
    threading.Thread, socket.socket, mmap.mmap, io.IOBase, multiprocessing.connection.Connection,
    type(threading.Lock()), type(threading.RLock()), threading.Event, threading.Condition,
)


class _Inspector(pickle.Pickler):
    def __init__(self, file) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.found: list[str] = []

    def reducer_override(self, obj: Any):
        if isinstance(obj, _FORBIDDEN) or is_tensordict(obj) or type(obj).__module__.split(".")[0] in ("zmq", "_socket"):
            self.found.append(f"{type(obj).__module__}.{type(obj).__qualname__}")
        return NotImplemented


def inspect_pickle(obj: Any) -> dict[str, Any]:
    """Pickle ``obj``; return its size and the forbidden objects it holds (or the pickling error)."""
    buf = io.BytesIO()
    inspector = _Inspector(buf)
    try:
        inspector.dump(obj)
    except Exception as exc:  # reported: an unpicklable scheme breaks the "portable" guarantee
        return {"size": None, "forbidden": inspector.found, "pickle_error": f"{type(exc).__name__}: {exc}"}
    return {"size": len(buf.getvalue()), "forbidden": inspector.found, "pickle_error": None}
