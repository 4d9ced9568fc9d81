"""The layout of a flat weight buffer: which key lives at which offset, with which dtype and shape.

Sender and receiver each compute the layout of their own weights; equal digests mean the
payload of one fits the model of the other byte for byte. Keys are sorted, so the order in
which a module, a TensorDict or a state_dict lists its tensors does not matter.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from . import native
from .errors import SchemaMismatchError
from .lease import exclusive

__all__ = ["Entry", "Layout", "ALIGN", "DTYPES", "clip_keys"]

#: Every tensor starts at a multiple of this many bytes (enough for any dtype and for SIMD copies).
ALIGN = 64
#: how many buffers' views a layout remembers
_VIEW_CACHE = 4
#: a payload up to this size is copied into or out of the model's tensors by one native call where
#: it can be (``native.copy_regions``); torch copies larger ones, on its threads
NATIVE_COPY_BYTES = 1 << 20

#: The dtypes a payload may carry, by their wire name.
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
for _name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"):  # newer torch builds
    if hasattr(torch, _name):
        DTYPES[_name] = getattr(torch, _name)
_NAMES = {v: k for k, v in DTYPES.items()}


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Entry:
    """One tensor of the payload: ``nbytes`` bytes at ``offset``."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


#: the differences of shape or dtype a mismatch names one by one (the rest are counted)
_SHOWN_DIFFERENCES = 10


class Layout:
    """An immutable, sorted table of entries; ``nbytes`` is the size of the flat buffer."""

    __slots__ = ("entries", "nbytes", "digest", "alignment", "_by_key", "_filled", "_views", "_regions")

    def __init__(self, entries: list[Entry]) -> None:
        self.entries: tuple[Entry, ...] = tuple(entries)
        self._filled = tuple(e for e in self.entries if e.nbytes)
        #: (offsets, lengths) of the filled entries for ``native.copy_regions``, if this layout is
        #: small and has no complex dtype (whose conjugate views a raw copy would not honour)
        self._regions: tuple[array, array] | None = None
        #: views of recently used buffers, by (address, device): slots and staging buffers repeat
        self._views: OrderedDict[tuple[int, torch.device], list[torch.Tensor]] = OrderedDict()
        self.nbytes: int = _align(max((e.offset + e.nbytes for e in entries), default=0))
        #: what a buffer's address must be a multiple of for its entries to be read as their dtypes
        #: (an element's size: complex128 needs 16, which torch's copies assume)
        self.alignment: int = max((e.torch_dtype.itemsize for e in self._filled), default=1)
        self._by_key = {e.key: e for e in entries}
        self.digest: str = hashlib.sha256(self.to_json().encode()).hexdigest()[:32]
        if self.nbytes <= NATIVE_COPY_BYTES and not any(e.torch_dtype.is_complex for e in self._filled):
            self._regions = (array("q", [e.offset for e in self._filled]), array("q", [e.nbytes for e in self._filled]))

    # -- building -------------------------------------------------------------------------
    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> Layout:
        """The layout of ``tensors`` (key -> tensor). Raises TypeError for an unsupported dtype, a
        sparse or nested tensor."""
        entries: list[Entry] = []
        offset = 0
        for key in sorted(tensors):
            t = tensors[key]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"weight {key!r} is a {type(t).__name__}, expected a torch.Tensor")
            if t.is_nested or t.layout is not torch.strided:
                kind = "a nested tensor" if t.is_nested else f"a {t.layout} tensor"
                raise TypeError(f"weight {key!r} is {kind}, which wsync cannot carry: it carries dense "
                                f"(strided) tensors; convert it (e.g. .to_dense()) or keep it out of the weights")
            name = _NAMES.get(t.dtype)
            if name is None:
                raise TypeError(
                    f"weight {key!r} has dtype {t.dtype}, which wsync cannot carry; "
                    f"supported: {', '.join(DTYPES)}"
                )
            nbytes = t.numel() * t.element_size()
            entries.append(Entry(key, name, tuple(t.shape), offset, nbytes))
            offset = _align(offset + nbytes)
        return cls(entries)

    # -- wire form --------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(
            [[e.key, e.dtype, list(e.shape), e.offset, e.nbytes] for e in self.entries],
            separators=(",", ":"),
        )

    @classmethod
    def from_wire(cls, raw: Any) -> Layout:
        """Rebuild a layout from its decoded JSON form; raises ValueError if it is malformed."""
        if not isinstance(raw, list):
            raise ValueError("layout must be a list of entries")
        entries = []
        end = 0
        for item in raw:
            if not (isinstance(item, list) and len(item) == 5):
                raise ValueError(f"malformed layout entry {item!r:.80}")
            key, dtype, shape, offset, nbytes = item
            if not isinstance(key, str) or dtype not in DTYPES:
                raise ValueError(f"malformed layout entry {item!r:.80}")
            if not (isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape)):
                raise ValueError(f"malformed shape in layout entry {key!r}")
            numel = 1
            for s in shape:
                numel *= s
            if not (isinstance(offset, int) and isinstance(nbytes, int)):
                raise ValueError(f"malformed offset in layout entry {key!r}")
            if nbytes != numel * DTYPES[dtype].itemsize or offset < end or offset % ALIGN:
                raise ValueError(f"inconsistent layout entry {key!r}")
            end = offset + nbytes
            entries.append(Entry(key, dtype, tuple(shape), offset, nbytes))
        return cls(entries)

    # -- comparing --------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and other.digest == self.digest

    def __hash__(self) -> int:
        return hash(self.digest)

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"Layout({len(self.entries)} tensors, {self.nbytes} bytes, digest={self.digest[:12]})"

    def differences(self, other: Layout, *, mine: str = "sender", theirs: str = "receiver") -> list[str]:
        """Human-readable differences between this layout and ``other`` (empty if they match)."""
        out: list[str] = []
        only_mine = sorted(set(self._by_key) - set(other._by_key))
        only_theirs = sorted(set(other._by_key) - set(self._by_key))
        if only_mine:
            out.append(f"keys only on the {mine}: {clip_keys(only_mine)}")
        if only_theirs:
            out.append(f"keys only on the {theirs}: {clip_keys(only_theirs)}")
        differ: list[str] = []
        for key in sorted(set(self._by_key) & set(other._by_key)):
            a, b = self._by_key[key], other._by_key[key]
            if a.shape != b.shape:
                differ.append(f"{key!r}: shape {list(a.shape)} on the {mine}, {list(b.shape)} on the {theirs}")
            if a.dtype != b.dtype:
                differ.append(f"{key!r}: dtype {a.dtype} on the {mine}, {b.dtype} on the {theirs}")
        if len(differ) > _SHOWN_DIFFERENCES:  # (a whole model in another dtype: the first few say it)
            differ[_SHOWN_DIFFERENCES:] = [f"and {len(differ) - _SHOWN_DIFFERENCES} more differences of shape or dtype"]
        return out + differ

    def entry(self, key: str) -> Entry:
        """The entry of ``key``; KeyError if this layout has none."""
        return self._by_key[key]

    def fits(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """True if ``tensors`` have exactly this layout's keys, dtypes and shapes (cheap: no hashing)."""
        if len(tensors) != len(self.entries):
            return False
        for e in self.entries:
            t = tensors.get(e.key)
            if t is None or t.dtype is not e.torch_dtype or tuple(t.shape) != e.shape:
                return False
        return True

    def ready(self, targets: Mapping[str, torch.Tensor], *, write: bool = True) -> bool:
        """True if ``targets`` fit this layout (as ``fits``), are all on the CPU, and a payload can be
        written into each in place as raw bytes (no check of ``check_writable`` would fail, no
        negative view), or with ``write=False`` read from each as raw bytes: the common case, in
        one pass of cheap checks. False says nothing: ``check_fits`` and ``check_writable`` decide."""
        if len(targets) != len(self.entries):
            return False
        for e in self.entries:
            t = targets.get(e.key)
            # contiguous: no element shares memory with another (what _debug_has_internal_overlap finds)
            if (t is None or t.dtype is not e.torch_dtype or t.shape != e.shape or not t.is_cpu
                    or write and t.is_inference() or not t.is_contiguous() or t.is_neg()):
                return False
        return True

    def check_fits(self, tensors: Mapping[str, torch.Tensor], *, mine: str, theirs: str, context: str) -> None:
        """Raise SchemaMismatchError naming every difference unless ``tensors`` fit this layout."""
        if not self.fits(tensors):
            self.check_matches(Layout.of(tensors), mine=mine, theirs=theirs, context=context)

    def check_matches(self, other: Layout, *, mine: str = "sender", theirs: str = "receiver", context: str = "") -> None:
        """Raise SchemaMismatchError naming every difference unless ``other`` equals this layout."""
        if other.digest == self.digest:
            return
        diffs = self.differences(other, mine=mine, theirs=theirs) or ["tensor layout differs"]
        prefix = f"{context}: " if context else ""
        raise SchemaMismatchError(prefix + "weights do not match; " + "; ".join(diffs))

    # -- moving bytes ------------------------------------------------------------------------
    def pack(self, tensors: Mapping[str, torch.Tensor], buffer: torch.Tensor, *, ready: bool | None = None) -> None:
        """Copy ``tensors`` into the flat uint8 ``buffer`` (any device). The sources are only read.
        ``ready``: what ``self.ready(tensors, write=False)`` said just now (asked here if None).

        A small payload is one native call (``_copy_native``); a larger one one fused ``copy_`` over
        every tensor, on torch's own threads: right after a training step
        those threads are the ones still spinning, so a copy on threads of its own would compete with
        them for the cores (see docs/benchmarks.md)."""
        if not self._copy_native(buffer, tensors, to_buffer=True, ready=ready):
            _copy_all(self._views_of(buffer), [tensors[e.key] for e in self._filled])

    def pack_stream(self, tensors: Mapping[str, torch.Tensor], buffer: torch.Tensor, step: int,
                    ready: Callable[[int], None]) -> None:
        """Like ``pack``, in offset order, calling ``ready(n)`` each time about ``step`` more bytes
        are final: bytes ``[0, n)`` of ``buffer`` then hold their last value. The last call has
        ``n == nbytes``. A contiguous tensor larger than ``step`` is copied in pieces."""
        done = reported = 0
        with torch.no_grad():
            for e, dst in zip(self._filled, self._views_of(buffer)):
                src = tensors[e.key]
                if e.nbytes > step and src.is_contiguous() and src.device == buffer.device:
                    flat_dst = dst.reshape(-1).view(torch.uint8)
                    flat_src = src.reshape(-1).view(torch.uint8)
                    for a in range(0, e.nbytes, step):
                        flat_dst[a:a + step].copy_(flat_src[a:a + step])
                        done = e.offset + min(a + step, e.nbytes)
                        if done - reported >= step:
                            reported = _report(buffer, done, ready)
                else:
                    dst.copy_(src)
                    done = e.offset + e.nbytes
                    if done - reported >= step:
                        reported = _report(buffer, done, ready)
        if reported < self.nbytes or not self.nbytes:
            _report(buffer, self.nbytes, ready)

    def unpack(self, buffer: torch.Tensor, targets: Mapping[str, torch.Tensor], *, ready: bool | None = None) -> None:
        """Copy the flat ``buffer`` into ``targets`` in place (any device). ``ready``: what
        ``self.ready(targets)`` said just now (asked here if None)."""
        if not self._copy_native(buffer, targets, to_buffer=False, ready=ready):
            _copy_all([targets[e.key] for e in self._filled], self._views_of(buffer))

    def _copy_native(self, buffer: torch.Tensor, tensors: Mapping[str, torch.Tensor], to_buffer: bool,
                     ready: bool | None) -> bool:
        """Copy between ``buffer`` and ``tensors`` by one native call if that is exact here: a small
        layout without complex dtypes, the kernels built, a CPU uint8 buffer, and ``tensors`` that
        ``self.ready`` accepts (``ready``: its answer, if the caller has it). Bumps the
        destinations' version counters, as an in-place torch copy does. False (nothing copied)
        otherwise."""
        regions = self._regions
        if (regions is None or _BUMP_VERSIONS is None or buffer.dtype != torch.uint8 or not buffer.is_cpu
                or not buffer.is_contiguous() or buffer.numel() < self.nbytes or to_buffer and buffer.is_inference()
                or not native.available()):
            return False
        if not (self.ready(tensors, write=not to_buffer) if ready is None else ready):
            return False
        listed = [tensors[e.key] for e in self._filled]
        native.copy_regions(buffer.data_ptr(), array("q", [t.data_ptr() for t in listed]), regions[0], regions[1],
                            to_buffer)
        _BUMP_VERSIONS([buffer] if to_buffer else listed)
        return True

    def adopt(self, buffer: torch.Tensor, targets: Mapping[str, torch.Tensor],
              retired: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Make each target a view of the flat ``buffer`` instead of copying into it, where it can.

        A target keeps its Python object (a Parameter stays the module's Parameter); its storage
        becomes the buffer's, and its version counter moves on as an in-place copy's would. A
        target is copied into instead, as by ``unpack``, when re-pointing it would leave another
        holder of its memory behind (a view, a state_dict entry or alias, a tensor the worker kept:
        they must keep seeing the model's values), would change its strides (channels_last, a
        transpose) or when it cannot be re-pointed (another device, shared or pinned memory, a
        subclass, a non-leaf). All or
        nothing: if a copy fails, every re-pointed target gets its old memory back. Returns the
        adopted targets; the memory they had is appended to ``retired`` if given, so that the
        caller chooses when it is freed (freeing a mapping costs time).
        """
        tensors = [targets[e.key] for e in self._filled]
        alone = exclusive(tensors)
        adopted: list[torch.Tensor] = []
        undo: list[tuple[torch.Tensor, torch.Tensor]] = []
        dsts, srcs = [], []
        with torch.no_grad():
            try:
                for e, t, mine in zip(self._filled, tensors, alone):
                    view = self.view(buffer, e)
                    # (a target whose strides differ, channels_last or a transpose, keeps them: copied into)
                    if mine and _adoptable(t, buffer) and t.stride() == view.stride():
                        old = t.data
                        try:
                            t.data = view
                        except RuntimeError:  # a tensor torch will not re-point: copy into it like the rest
                            pass
                        else:
                            undo.append((t, old))
                            adopted.append(t)
                            continue
                    dsts.append(t)
                    srcs.append(view)
                _copy_all(dsts, srcs)
            except BaseException:
                for t, old in reversed(undo):
                    t.data = old
                raise
        if adopted and _BUMP_VERSIONS is not None:  # as a copy would: a graph that saved one raises
            _BUMP_VERSIONS(adopted)
        if retired is not None:
            retired.extend(old for _, old in undo)
        return adopted

    def check_writable(self, targets: Mapping[str, torch.Tensor], *, context: str) -> None:
        """Raise SchemaMismatchError naming every target a payload cannot be written into in place
        (its elements share memory, as after ``expand()``; an inference tensor; the meta device), so
        that nothing is written when one of them would fail half-way."""
        bad = []
        for e in self.entries:
            t = targets[e.key]
            if t.is_meta:
                bad.append(f"{e.key!r} is on the meta device (it holds no data)")
            elif t.is_inference() and not torch.is_inference_mode_enabled():
                bad.append(f"{e.key!r} is an inference tensor (made under torch.inference_mode())")
            elif e.nbytes and torch._debug_has_internal_overlap(t) == 1:
                bad.append(f"{e.key!r} has elements that share memory (e.g. made by expand()); give it "
                           f"its own memory with .clone()")
        if bad:
            raise SchemaMismatchError(f"{context}: the model cannot take this version in place: " + "; ".join(bad))

    def _views_of(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        key = (buffer.data_ptr(), buffer.device)
        views = self._views.get(key)
        if views is None or (views and views[0].untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr()):
            views = [self.view(buffer, e) for e in self._filled]
            self._views[key] = views
            while len(self._views) > _VIEW_CACHE:
                self._views.popitem(last=False)
        else:
            self._views.move_to_end(key)
        return views

    def drop_views(self) -> None:
        """Forget cached views, so the buffers they point into can be freed or unmapped."""
        self._views.clear()

    @staticmethod
    def view(buffer: torch.Tensor, entry: Entry) -> torch.Tensor:
        """The tensor ``entry`` as a view of the flat uint8 ``buffer``."""
        return buffer[entry.offset : entry.offset + entry.nbytes].view(entry.torch_dtype).view(entry.shape)

    def tensors(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every entry as a view of ``buffer``, by key."""
        return {e.key: self.view(buffer, e) for e in self.entries}


def _copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """dst.copy_(src) for each pair, in one fused call where every tensor shares a device."""
    if not dsts:
        return
    with torch.no_grad():
        device = dsts[0].device
        if _FOREACH_COPY is not None and (all(t.is_cpu for t in dsts) and all(t.is_cpu for t in srcs)
                                          or all(t.device == device for t in dsts)
                                          and all(t.device == device for t in srcs)):
            _FOREACH_COPY(dsts, srcs)
        else:
            for d, s in zip(dsts, srcs):
                d.copy_(s)


def _report(buffer: torch.Tensor, n: int, ready: Callable[[int], None]) -> int:
    if buffer.is_cuda:
        torch.cuda.current_stream(buffer.device).synchronize()
    ready(n)
    return n


def _adoptable(t: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether ``t`` may trade its storage for a view of ``buffer``: not when its memory is shared
    on purpose (a view of another tensor, shared or pinned memory), nor for subclasses."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device == buffer.device and t._base is None
            and t.is_leaf and not t.is_inference() and t.layout == torch.strided
            and not (t.device.type == "cpu" and (t.is_shared() or t.is_pinned())))


_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)
#: what ``torch.autograd.graph.increment_version`` calls, for a list at once (None in a torch
#: without it: then torch's own copy does every write, which bumps the counters itself)
_BUMP_VERSIONS = getattr(torch._C, "_increment_version", None)


def clip_keys(keys: list[str], n: int = 8) -> str:
    """``keys`` quoted and joined, the first ``n`` of them, saying how many more there are."""
    shown = ", ".join(repr(k) for k in keys[:n])
    return shown + (f" and {len(keys) - n} more" if len(keys) > n else "")
