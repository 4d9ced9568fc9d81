"""Sending less: payloads that carry only some tensors or elements, and casts on the wire.

Three encodings share one mechanism, described by header fields the core writes (see
``protocol.Header``):

- a **wire dtype** (``w``): floating tensors wider than it travel in that dtype; a receiver casts
  each back to its model's dtype, exactly as ``x.to(wire).to(model_dtype)``. The payload then follows the
  *wire layout* (``wire_layout``), which both sides derive from the model's layout;
- a **table** (``x``): the payload holds only the listed tensors of the wire layout: a whole
  tensor, or the int32 indices (ascending) of some of its elements followed by their values;
- a **base** (``b``): the table carries every element that changed since version ``b``, as
  values, so it is exact for a receiver holding any version from ``b`` up to (not including)
  the new one; a receiver holding an older one (or none) refuses it and the sender sends it a
  full payload instead.

The sender keeps a ``Mirror``: its own copy of the newest version in wire form (one model's
size in the wire dtype), updated by comparing values bit for bit (so -0.0 and NaN payloads
count), for each of the last ``keep`` versions the indices of the elements it changed
(4 bytes per changed element, at most about the model's size each: a tensor changed in more
places than its indices would save is marked changed as a whole) and, where the native
comparison ran (``native``), the newest version's changed values (less than the model's size).
"""

from __future__ import annotations

import os
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from . import native
from .errors import TransportError
from .layout import ALIGN, DTYPES, Entry, Layout

__all__ = ["WIRE_DTYPES", "INDEX_BYTES", "wire_layout", "Mirror", "Op", "decode_table", "apply_ops", "unpack_wire",
           "check_wire_dtype", "Encoded", "Costs"]

#: the dtypes floating tensors may travel in (``wire_dtype=``)
WIRE_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16,
                                       "float32": torch.float32}
_WIRE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}
#: bytes of the mirror compared per step: the two sides stay in the cache while a step's
#: changed words are picked out and copied (bounds the temporary memory of a diff too)
_CHUNK_BYTES = 8 << 20
#: a tensor is sent whole when its indices and values would take at least this share of its bytes
_WHOLE_SHARE = 1.0
#: the size of an index in a partial payload (int32)
INDEX_BYTES = 4
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def check_wire_dtype(dtype: Any) -> str | None:
    """The wire name of ``dtype`` (a torch dtype or its name), None for None; raises ValueError otherwise."""
    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype in WIRE_DTYPES:
        return dtype
    name = _WIRE_NAMES.get(dtype)
    if name is None:
        raise ValueError(f"wire_dtype must be one of {', '.join(f'torch.{n}' for n in WIRE_DTYPES)} or None, "
                         f"got {dtype!r}")
    return name


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _is_float(dtype_name: str) -> bool:
    return DTYPES[dtype_name].is_floating_point


def wire_layout(layout: Layout, wire: str | None) -> Layout:
    """``layout`` with every floating tensor wider than dtype ``wire`` in that dtype (offsets
    recomputed); the others as they are (a cast to a dtype as wide or wider saves nothing, and
    may lose bits: float16 through bfloat16); ``layout`` itself for None."""
    if wire is None:
        return layout
    entries, offset = [], 0
    size = WIRE_DTYPES[wire].itemsize
    for e in layout.entries:
        if _is_float(e.dtype) and DTYPES[e.dtype].itemsize > size:
            nbytes = e.nbytes // DTYPES[e.dtype].itemsize * size
            e = Entry(e.key, wire, e.shape, offset, nbytes)
        else:
            e = Entry(e.key, e.dtype, e.shape, offset, e.nbytes)
        entries.append(e)
        offset = _align(offset + e.nbytes)
    return Layout(entries)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A flat tensor's elements as integers of the same width (2-D, one row per element, for
    16-byte ones), so that comparing them compares bits."""
    size = t.element_size()
    if size in _BITS:
        return t.view(_BITS[size])
    return t.view(torch.int64).view(-1, size // 8)


def _numel(e: Entry) -> int:
    n = 1
    for s in e.shape:
        n *= s
    return n


@dataclass(frozen=True)
class Encoded:
    """What ``Mirror.encode`` wrote: the header table and the payload bytes used."""

    table: list[list[int]]
    nbytes: int


class Mirror:
    """The sender's copy of the newest version in wire form, with the elements each of the last
    ``keep`` versions changed. Lives on ``device`` (the trainer's)."""

    def __init__(self, layout: Layout, wire: str | None, keep: int, device: torch.device) -> None:
        self.layout = layout
        self.wire = wire_layout(layout, wire)
        self.keep = keep
        self.buffer = torch.empty(self.wire.nbytes, dtype=torch.uint8, device=device)
        self.flat = [Layout.view(self.buffer, e).reshape(-1) for e in self.wire.entries]
        self.version = -1
        self._scratch = _Scratch()
        #: version -> {entry index: ascending int32 indices, or None: changed as a whole}
        self.changes: OrderedDict[int, dict[int, torch.Tensor | None]] = OrderedDict()
        #: the newest version's changed values, where the native comparison gave them (entry index ->
        #: values in the order of its indices in ``changes``): ``encode`` copies them instead of gathering
        self.values: dict[int, torch.Tensor] = {}

    # -- bringing it up to date ---------------------------------------------------------------
    def reset(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Make this mirror ``tensors`` (cast to the wire dtype) as ``version``, forgetting history."""
        with torch.no_grad():
            for e, flat in zip(self.wire.entries, self.flat):
                if e.nbytes:
                    flat.copy_(tensors[e.key].reshape(-1))
        self.changes.clear()
        self.values = {}
        self.version = version

    def update(self, tensors: Mapping[str, torch.Tensor], version: int, keys: Sequence[str] | None) -> int:
        """Make this mirror ``version``: the values of ``tensors`` (only ``keys``, if given; the
        others keep their values) compared bit for bit after the cast; remembers which elements
        changed. Returns how many elements changed."""
        changed: dict[int, torch.Tensor | None] = {}
        values: dict[int, torch.Tensor] = {}
        total = 0
        wanted = None if keys is None else set(keys)
        with torch.no_grad():
            for i, (e, flat) in enumerate(zip(self.wire.entries, self.flat)):
                if not e.nbytes or wanted is not None and e.key not in wanted:
                    continue
                found = _update(flat, tensors[e.key].reshape(-1), self._scratch)
                if found is None or not found[0].numel():
                    continue
                idx, vals = found
                total += idx.numel()
                sparse = idx.numel() * (INDEX_BYTES + flat.element_size()) < e.nbytes * _WHOLE_SHARE
                changed[i] = idx.to(torch.int32) if sparse and flat.numel() < 1 << 31 else None
                if changed[i] is not None and vals is not None:
                    values[i] = vals
        self.changes[version] = changed
        self.values = values
        while len(self.changes) > self.keep:
            self.changes.popitem(last=False)
        self.version = version
        return total

    def since(self, base: int) -> dict[int, torch.Tensor | None] | None:
        """Every element changed after version ``base`` up to this mirror's version, by entry
        index; None if some version in between is no longer remembered."""
        if not 0 <= base < self.version:
            return None
        out: dict[int, list[torch.Tensor] | None] = {}
        for v in range(base + 1, self.version + 1):
            step = self.changes.get(v)
            if step is None:
                return None
            for i, idx in step.items():
                parts = out.setdefault(i, [])
                if idx is None or parts is None:
                    out[i] = None
                else:
                    parts.append(idx)
        merged: dict[int, torch.Tensor | None] = {}
        for i, parts in out.items():
            if parts is None:
                merged[i] = None
            elif len(parts) == 1:
                merged[i] = parts[0]
            else:
                merged[i] = torch.unique(torch.cat(parts), sorted=True)
        return merged

    # -- writing payloads ---------------------------------------------------------------------
    def delta_nbytes(self, changes: Mapping[int, torch.Tensor | None]) -> int:
        """The payload bytes ``encode`` would write for ``changes``."""
        end = 0
        for i in sorted(changes):
            end = _align(end) + self._section(i, changes[i])[1]
        return _align(end) if end else 0

    def _section(self, i: int, idx: torch.Tensor | None) -> tuple[int, int]:
        """(count, bytes) of entry ``i``'s section: count -1 for the whole tensor."""
        e = self.wire.entries[i]
        if idx is None or idx.numel() * (INDEX_BYTES + self.flat[i].element_size()) >= e.nbytes:
            return -1, e.nbytes
        n = idx.numel()
        return n, _align(n * INDEX_BYTES) + n * self.flat[i].element_size()

    def encode(self, changes: Mapping[int, torch.Tensor | None], buffer: torch.Tensor) -> Encoded:
        """Write ``changes`` (entry index -> indices or None) with this mirror's values into the
        flat uint8 ``buffer``; returns the table for the header and the bytes used."""
        table: list[list[int]] = []
        offset = 0
        newest = self.changes.get(self.version, {})  # its values are at hand in self.values
        with torch.no_grad():
            for i in sorted(changes):
                offset = _align(offset)
                idx = changes[i]
                count, size = self._section(i, idx)
                flat = self.flat[i]
                if idx is None or count < 0:  # (_section counts a None entry -1: in full)
                    buffer[offset:offset + size].copy_(flat.view(torch.uint8))
                else:
                    vals_at = offset + _align(count * INDEX_BYTES)
                    buffer[offset:offset + count * INDEX_BYTES].view(torch.int32).copy_(idx)
                    dst = buffer[vals_at:vals_at + count * flat.element_size()].view(flat.dtype)
                    if i in self.values and newest.get(i) is idx:  # the newest version's own indices
                        _bits(dst).copy_(_bits(self.values[i]))
                    elif idx.dtype == torch.int32 and native.usable(flat, dst, idx):
                        native.gather(flat, idx, dst)
                    else:
                        _bits(dst).copy_(_bits(flat).index_select(0, idx.to(torch.int64)))
                table.append([i, count, offset])
                offset += size
        return Encoded(table, _align(offset) if offset else 0)

    def release(self) -> None:
        """Free the copy and the history (the scheme shut down); the mirror is empty afterwards."""
        self.buffer = torch.empty(0, dtype=torch.uint8, device=self.buffer.device)
        self.flat = []
        self.changes.clear()
        self.values = {}
        self._scratch = _Scratch()
        self.version = -1

    def pack(self, buffer: torch.Tensor) -> None:
        """Copy the whole mirror (a full payload in the wire layout) into ``buffer``."""
        buffer[:self.wire.nbytes].copy_(self.buffer)


class Costs:
    """Decides, send by send, whether diffing pays on this sender's transport, from what whole-model
    sends took end to end (snapshot to last ack).

    The rule (``delta=True`` on a zero-copy transport; ``delta="always"`` and the transports that
    copy have no ``Costs``: there fewer bytes on the link pay for the comparison): deltas are sent
    while the model is under ``_PROBE_MIN_BYTES``, fewer than ``_SAMPLES_BEFORE_PROBE`` deltas were
    timed, or their comparison (``diff_s``) stayed under ``_PROBE_DIFF_S``; then one send goes full
    without a diff (the probe: the mirror is reset to the new version and copied out, so it stays
    the base of later deltas); afterwards every send goes full without a diff (the sender drops
    the mirror) when ``_MARGIN`` times the fastest probe's time is below the fastest delta's;
    else another probe follows, up to ``_PROBES`` (a busy moment can slow one full send, rarely
    several), and then deltas go on. On shared memory a full send is one copy while the comparison alone reads the model
    twice, so there the full send wins."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes  # a full payload's
        self.delta: deque[tuple[float, float]] = deque(maxlen=8)  # (total_s, diff_s)
        self.full: float | None = None
        self.probes = 0  # probes timed
        self.probing = False

    def record(self, kind: str, total_s: float, diff_s: float) -> None:
        """Remember a whole-model send's time: ``kind`` "delta" (every target got one) or "probe"."""
        if kind == "delta":
            self.delta.append((total_s, diff_s))
        elif kind == "probe":
            self.full = total_s if self.full is None else min(self.full, total_s)
            self.probes += 1
            self.probing = False

    def next_send(self) -> str:
        """"delta", "probe" (time one full send without a diff) or "full" (diffing does not pay)."""
        if self.probing or self.nbytes < _PROBE_MIN_BYTES or len(self.delta) < _SAMPLES_BEFORE_PROBE:
            return "delta"
        if self.full is None:
            if min(d for _, d in self.delta) < _PROBE_DIFF_S:
                return "delta"
            self.probing = True
            return "probe"
        if self.full * _MARGIN < min(t for t, _ in self.delta):
            return "full"
        if self.probes < _PROBES:
            self.probing = True
            return "probe"
        return "delta"


#: deltas timed before the probe
_SAMPLES_BEFORE_PROBE = 1
#: a model smaller than this (bytes of a full payload) is never switched: its sends cost little
#: either way, and a busy host could make a few milliseconds look like a reason
_PROBE_MIN_BYTES = 16 << 20
#: a comparison faster than this (seconds) is never replaced by full sends
_PROBE_DIFF_S = 0.005
#: full sends replace deltas when this many times the fastest probe's time is below the fastest delta's
_MARGIN = 1.2
#: the most probes timed before deltas go on for good
_PROBES = 3


class _Scratch:
    """Temporary buffers a diff reuses from one call to the next (a fresh multi-megabyte tensor
    would cost its page faults every time)."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[torch.dtype, torch.device, str], torch.Tensor] = {}

    def get(self, n: int, dtype: torch.dtype, device: torch.device, slot: str = "") -> torch.Tensor:
        """``n`` elements of reused memory; each ``slot`` its own (for uses alive at once)."""
        buf = self._bufs.get((dtype, device, slot))
        if buf is None or buf.numel() < n:
            buf = self._bufs[(dtype, device, slot)] = torch.empty(max(n, 1), dtype=dtype, device=device)
        return buf[:n]


def _update(mirror: torch.Tensor, source: torch.Tensor,
            scratch: _Scratch | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Copy into ``mirror`` the elements of ``source`` (cast to its dtype) whose bits differ;
    their ascending indices (int64) and, where the native kernel (``native``) did it in one pass
    over both, their new values (else None: torch ops, in steps of ``_CHUNK_BYTES`` of the
    mirror, so that each step's temporaries (the mask, the changed words) stay in the cache);
    None if nothing differed."""
    scratch = scratch or _Scratch()
    if mirror.device.type == "cpu" and mirror.element_size() < 16 and _words(mirror) is not None \
            and native.available():
        return _update_native(mirror, source, scratch)
    step = max(8, _CHUNK_BYTES // mirror.element_size())
    found = []
    for a in range(0, mirror.numel(), step):
        src = source[a:a + step]
        if src.dtype != mirror.dtype:
            src = scratch.get(src.numel(), mirror.dtype, mirror.device).copy_(src)
        idx = _changed(mirror[a:a + step], src, scratch)
        if idx is not None:
            found.append(idx.add_(a) if a else idx)
    if not found:
        return None
    return (found[0] if len(found) == 1 else torch.cat(found)), None


def _update_native(mirror: torch.Tensor, source: torch.Tensor,
                   scratch: _Scratch) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``_update`` by the native kernel, which also gives the changed elements' new values: the
    mirror split into as many parts as torch has threads, compared at once (a source in another
    dtype, or not viewable as words, is cast into scratch a step at a time first)."""
    ratio = 8 // mirror.element_size()
    words = mirror.numel() // ratio
    # the kernel reads the source by address: one on another device is copied over a step at a time
    direct = source.dtype == mirror.dtype and source.device.type == "cpu" and _words(source) is not None
    step = words if direct else max(1, _CHUNK_BYTES // 8)
    parts = max(1, min(torch.get_num_threads(), _MAX_PARTS)) if words * 8 >= _PARALLEL_BYTES else 1
    found: list[tuple[torch.Tensor, torch.Tensor]] = []
    for a in range(0, words, step):
        b = min(words, a + step)
        src = source[a * ratio:b * ratio]
        if not direct:
            src = scratch.get(src.numel(), mirror.dtype, mirror.device).copy_(src)
        cuts = [a + (b - a) * i // parts for i in range(parts + 1)]
        jobs = [(cuts[i], cuts[i + 1], i) for i in range(parts) if cuts[i + 1] > cuts[i]]

        def run(job: tuple[int, int, int], a: int = a, src: torch.Tensor = src) -> list[tuple[torch.Tensor, torch.Tensor]]:
            lo, hi, slot = job
            out = scratch.get(_NATIVE_OUT, torch.int64, mirror.device, f"indices {slot}")
            values = scratch.get(_NATIVE_OUT, mirror.dtype, mirror.device, f"values {slot}")
            return native.diff_words(mirror[lo * ratio:hi * ratio], src[(lo - a) * ratio:(hi - a) * ratio], out,
                                     values, lo * ratio)

        later = [_diff_pool().submit(run, job) for job in jobs[1:]]
        found += run(jobs[0])
        for f in later:
            found += f.result()
    if not found:
        return None
    if len(found) == 1:
        return found[0]
    return torch.cat([i for i, _ in found]), torch.cat([v for _, v in found])


#: the most parts a native comparison is split into, and the least bytes per mirror to split at all
_MAX_PARTS = 8
_PARALLEL_BYTES = 1 << 20
#: int64 indices a native comparison writes between two collections (per part)
_NATIVE_OUT = 1 << 20
_pool: list[ThreadPoolExecutor] = []


def _diff_pool() -> ThreadPoolExecutor:
    if not _pool:
        _pool.append(ThreadPoolExecutor(max_workers=_MAX_PARTS - 1, thread_name_prefix="wsync-diff"))
    return _pool[0]


# a forked child has none of the pool's threads: it starts a pool of its own when it needs one
os.register_at_fork(after_in_child=_pool.clear)


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` (flat, elements narrower than 8 bytes) as int64 words, or None where it cannot be viewed so."""
    ratio = 8 // t.element_size()
    if t.numel() % ratio or not t.is_contiguous() or t.data_ptr() % 8:
        return None
    try:
        return t.view(torch.int64)
    except RuntimeError:
        return None


def _changed(mirror: torch.Tensor, src: torch.Tensor, scratch: _Scratch) -> torch.Tensor | None:
    """Update ``mirror`` (flat) to ``src``'s bits where they differ; the indices that did (None if none).
    Narrow elements are compared 8 bytes at a time; only the words that differ are copied into
    the mirror and looked into element by element."""
    size = mirror.element_size()
    m_words = _words(mirror) if size < 8 else None
    s_words = _words(src) if m_words is not None else None
    if s_words is None or m_words is None:  # (s_words is None whenever m_words is)
        m_bits, s_bits = _bits(mirror), _bits(src)
        ne = s_bits != m_bits
        if ne.dim() > 1:
            ne = ne.any(1)
        idx = ne.nonzero().view(-1)
        if not idx.numel():
            return None
        m_bits.index_copy_(0, idx, s_bits.index_select(0, idx))
        return idx
    mask = torch.ne(s_words, m_words, out=scratch.get(s_words.numel(), torch.bool, s_words.device))
    words = mask.nonzero().view(-1)  # one pass: cheaper than finding 8 words at a time first
    if not words.numel():
        return None
    new, old = s_words.index_select(0, words), m_words.index_select(0, words)
    m_words.index_copy_(0, words, new)
    ratio = 8 // size
    inner = torch.ne(old.view(_BITS[size]), new.view(_BITS[size])).nonzero().view(-1)
    if inner.numel() == words.numel() * ratio:  # every element of each changed word
        return (words.unsqueeze(1) * ratio + torch.arange(ratio, device=words.device)).view(-1)
    shift = ratio.bit_length() - 1  # ratio is 2, 4 or 8: shifts and masks, not integer division
    return words.index_select(0, inner >> shift).mul_(ratio).add_(inner & (ratio - 1))


# -- the receiver's side ------------------------------------------------------------------------
@dataclass(frozen=True)
class Op:
    """One section of a table, checked: the model's entry, the wire entry, count (-1: whole),
    and where its indices and values lie in the payload."""

    entry: Entry
    wire: Entry
    count: int
    offset: int
    values_at: int


def decode_table(table: Any, layout: Layout, wire: Layout, nbytes: int, where: str) -> list[Op]:
    """Check a header's table against the model's ``layout``, its ``wire`` layout and a payload of
    ``nbytes`` bytes: entries ascending, sections in order, aligned and inside the payload.
    Raises TransportError naming what is wrong."""
    if not isinstance(table, list):
        raise TransportError(f"{where}: the payload table is malformed")
    ops: list[Op] = []
    last, end = -1, 0
    for item in table:
        if not (isinstance(item, list) and len(item) == 3 and all(type(x) is int for x in item)):
            raise TransportError(f"{where}: malformed payload table entry {item!r:.60}")
        i, count, offset = item
        if not last < i < len(layout.entries):
            raise TransportError(f"{where}: payload table names tensor #{i} (out of order or out of range)")
        e, w = layout.entries[i], wire.entries[i]
        numel = _numel(e)
        size = w.nbytes // max(numel, 1) if numel else 0
        if count == -1:
            length, values_at = w.nbytes, offset
        elif 0 < count < numel:
            values_at = offset + _align(count * INDEX_BYTES)
            length = values_at - offset + count * size
        else:
            raise TransportError(f"{where}: payload table gives tensor {e.key!r} {count} elements "
                                 f"(it has {numel})")
        if offset < end or offset % ALIGN or offset + length > nbytes:
            raise TransportError(f"{where}: payload table puts tensor {e.key!r} at bytes "
                                 f"[{offset}, {offset + length}) of a {nbytes}-byte payload (overlapping, "
                                 f"misaligned or past its end)")
        ops.append(Op(e, w, count, offset, values_at))
        last, end = i, offset + length
    return ops


def check_indices(ops: Sequence[Op], payload: torch.Tensor, where: str) -> list[torch.Tensor | None]:
    """Each sparse section's indices (int32, copied out of the payload: what is checked is what is
    used, whatever a faulty transport writes to its buffer meanwhile), checked strictly ascending
    and inside its tensor; None for a whole section. Raises TransportError for any index out of place."""
    out: list[torch.Tensor | None] = []
    for op in ops:
        if op.count < 0:
            out.append(None)
            continue
        idx = payload[op.offset:op.offset + op.count * INDEX_BYTES].view(torch.int32).clone()
        numel = _numel(op.entry)
        if native.usable(idx):
            ok = native.ascending(idx, numel)
        else:
            wide = idx.to(torch.int64)
            ok = int(wide[0]) >= 0 and int(wide[-1]) < numel and (op.count == 1 or bool((wide[1:] > wide[:-1]).all()))
        if not ok:
            raise TransportError(f"{where}: the indices for tensor {op.entry.key!r} are out of range or not "
                                 f"strictly ascending (damaged payload)")
        out.append(idx)
    return out


def apply_ops(ops: Sequence[Op], indices: Sequence[torch.Tensor | None], payload: torch.Tensor,
              targets: Mapping[str, torch.Tensor]) -> None:
    """Write each checked section into its target in place (cast to the target's dtype)."""
    with torch.no_grad():
        for op, idx in zip(ops, indices):
            t = targets[op.entry.key]
            dtype = op.wire.torch_dtype
            if op.count < 0:
                src = payload[op.offset:op.offset + op.wire.nbytes].view(dtype).view(op.entry.shape)
                size = t.element_size()
                if dtype == t.dtype and size in _BITS:  # bits as they are (a bool's byte too)
                    t.view(_BITS[size]).copy_(src.view(_BITS[size]))
                else:
                    t.copy_(src)
                continue
            assert idx is not None  # check_indices gives every sparse section its indices
            vals = payload[op.values_at:op.values_at + op.count * dtype.itemsize].view(dtype)
            if vals.device != t.device:
                vals, idx = vals.to(t.device), idx.to(t.device)
            if dtype != t.dtype:
                vals = vals.to(t.dtype)
            if t.is_contiguous() and t.numel() == _numel(op.entry) and native.usable(t, vals, idx):
                native.scatter(t.view(-1), idx, vals)  # the bits as they are, like index_copy_ below
            elif t.is_contiguous():
                _bits(t.view(-1)).index_copy_(0, idx.to(torch.int64), _bits(vals))
            else:  # write through a contiguous copy, in the same (row-major) order as the sender's
                flat = t.reshape(-1).clone()
                _bits(flat).index_copy_(0, idx.to(torch.int64), _bits(vals))
                t.copy_(flat.view(t.shape))


def unpack_wire(wire: Layout, payload: torch.Tensor, targets: Mapping[str, torch.Tensor]) -> None:
    """Copy a full payload in the ``wire`` layout into ``targets``, casting each tensor to its dtype."""
    with torch.no_grad():
        for e in wire.entries:
            if e.nbytes:
                targets[e.key].copy_(Layout.view(payload, e))
