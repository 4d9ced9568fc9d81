"""One small C kernel for the sender's delta comparison, compiled on first use where a C compiler
is found, with torch ops as the fallback everywhere else.

Comparing the model with the sender's mirror and picking out the changed elements takes torch
about six passes (compare, ``nonzero``, two gathers, a scatter, the elements inside the changed
words); ``diff_words`` does it in one: it reads both copies once, copies each differing 8-byte
word into the mirror and writes the indices of the elements that differ inside it. Its result
is the same as the torch path's, bit for bit (``tests/test_native.py`` holds them to it).

The source below is compiled with the system's C compiler (``$CC``, else ``cc``) into
``$XDG_CACHE_HOME/wsync`` (else ``~/.cache/wsync``), once per source and machine, and loaded with
``ctypes``, whose calls release the GIL, so two threads compare two halves at once. Set
``WSYNC_NATIVE=0`` to never compile or load it. Without a compiler, on a big-endian machine, or if
the build fails, ``kernel()`` is None and the caller uses torch ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["kernel", "diff_words", "available"]

log = logging.getLogger("wsync.native")

_SOURCE = r"""
#include <stdint.h>

/* Compare n 8-byte words of src with mir. Each differing word is copied into mir, and the
   indices (counted from word 0, in elements of `size` bytes, little-endian lanes) of its
   differing elements are written to out, ascending. Stops before out could overflow:
   returns the elements written and sets *done to the words consumed. */
int64_t wsync_diff_words(const uint64_t *src, uint64_t *mir, int64_t n, int64_t size,
                         int64_t *out, int64_t cap, int64_t *done) {
    const int64_t ratio = 8 / size;
    const uint64_t lane = size == 8 ? ~(uint64_t)0 : (((uint64_t)1 << (size * 8)) - 1);
    int64_t k = 0, i = 0;
    while (i < n) {
        if (i + 8 <= n) {  /* eight equal words at a time: the common case */
            uint64_t any = 0;
            for (int j = 0; j < 8; j++) any |= src[i + j] ^ mir[i + j];
            if (!any) { i += 8; continue; }
        }
        uint64_t x = src[i] ^ mir[i];
        if (x) {
            if (k + ratio > cap) break;
            for (int64_t j = 0; j < ratio; j++)
                if ((x >> (j * size * 8)) & lane) out[k++] = i * ratio + j;
            mir[i] = src[i];
        }
        i++;
    }
    *done = i;
    return k;
}
"""

_lock = threading.Lock()
_loaded: list[ctypes.CDLL | None] = []  # [library] once tried: None if it could not be built


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "wsync"


def _build() -> ctypes.CDLL | None:
    """Compile (once per source, compiler and machine) and load the kernel; None if it cannot."""
    if os.environ.get("WSYNC_NATIVE", "1") == "0" or sys.byteorder != "little":
        return None
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        log.info("no C compiler found: the delta comparison uses torch ops")
        return None
    tag = hashlib.sha256(f"{_SOURCE}\0{cc}\0{os.uname().machine}".encode()).hexdigest()[:16]
    target = _cache_dir() / f"diff-{tag}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src = Path(tmp) / "diff.c"
                src.write_text(_SOURCE)
                built = Path(tmp) / "diff.so"
                subprocess.run([cc, "-O3", "-shared", "-fPIC", "-o", str(built), str(src)], check=True,
                               capture_output=True, timeout=120)
                os.replace(built, target)  # atomic: a concurrent build leaves one whole file
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            log.info("building the native delta kernel failed (%s %s): the delta comparison uses torch ops",
                     exc, detail.decode(errors="replace")[-500:])
            return None
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        log.info("loading the native delta kernel %s failed (%s): the delta comparison uses torch ops", target, exc)
        return None
    fn = lib.wsync_diff_words
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
    return lib


def kernel() -> ctypes.CDLL | None:
    """The loaded kernel library, building it on the first call; None where it is not available."""
    if not _loaded:
        with _lock:
            if not _loaded:
                _loaded.append(_build())
    return _loaded[0]


def available() -> bool:
    """Whether ``diff_words`` runs the compiled kernel here."""
    return kernel() is not None


def diff_words(mirror: torch.Tensor, source: torch.Tensor, out: torch.Tensor, base: int = 0) -> list[torch.Tensor]:
    """Update ``mirror`` (flat, CPU, contiguous, elements of 1, 2, 4 or 8 bytes, 8-byte aligned,
    a whole number of 8-byte words) to ``source``'s bits (same dtype and shape); the indices plus
    ``base`` (int64, ascending) of the elements that differed, in pieces, each a fresh tensor.
    ``out`` is int64 scratch space for at least 8 elements. Raises RuntimeError where the kernel
    is not available (check ``available()`` first)."""
    lib = kernel()
    if lib is None:
        raise RuntimeError("the native delta kernel is not available")
    size = mirror.element_size()
    m = mirror.view(torch.int64)
    s = source.view(torch.int64)
    n = m.numel()
    done = ctypes.c_int64(0)
    pieces: list[torch.Tensor] = []
    at = 0
    step = 8 // size
    while at < n:
        k = lib.wsync_diff_words(s.data_ptr() + at * 8, m.data_ptr() + at * 8, n - at, size, out.data_ptr(),
                                 out.numel(), ctypes.byref(done))
        if k:
            piece = out[:k].clone()
            if at * step + base:
                piece.add_(at * step + base)
            pieces.append(piece)
        at += done.value
    return pieces
