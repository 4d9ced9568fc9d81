"""Small C kernels, compiled on first use where a C compiler is found, with torch ops as the
fallback everywhere else: for deltas, the sender's comparison (``diff_words``), its gather of the
changed values (``gather``), and a receiver's check of the indices (``ascending``) and its
write of the values (``scatter``); for small models, the copy of every tensor into or out of a
packed payload in one call (``copy_regions``: ``_foreach_copy_`` costs about 2 us a tensor,
which is most of a small update's copy).

Comparing the model with the sender's mirror and picking out the changed elements takes torch
about six passes (compare, ``nonzero``, two gathers, a scatter, the elements inside the changed
words); ``diff_words`` does it in one: it reads both copies once, copies each differing 8-byte
word into the mirror and writes the indices and new values of the elements that differ inside
it. Its result is the same as the torch path's, bit for bit (``tests/test_native.py`` holds
them to it).

The source below is compiled with the system's C compiler (``$CC``, else ``cc``) into
``$XDG_CACHE_HOME/wsync`` (else ``~/.cache/wsync``), once per source and machine, and loaded with
``ctypes``, whose calls release the GIL, so the comparison runs in as many parts at once as
torch has threads. Set
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
from array import array
from pathlib import Path

import torch

__all__ = ["kernel", "available", "usable", "diff_words", "gather", "ascending", "scatter", "copy_regions"]

log = logging.getLogger("wsync.native")

_SOURCE = r"""
#include <stdint.h>

#include <string.h>

/* The comparison for elements of S bytes (a constant, so that each memcpy is one move). */
#define WSYNC_DIFF(S) \
static int64_t diff_##S(const uint64_t *src, uint64_t *mir, int64_t n, int64_t *out, int64_t cap, \
                        int64_t *done, char *vals) { \
    const int64_t ratio = 8 / (S), bits = (S) * 8; \
    const uint64_t lane = (S) == 8 ? ~(uint64_t)0 : (((uint64_t)1 << ((S) * 8 % 64)) - 1); \
    int64_t k = 0, i = 0; \
    while (i < n) { \
        if (i + 8 <= n) { /* eight words at a time: most are equal */ \
            uint64_t any = 0; \
            for (int j = 0; j < 8; j++) any |= src[i + j] ^ mir[i + j]; \
            if (!any) { i += 8; continue; } \
        } \
        if (i + 8 <= n && k + 8 * ratio <= cap) { /* no branches: every lane written, kept if it differs */ \
            for (int w = 0; w < 8; w++, i++) { \
                uint64_t v = src[i], x = v ^ mir[i]; \
                mir[i] = v; \
                for (int64_t j = 0; j < ratio; j++) { \
                    uint64_t lv = v >> (j * bits % 64); \
                    out[k] = i * ratio + j; \
                    memcpy(vals + k * (S), &lv, (S)); \
                    k += ((x >> (j * bits % 64)) & lane) != 0; \
                } \
            } \
            continue; \
        } \
        uint64_t v = src[i], x = v ^ mir[i]; \
        if (x) { \
            if (k + ratio > cap) break; \
            for (int64_t j = 0; j < ratio; j++) \
                if ((x >> (j * bits % 64)) & lane) { \
                    uint64_t lv = v >> (j * bits % 64); \
                    memcpy(vals + k * (S), &lv, (S)); \
                    out[k++] = i * ratio + j; \
                } \
            mir[i] = v; \
        } \
        i++; \
    } \
    *done = i; \
    return k; \
}
WSYNC_DIFF(1)
WSYNC_DIFF(2)
WSYNC_DIFF(4)
WSYNC_DIFF(8)

/* Compare n 8-byte words of src with mir. Each differing word is copied into mir, and the
   indices (counted from word 0, in elements of `size` bytes, little-endian lanes) of its
   differing elements are written to out, ascending, and their new bits to vals (`size` bytes
   each, as many as out). Stops before out could overflow: returns the elements written and
   sets *done to the words consumed. */
int64_t wsync_diff_words(const uint64_t *src, uint64_t *mir, int64_t n, int64_t size,
                         int64_t *out, int64_t cap, int64_t *done, char *vals) {
    switch (size) {
    case 1: return diff_1(src, mir, n, out, cap, done, vals);
    case 2: return diff_2(src, mir, n, out, cap, done, vals);
    case 4: return diff_4(src, mir, n, out, cap, done, vals);
    case 8: return diff_8(src, mir, n, out, cap, done, vals);
    default: *done = n; return 0;
    }
}

/* The loads and stores of the three below go through memcpy: a payload received from another
   process need not be aligned for its element type (compilers make these plain moves). */

/* one loop per element size, so that each memcpy has a constant size and becomes one move */
#define WSYNC_EACH_SIZE(LOOP) switch (size) { case 1: LOOP(1); break; case 2: LOOP(2); break; \
    case 4: LOOP(4); break; case 8: LOOP(8); break; default: break; }

/* out[i] = src[idx[i]], n elements of `size` bytes (1, 2, 4 or 8). */
void wsync_gather(const char *src, const char *idx, int64_t n, int64_t size, char *out) {
#define GATHER(S) for (int64_t i = 0; i < n; i++) { int32_t j; memcpy(&j, idx + 4 * i, 4); \
        memcpy(out + (S) * i, src + (S) * (int64_t)j, (S)); }
    WSYNC_EACH_SIZE(GATHER)
}

/* 1 if the n int32 at idx are strictly ascending and inside [0, limit), else 0. */
int64_t wsync_ascending(const char *idx, int64_t n, int64_t limit) {
    int64_t last = -1;
    for (int64_t i = 0; i < n; i++) {
        int32_t j;
        memcpy(&j, idx + 4 * i, 4);
        if ((int64_t)j <= last || (int64_t)j >= limit) return 0;
        last = j;
    }
    return 1;
}

/* dst[idx[i]] = vals[i], n elements of `size` bytes; the indices checked by wsync_ascending. */
void wsync_scatter(char *dst, const char *idx, int64_t n, int64_t size, const char *vals) {
#define SCATTER(S) for (int64_t i = 0; i < n; i++) { int32_t j; memcpy(&j, idx + 4 * i, 4); \
        memcpy(dst + (S) * (int64_t)j, vals + (S) * i, (S)); }
    WSYNC_EACH_SIZE(SCATTER)
}

/* For each of n regions: copy len[i] bytes between ptr[i] and buf + off[i] (into the buffer if
   to_buf, else out of it). memmove: a region may overlap the buffer. */
void wsync_copy_regions(char *buf, const int64_t *ptr, const int64_t *off, const int64_t *len, int64_t n,
                        int64_t to_buf) {
    for (int64_t i = 0; i < n; i++) {
        if (to_buf) memmove(buf + off[i], (const char *)(intptr_t)ptr[i], (size_t)len[i]);
        else memmove((char *)(intptr_t)ptr[i], buf + off[i], (size_t)len[i]);
    }
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
        log.info("no C compiler found: wsync uses torch ops where its native kernels would run")
        return None
    tag = hashlib.sha256(f"{_SOURCE}\0{cc}\0{os.uname().machine}".encode()).hexdigest()[:16]
    target = _cache_dir() / f"kernels-{tag}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                src = Path(tmp) / "kernels.c"
                src.write_text(_SOURCE)
                built = Path(tmp) / "kernels.so"
                subprocess.run([cc, "-O3", "-shared", "-fPIC", "-o", str(built), str(src)], check=True,
                               capture_output=True, timeout=120)
                os.replace(built, target)  # atomic: a concurrent build leaves one whole file
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            log.info("building the native kernels failed (%s %s): wsync uses torch ops instead",
                     exc, detail.decode(errors="replace")[-500:])
            return None
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        log.info("loading the native kernels %s failed (%s): wsync uses torch ops instead", target, exc)
        return None
    fn = lib.wsync_diff_words
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.POINTER(ctypes.c_int64), ctypes.c_void_p]
    for name in ("wsync_gather", "wsync_scatter"):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.wsync_copy_regions.restype = None
    lib.wsync_copy_regions.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                       ctypes.c_int64, ctypes.c_int64]
    lib.wsync_ascending.restype = ctypes.c_int64
    lib.wsync_ascending.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
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


def diff_words(mirror: torch.Tensor, source: torch.Tensor, out: torch.Tensor, values: torch.Tensor,
               base: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Update ``mirror`` (flat, CPU, contiguous, elements of 1, 2, 4 or 8 bytes, 8-byte aligned,
    a whole number of 8-byte words) to ``source``'s bits (same dtype and shape); in pieces, the
    indices plus ``base`` (int64, ascending) of the elements that differed and their new values
    (``mirror``'s dtype), each a fresh tensor. ``out`` (int64, at least 8 elements) and
    ``values`` (``mirror``'s dtype, as long as ``out``) are scratch space. Raises RuntimeError
    where the kernel is not available (check ``available()`` first)."""
    lib = _need()
    size = mirror.element_size()
    _on_cpu("diff_words", mirror, source, out, values)
    if values.dtype != mirror.dtype or values.numel() < out.numel() or out.numel() < 8:
        raise ValueError("diff_words: values must have mirror's dtype and out's length, out at least 8")
    m = mirror.view(torch.int64)
    s = source.view(torch.int64)
    n = m.numel()
    done = ctypes.c_int64(0)
    pieces: list[tuple[torch.Tensor, torch.Tensor]] = []
    at = 0
    step = 8 // size
    while at < n:
        k = lib.wsync_diff_words(s.data_ptr() + at * 8, m.data_ptr() + at * 8, n - at, size, out.data_ptr(),
                                 out.numel(), ctypes.byref(done), values.data_ptr())
        if k:
            piece = out[:k].clone()
            if at * step + base:
                piece.add_(at * step + base)
            pieces.append((piece, values[:k].clone()))
        at += done.value
    return pieces


def _on_cpu(kernel: str, *tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor is in CPU memory: a kernel reads and writes by address,
    and a GPU's address read here is a crash, not an error."""
    if any(t.device.type != "cpu" for t in tensors):
        where = ", ".join(str(t.device) for t in tensors)
        raise ValueError(f"{kernel}: the native kernels work on CPU tensors only, got tensors on {where}")


def _plain(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.is_contiguous() and t.element_size() in (1, 2, 4, 8)


def usable(*tensors: torch.Tensor) -> bool:
    """Whether the kernels can work on ``tensors`` (CPU, contiguous, elements of 1-8 bytes) here."""
    return all(_plain(t) for t in tensors) and available()


def gather(source: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = source.view(-1)[index[i]]`` for int32 ``index`` (in range: the caller's own);
    ``out`` has ``source``'s dtype and ``index``'s length. Raises RuntimeError where the kernel
    is not available."""
    lib = _need()
    _on_cpu("gather", source, index, out)
    n = index.numel()
    if out.numel() != n or out.dtype != source.dtype or index.dtype != torch.int32:
        raise ValueError("gather: out must have source's dtype and index's length, index int32")
    lib.wsync_gather(source.data_ptr(), index.data_ptr(), n, source.element_size(), out.data_ptr())


def ascending(index: torch.Tensor, limit: int) -> bool:
    """Whether int32 ``index`` is strictly ascending and inside ``[0, limit)``."""
    _on_cpu("ascending", index)
    if index.dtype != torch.int32 or not index.is_contiguous():
        raise ValueError("ascending: index must be contiguous int32")
    return bool(_need().wsync_ascending(index.data_ptr(), index.numel(), limit))


def scatter(target: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``target.view(-1)[index[i]] = values[i]`` for int32 ``index`` that ``ascending`` accepted
    for ``target``'s size; ``values`` in ``target``'s dtype."""
    _on_cpu("scatter", target, index, values)
    n = index.numel()
    if values.numel() != n or values.dtype != target.dtype or index.dtype != torch.int32:
        raise ValueError("scatter: values must have target's dtype and index's length, index int32")
    _need().wsync_scatter(target.data_ptr(), index.data_ptr(), n, target.element_size(), values.data_ptr())


def copy_regions(buffer: int, ptrs: array, offsets: array, lengths: array, to_buffer: bool) -> None:
    """Copy ``lengths[i]`` bytes between address ``ptrs[i]`` and ``buffer + offsets[i]`` for each i
    (into the buffer if ``to_buffer``). The caller vouches for every address: CPU memory it holds,
    each region inside its tensor and the buffer. Raises RuntimeError where the kernel is not
    available."""
    _need().wsync_copy_regions(buffer, ptrs.buffer_info()[0], offsets.buffer_info()[0], lengths.buffer_info()[0],
                               len(ptrs), int(to_buffer))


def _need() -> ctypes.CDLL:
    lib = kernel()
    if lib is None:
        raise RuntimeError("the native kernels are not available")
    return lib
