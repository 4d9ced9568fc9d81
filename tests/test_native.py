"""The native kernels give the torch path's answer bit for bit: the delta comparison the same
changed indices and the same mirror afterwards, for every element width, split across threads or
not, after a fork too; a small model's copy into or out of a payload the same bytes, bumping the
version counters as torch does; and they can be switched off."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from wsync_core import delta, native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler here: the torch path is all there is")

_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.bfloat16, torch.float16, torch.int32,
           torch.float32, torch.int64, torch.float64]


def _random_bits(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """``n`` elements of ``dtype`` with arbitrary bit patterns (NaN payloads, -0.0, subnormals)."""
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype)


def _both(mirror: torch.Tensor, source: torch.Tensor):
    """(indices, mirror after) from the native path and from the torch path."""
    m_native, m_torch = mirror.clone(), mirror.clone()
    got = delta._update(m_native, source)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(native, "available", lambda: False)
        want = delta._update(m_torch, source)
    return (got, m_native), (want, m_torch)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(_DTYPES), words=st.integers(1, 3000), density=st.sampled_from([0.0, 0.001, 0.01, 0.3, 1.0]),
       seed=st.integers(0, 2**31 - 1), cast=st.booleans())
def test_native_matches_torch(dtype: torch.dtype, words: int, density: float,
                              seed: int, cast: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    size = torch.empty(0, dtype=dtype).element_size()
    n = words * (8 // size)
    mirror = _random_bits(n, dtype, gen)
    source = mirror.clone()
    changed = torch.rand(n, generator=gen) < density
    source[changed] = _random_bits(int(changed.sum()), dtype, gen)
    if cast and dtype.is_floating_point and dtype != torch.float64:
        source = source.to(torch.float64)  # a wire dtype: cast into scratch step by step first
    (got, m_native), (want, m_torch) = _both(mirror, source)
    assert (got is None) == (want is None)
    if got is not None:
        assert want[1] is None  # torch ops give no values
        assert got[0].dtype == torch.int64 and torch.equal(got[0], want[0])
        assert _bits_equal(got[1], m_torch.view(-1)[got[0]])  # the new values, in the indices' order
    assert _bits_equal(m_native, m_torch)


def test_native_parts_and_a_full_output_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 32 MiB mirror split across threads, with more changes than the output buffer holds at
    once, and a source that is a misaligned view (copied into scratch first)."""
    gen = torch.Generator().manual_seed(7)
    n = 16 << 20  # bfloat16: 32 MiB
    mirror = _random_bits(n, torch.bfloat16, gen)
    source = mirror.clone()
    idx = torch.randperm(n, generator=gen)[: n // 5]  # more than one output buffer's worth per part
    source[idx] = _random_bits(idx.numel(), torch.bfloat16, gen)
    monkeypatch.setattr(delta, "_NATIVE_OUT", 4096)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        (got, m_native), (want, m_torch) = _both(mirror, source)
        assert torch.equal(got[0], want[0]) and _bits_equal(m_native, m_torch)
        assert _bits_equal(got[1], source[got[0]])
        padded = torch.cat([torch.zeros(1, dtype=torch.bfloat16), source])[1:]  # 2 bytes past an 8-byte boundary
        assert delta._words(padded) is None
        (got, m_native), (want, m_torch) = _both(mirror, padded)
        assert torch.equal(got[0], want[0]) and _bits_equal(m_native, m_torch)
    finally:
        torch.set_num_threads(threads)


def test_diff_words_resumes_after_a_full_buffer() -> None:
    mirror = torch.zeros(64, dtype=torch.int16)
    source = torch.arange(1, 65, dtype=torch.int16)  # every element differs
    pieces = native.diff_words(mirror, source, torch.empty(8, dtype=torch.int64), torch.empty(8, dtype=torch.int16),
                               base=100)
    assert len(pieces) == 8
    assert torch.equal(torch.cat([i for i, _ in pieces]), torch.arange(100, 164))
    assert torch.equal(torch.cat([v for _, v in pieces]), source)
    assert torch.equal(mirror, source)


def test_a_forked_child_starts_a_pool_of_its_own() -> None:
    """The parent's diff threads do not exist in a forked child: it forgets their pool (a submit
    to it would wait forever) and makes a new one when it needs one."""
    n = 4 << 20
    mirror = torch.zeros(n, dtype=torch.bfloat16)
    source = mirror.clone()
    source[::100] = 1
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert delta._update(mirror.clone(), source) is not None
    finally:
        torch.set_num_threads(threads)
    assert delta._pool, "a 8 MiB diff on 2 threads uses the pool"
    pid = os.fork()
    if pid == 0:  # no torch op here: torch's own OpenMP threads are not fork-safe either
        os._exit(0 if not delta._pool else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_switched_off_by_the_environment() -> None:
    code = "from wsync_core import native; print(native.available())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "WSYNC_NATIVE": "0"}, capture_output=True,
                         text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from(_DTYPES), n=st.integers(1, 5000), k=st.integers(1, 400), seed=st.integers(0, 2**31 - 1))
def test_gather_and_scatter_match_torch(dtype: torch.dtype, n: int, k: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    source = _random_bits(n, dtype, gen)
    index = torch.unique(torch.randint(0, n, (k,), generator=gen)).to(torch.int32)
    out = torch.empty(index.numel(), dtype=dtype)
    native.gather(source, index, out)
    assert _bits_equal(out, delta._bits(source).index_select(0, index.to(torch.int64)).view(dtype))
    target, want = _random_bits(n, dtype, gen), None
    want = target.clone()
    delta._bits(want).index_copy_(0, index.to(torch.int64), delta._bits(out))
    native.scatter(target, index, out)
    assert _bits_equal(target, want)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=50), limit=st.integers(0, 2**31))
def test_ascending_matches_the_rule(values: list[int], limit: int) -> None:
    index = torch.tensor(values, dtype=torch.int32)
    want = all(0 <= v < limit for v in values) and all(a < b for a, b in zip(values, values[1:]))
    assert native.ascending(index, limit) == want


# -- a small model's copy into and out of a payload (Layout.pack / unpack) ----------------------
def _layout_case(shapes: list[tuple[tuple[int, ...], torch.dtype]], seed: int):
    from wsync_core.layout import Layout
    gen = torch.Generator().manual_seed(seed)
    tensors = {f"t{i:02d}": _random_bits(max(1, math.prod(shape)), dtype, gen)[:math.prod(shape)].reshape(shape)
               for i, (shape, dtype) in enumerate(shapes)}
    return Layout.of(tensors), tensors


_SHAPES = st.lists(st.tuples(st.lists(st.integers(0, 9), max_size=3).map(tuple), st.sampled_from(_DTYPES)),
                   min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(shapes=_SHAPES, seed=st.integers(0, 2**31 - 1))
def test_small_pack_and_unpack_are_the_torch_copy_bit_for_bit(shapes, seed: int) -> None:
    layout, tensors = _layout_case(shapes, seed)
    assert layout._regions is not None  # small: the native copy is the one that runs
    got = torch.full((layout.nbytes,), 0xAB, dtype=torch.uint8)
    want = got.clone()
    layout.pack(tensors, got)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(native, "kernel", lambda: None)
        layout.pack(tensors, want)
    assert torch.equal(got, want)
    targets = {k: torch.zeros_like(v) for k, v in tensors.items()}
    versions = {k: t._version for k, t in targets.items()}
    layout.unpack(got, targets, ready=layout.ready(targets))
    for k, t in targets.items():
        assert _bits_equal(t.reshape(-1), tensors[k].reshape(-1)), k
        if t.numel():
            assert t._version > versions[k], f"{k}: an in-place write must bump the version counter"


def test_unpack_falls_back_to_torch_where_raw_bytes_would_be_wrong() -> None:
    """A non-contiguous target: torch's copy, which honours its strides; a complex model (whose
    conjugate views raw bytes would not honour) always goes through torch; a negative view is never
    written as raw bytes (``ready`` says no)."""
    from wsync_core.layout import Layout
    src = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3)}
    layout = Layout.of(src)
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    layout.pack(src, payload)
    assert not layout.ready({"a": torch.zeros(2, 3), "b": torch._neg_view(torch.zeros(3))})
    strided = torch.zeros(3, 2).t()
    targets = {"a": strided, "b": torch.zeros(3)}
    assert not layout.ready(targets)
    layout.unpack(payload, targets)
    assert torch.equal(strided, src["a"]) and torch.equal(targets["b"], src["b"])
    cplx = {"c": torch.randn(4, dtype=torch.complex64)}
    layout = Layout.of(cplx)
    assert layout._regions is None
    payload = torch.empty(layout.nbytes, dtype=torch.uint8)
    layout.pack(cplx, payload)
    out = {"c": torch.zeros(4, dtype=torch.complex64)}
    layout.unpack(payload, out, ready=layout.ready(out))
    assert torch.equal(out["c"], cplx["c"])


def test_a_received_version_breaks_a_graph_that_saved_the_old_weights() -> None:
    """As with an in-place torch copy: backward through a graph that saved a weight the payload
    overwrote raises, instead of silently using the new values."""
    from wsync_core.layout import Layout
    model = torch.nn.Linear(3, 3)
    targets = {k: v for k, v in model.named_parameters()}
    layout = Layout.of(targets)
    payload = torch.zeros(layout.nbytes, dtype=torch.uint8)
    out = model(torch.randn(2, 3, requires_grad=True)).sum()
    layout.unpack(payload, targets, ready=layout.ready(targets))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_kernels_refuse_tensors_outside_cpu_memory() -> None:
    """A kernel reads by address: a tensor on another device (a GPU's, here the meta device's)
    raises ValueError naming it instead of crashing the process."""
    cpu, meta = torch.zeros(64, dtype=torch.int64), torch.empty(64, dtype=torch.int64, device="meta")
    idx = torch.arange(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="CPU tensors only, got tensors on cpu, meta"):
        native.diff_words(cpu, meta, torch.empty(64, dtype=torch.int64), torch.empty(64, dtype=torch.int64))
    with pytest.raises(ValueError, match="meta"):
        native.gather(meta, idx, torch.empty(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="meta"):
        native.scatter(meta, idx, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="meta"):
        native.ascending(idx.to("meta"), 64)
