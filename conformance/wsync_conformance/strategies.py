"""Hypothesis strategies for what users really sync: nested modules, parameters and buffers,
every dtype of the contract, 0-d, empty and large tensors, non-contiguous and shared-storage sources,
state_dicts and TensorDicts."""

from __future__ import annotations

from hypothesis import strategies as st

from .models import KINDS, SOURCES, SPEC_DTYPES, ModelSpec, TensorSpec

__all__ = ["dtypes", "shapes", "model_specs", "value_styles", "seeds", "STYLES"]

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
    floating = dtype in ("float64", "float32", "float16", "bfloat16")
    buffer = True if not floating else draw(st.booleans())
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
