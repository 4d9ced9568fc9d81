"""Model descriptions the suite builds on both sides, and the values it puts into them.

A ``ModelSpec`` is plain data (it crosses to receiver processes as JSON): keys, shapes, dtypes,
whether a module entry is a buffer, and how the *sender* holds it (contiguous, transposed,
strided, a slice of a shared storage, or tied to another key). Receivers always build plain
contiguous tensors; exactness is then checked through per-key digests of the raw bytes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn
from wsync_core.layout import DTYPES
from wsync_core.weights import flatten

__all__ = [
    "SPEC_DTYPES",
    "trainable",
    "TensorSpec",
    "ModelSpec",
    "build",
    "fill",
    "fill_version",
    "random_values",
    "digests",
    "digest_of",
    "payload_digest",
    "rich_spec",
    "version_spec",
    "many_spec",
    "oracle_spec",
    "ORACLE_SIZES",
    "KINDS",
]

#: the dtypes the "exact" guarantee covers (docs/guarantees.md): every one wsync carries with the
#: installed torch, by wire name
SPEC_DTYPES: tuple[str, ...] = tuple(DTYPES)
KINDS: tuple[str, ...] = ("module", "tensordict", "state_dict")
SOURCES: tuple[str, ...] = ("contiguous", "transposed", "strided", "shared")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: ``source`` is how the sender holds it; ``tied`` names a key it aliases."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    buffer: bool = False
    source: str = "contiguous"
    tied: str | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class ModelSpec:
    """A whole model: its container kind (module, tensordict, state_dict) and its tensors."""

    kind: str
    tensors: tuple[TensorSpec, ...] = field(default_factory=tuple)

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind, "tensors": [vars(t) for t in self.tensors]})

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        raw = json.loads(text)
        return cls(raw["kind"], tuple(TensorSpec(t["key"], tuple(t["shape"]), t["dtype"], t["buffer"], t["source"],
                                                 t["tied"]) for t in raw["tensors"]))

    def with_kind(self, kind: str) -> ModelSpec:
        return ModelSpec(kind, self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.numel * DTYPES[t.dtype].itemsize for t in self.tensors)


def _alloc(t: TensorSpec, device: torch.device, sender: bool, pools: dict[str, list[torch.Tensor]]) -> torch.Tensor:
    dtype = DTYPES[t.dtype]
    source = t.source if sender else "contiguous"
    if source == "transposed" and len(t.shape) >= 2:
        shape = list(t.shape)
        shape[-1], shape[-2] = shape[-2], shape[-1]
        return torch.zeros(shape, dtype=dtype, device=device).transpose(-1, -2)
    if source in ("strided", "transposed") and len(t.shape) >= 1:
        shape = list(t.shape)
        shape[0] *= 2
        return torch.zeros(shape, dtype=dtype, device=device)[::2]
    if source == "shared":
        # a slice of one storage shared by every "shared" tensor of this dtype (with a gap)
        pool = pools.setdefault(t.dtype, [])
        pool.append(t)  # type: ignore[arg-type]
        return None  # type: ignore[return-value]  # filled in by _share
    return torch.zeros(t.shape, dtype=dtype, device=device)


def _share(specs: list[TensorSpec], device: torch.device) -> dict[str, torch.Tensor]:
    total = sum(s.numel + 1 for s in specs)
    storage = torch.zeros(total, dtype=DTYPES[specs[0].dtype], device=device)
    out, offset = {}, 0
    for s in specs:
        out[s.key] = storage[offset:offset + s.numel].view(s.shape)
        offset += s.numel + 1
    return out


def build(spec: ModelSpec, device: str | torch.device = "cpu", *, sender: bool = False):
    """A zero-filled model of ``spec`` on ``device``: an nn.Module, a TensorDict or a state_dict.

    With ``sender=True`` tensors are held the way ``TensorSpec.source`` says (views, shared
    storage); otherwise every tensor is contiguous and owns its storage (ties are kept).
    """
    device = torch.device(device)
    tensors: dict[str, torch.Tensor] = {}
    pools: dict[str, list[TensorSpec]] = {}
    for t in spec.tensors:
        if t.tied is None:
            value = _alloc(t, device, sender, pools)  # type: ignore[arg-type]
            if value is not None:
                tensors[t.key] = value
    for specs in pools.values():
        tensors.update(_share(specs, device))
    for t in spec.tensors:
        if t.tied is not None:
            tensors[t.key] = tensors[t.tied]
    if spec.kind == "state_dict":
        return {t.key: tensors[t.key] for t in spec.tensors}
    if spec.kind == "tensordict":
        from tensordict import TensorDict  # only here: importing it costs each receiver runner seconds

        td = TensorDict({}, batch_size=[], device=None)
        for t in spec.tensors:
            td[tuple(t.key.split("."))] = tensors[t.key]
        return td
    if spec.kind != "module":
        raise ValueError(f"model kind must be one of {KINDS}, got {spec.kind!r}")
    root = nn.Module()
    made: dict[str, nn.Parameter] = {}
    for t in spec.tensors:
        *path, leaf = t.key.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        value = tensors[t.key]
        if t.buffer:
            mod.register_buffer(leaf, value)
        else:
            source = t.tied or t.key
            if source not in made:
                made[source] = nn.Parameter(value, requires_grad=value.is_floating_point() or value.is_complex())
            mod.register_parameter(leaf, made[source])
    return root


def fill(model, values: Mapping[str, torch.Tensor]) -> None:
    """Write ``values`` (key -> tensor) into ``model``'s tensors in place."""
    targets = flatten(model)
    with torch.no_grad():
        for key, value in values.items():
            targets[key].copy_(value)


def fill_version(model, version: int) -> None:
    """Fill every tensor of ``model`` with the number ``version`` (see ``version_spec``)."""
    with torch.no_grad():
        for t in flatten(model).values():
            t.fill_(version)


def random_values(spec: ModelSpec, seed: int, styles: Mapping[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Values for every untied tensor of ``spec`` from ``seed`` (CPU tensors).

    Styles: ``bits`` (random bytes: NaN payloads, -0.0, subnormals), ``extremes`` (the
    dtype's min/max/inf/nan), ``zeros``, ``ones``.
    """
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for t in spec.tensors:
        if t.tied is not None:
            continue
        dtype = DTYPES[t.dtype]
        style = (styles or {}).get(t.key, "bits")
        n = t.numel
        if dtype is torch.bool:
            value = torch.randint(0, 2, (n,), generator=g, dtype=torch.uint8).bool()
            if style == "zeros":
                value.zero_()
            elif style in ("ones", "extremes"):
                value.fill_(True)
        elif style == "zeros":
            value = torch.zeros(n, dtype=dtype)
        elif style == "ones":
            value = torch.ones(n, dtype=dtype)
        elif style == "extremes":
            real = _REAL.get(dtype, dtype)  # a complex number's parts each draw from its parts' extremes
            if real.is_floating_point:
                info = torch.finfo(real)
                pool = torch.tensor([info.max, info.min, info.tiny, -0.0, float("inf"), float("-inf"), float("nan"),
                                     info.eps], dtype=torch.float64).to(real)  # inf: NaN where there is none
            else:
                ints = torch.iinfo(real)
                pool = torch.tensor([ints.max, ints.min, 0, -1 if ints.min < 0 else 1], dtype=real)
            parts = 2 if dtype.is_complex else 1
            value = pool[torch.randint(0, len(pool), (n * parts,), generator=g)]
            value = torch.view_as_complex(value.reshape(n, 2)) if dtype.is_complex else value
        else:
            raw = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8)
            value = raw.view(dtype)
        out[t.key] = value.reshape(t.shape)
    return out


#: a complex dtype's parts
_REAL = {torch.complex64: torch.float32, torch.complex128: torch.float64}


def trainable(dtype: str) -> bool:
    """Whether a tensor of ``dtype`` (a wire name) can be a parameter that requires grad."""
    return DTYPES[dtype].is_floating_point or DTYPES[dtype].is_complex


def digests(model) -> dict[str, str]:
    """Key -> BLAKE2b of the tensor's raw bytes (bit-exact comparison without shipping bytes)."""
    return {key: digest_of(t) for key, t in flatten(model).items()}


def rich_spec(kind: str = "module", large_mib: int = 4) -> ModelSpec:
    """Every dtype of the contract; 0-d, empty and large tensors; nested keys; parameters and buffers;
    transposed, strided, shared-storage and tied sources."""
    ts = [
        TensorSpec("encoder.layer0.weight", (16, 8), "float32", source="transposed"),
        TensorSpec("encoder.layer0.bias", (16,), "float32", source="strided"),
        TensorSpec("encoder.layer1.weight", (8, 16), "float64", source="shared"),
        TensorSpec("encoder.layer1.bias", (8,), "float64", source="shared"),
        TensorSpec("encoder.norm.weight", (8,), "float16"),
        TensorSpec("encoder.norm.running_mean", (8,), "bfloat16", buffer=True),
        TensorSpec("encoder.norm.num_batches_tracked", (), "int64", buffer=True),
        TensorSpec("head.weight", (4, 8), "bfloat16", source="transposed"),
        TensorSpec("head.scale", (), "float32"),
        TensorSpec("head.empty", (0, 3), "float32"),
        TensorSpec("head.tied_weight", (4, 8), "bfloat16", tied="head.weight"),
        TensorSpec("stats.counts", (5, 3), "int32", buffer=True, source="transposed"),
        TensorSpec("stats.small", (7,), "int8", buffer=True),
        TensorSpec("stats.bytes", (33,), "uint8", buffer=True),
        TensorSpec("stats.mask", (3, 5), "bool", buffer=True),
        TensorSpec("stats.none", (0,), "int64", buffer=True),
    ]
    present = {t.dtype for t in ts}  # then one tensor of each other dtype, odd sizes, some transposed
    ts += [TensorSpec(f"extra.{name}", (3, 5) if i % 2 else (7,), name, buffer=not trainable(name),
                      source="transposed" if i % 2 else "contiguous")
           for i, name in enumerate(d for d in SPEC_DTYPES if d not in present)]
    if large_mib:
        ts.append(TensorSpec("big.weight", (large_mib * 256, 1024), "float32"))
    return ModelSpec(kind, tuple(ts))


def version_spec(kind: str = "module", side: int = 64) -> ModelSpec:
    """Eight equal ``side`` x ``side`` tensors (float32, float64, int64): filled with the version
    number, a torn model shows up as tensors holding different numbers."""
    ts = [TensorSpec(f"block{i}.weight", (side, side), ("float32", "float64", "int64")[i % 3]) for i in range(8)]
    return ModelSpec(kind, tuple(ts))


def digest_of(t: torch.Tensor) -> str:
    """BLAKE2b of one tensor's raw bytes (the suite's own digest, independent of wsync's checksum)."""
    if t.numel() == 0:
        data = b""
    else:
        flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().reshape(-1))
        data = flat.view(torch.uint8).numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def payload_digest(payload: torch.Tensor) -> str:
    """SHA-256 of a delivery's payload bytes ("meta" for a tensor without memory behind it)."""
    if not isinstance(payload, torch.Tensor):
        return f"not a tensor: {type(payload).__name__}"
    if payload.device.type == "meta":
        return "meta"
    flat = payload.detach().reshape(-1).cpu().contiguous()
    return hashlib.sha256(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"").hexdigest()


def many_spec(kind: str = "module", total_mib: float = 4.0, count: int = 36) -> ModelSpec:
    """``count`` tensors cycling through every dtype (0-d and empty ones among them), about
    ``total_mib`` MiB in all: a model big enough for zero-copy receivers, with many keys."""
    per = int(total_mib * (1 << 20)) // max(1, count - 4)
    ts = [TensorSpec("scalar.f32", (), "float32"), TensorSpec("scalar.i64", (), "int64", buffer=True),
          TensorSpec("empty.f16", (0, 4), "float16"), TensorSpec("empty.u8", (0,), "uint8", buffer=True)]
    for i in range(count - len(ts)):
        dtype = SPEC_DTYPES[i % len(SPEC_DTYPES)]
        itemsize = DTYPES[dtype].itemsize
        cols = 256 // itemsize if itemsize < 8 else 32
        rows = max(1, per // (cols * itemsize))
        ts.append(TensorSpec(f"layer{i // 6}.t{i}", (rows, cols), dtype, buffer=not trainable(dtype)))
    return ModelSpec(kind, tuple(ts))


#: the models the oracle tests draw from: tiny, every dtype with odd shapes, and >= 4 MiB with many tensors
ORACLE_SIZES: tuple[str, ...] = ("tiny", "rich", "large")


def oracle_spec(size: str, kind: str = "module") -> ModelSpec:
    """A model of one of ``ORACLE_SIZES``."""
    if size == "tiny":
        return ModelSpec(kind, (TensorSpec("w", (3,), "float32"), TensorSpec("b", (), "int8", buffer=True)))
    if size == "rich":
        return rich_spec(kind, 0)
    if size == "large":
        return many_spec(kind, 4.0)
    raise ValueError(f"oracle model size must be one of {ORACLE_SIZES}, got {size!r}")
