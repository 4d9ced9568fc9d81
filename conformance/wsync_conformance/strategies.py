"""Hypothesis strategies for what users really sync: nested modules, parameters and buffers,
every dtype of the contract, 0-d, empty and large tensors, non-contiguous and shared-storage sources,
state_dicts and TensorDicts."""

from __future__ import annotations

import json

from hypothesis import strategies as st

from .models import KINDS, SOURCES, SPEC_DTYPES, ModelSpec, TensorSpec, trainable

__all__ = ["dtypes", "shapes", "model_specs", "value_styles", "seeds", "hostile_json", "HOSTILE_TOKENS", "STYLES"]

STYLES = ("bits", "bits", "extremes", "zeros", "ones")
_MODULES = ("encoder", "decoder", "blk0", "blk1", "head", "norm")


def dtypes() -> st.SearchStrategy[str]:
    """Every dtype the exact guarantee covers."""
    return st.sampled_from(SPEC_DTYPES)


def shapes(max_dims: int = 3, max_side: int = 6) -> st.SearchStrategy[tuple[int, ...]]:
    """0-d, empty (a zero side) and small shapes."""
    return st.lists(st.integers(0, max_side), max_size=max_dims).map(tuple)


def seeds() -> st.SearchStrategy[int]:
    return st.integers(0, 2**32 - 1)


@st.composite
def tensor_specs(draw, key: str) -> TensorSpec:
    dtype = draw(dtypes())
    shape = draw(shapes())
    buffer = True if not trainable(dtype) else draw(st.booleans())
    return TensorSpec(key, shape, dtype, buffer=buffer, source=draw(st.sampled_from(SOURCES)))


@st.composite
def model_specs(draw, kinds: tuple[str, ...] = KINDS, max_tensors: int = 6, large: bool = False) -> ModelSpec:
    """A model: a container kind and 1..max_tensors tensors under nested dotted keys
    (optionally one large tensor of a few MiB, and weights tied to another key)."""
    kind = draw(st.sampled_from(kinds))
    n = draw(st.integers(1, max_tensors))
    tensors = []
    for i in range(n):
        path = draw(st.lists(st.sampled_from(_MODULES), max_size=2, unique=True))
        tensors.append(draw(tensor_specs(".".join([*path, f"t{i}"]))))
    if draw(st.booleans()):
        src = draw(st.sampled_from(tensors))
        if src.tied is None:
            tensors.append(TensorSpec(f"tied.t{n}", src.shape, src.dtype, buffer=src.buffer, tied=src.key))
    if large and draw(st.booleans()):
        tensors.append(TensorSpec("large.weight", (draw(st.integers(1, 4)) * 256, 1024), "float32"))
    return ModelSpec(kind, tuple(tensors))


def value_styles(spec: ModelSpec) -> st.SearchStrategy[dict[str, str]]:
    """For each tensor: random bits, extreme values (inf, nan, -0.0, min, max), zeros or ones."""
    return st.fixed_dictionaries({t.key: st.sampled_from(STYLES) for t in spec.tensors if t.tied is None})


#: what a hostile peer puts where a JSON value goes: a 5000-digit integer (Python's int() refuses
#: more than 4300), nesting deeper than any parser's recursion, non-numbers, non-UTF-8, huge sizes
HOSTILE_TOKENS: tuple[bytes, ...] = (
    b"9" * 5000, b"-" + b"1" * 4400, b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000,
    b"NaN", b"Infinity", b"-Infinity", b"1e999", b"1" * 400 + b".5", b'"\xff\xfe"', b'"\\ud800"', b"\xff\xfe",
    b"18446744073709551616", b"-1", b"true", b"null", b"[]", b"{}", b'"1"', b"1.5",
)
_FIELDS = ("wsync", "v", "w", "m", "d", "n", "c", "l", "e", "t", "k", "g", "s", "f", "b", "inbox", "nbytes")


def hostile_json() -> st.SearchStrategy[bytes]:
    """Bytes a broken or hostile peer may send where JSON is expected: random bytes; JSON
    messages with fields of every type; such messages with a value swapped for a hostile token
    (HOSTILE_TOKENS), truncated, or with bytes spliced in."""
    scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
               | st.text(max_size=8))
    values = st.recursive(scalars, lambda c: st.lists(c, max_size=4)
                          | st.dictionaries(st.sampled_from(_FIELDS) | st.text(max_size=3), c, max_size=6),
                          max_leaves=16)
    messages = st.fixed_dictionaries({"wsync": st.sampled_from([1, 1, 1, 0, "1", None])},
                                     optional={k: values for k in _FIELDS[1:]})
    documents = st.one_of(values, messages).map(lambda v: json.dumps(v, separators=(",", ":")).encode())

    def swap(doc: bytes, token: bytes, at: int) -> bytes:
        colons = [i for i, b in enumerate(doc) if b == ord(":")] or [len(doc) - 1]
        i = colons[at % len(colons)] + 1
        end = i
        while end < len(doc) and doc[end:end + 1] not in (b",", b"}", b"]"):
            end += 1
        return doc[:i] + token + doc[end:]

    swapped = st.builds(swap, messages.map(lambda v: json.dumps(v, separators=(",", ":")).encode()),
                        st.sampled_from(HOSTILE_TOKENS), st.integers(0, 20))
    cut = st.builds(lambda d, n: d[:n], documents, st.integers(0, 64))
    spliced = st.builds(lambda d, n, junk: d[:n] + junk + d[n:], documents, st.integers(0, 64), st.binary(max_size=4))
    return st.one_of(st.binary(max_size=128), documents, swapped, cut, spliced, st.sampled_from(HOSTILE_TOKENS))
