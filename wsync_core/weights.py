"""Weight extraction and application: modules, TensorDicts and state_dicts as flat key -> tensor maps.

Two strategies, as in TorchRL:

- ``"tensordict"``: a module's parameters and *all* its buffers (what ``TensorDict.from_module``
  holds), keys joined with ``"."``;
- ``"state_dict"``: what ``module.state_dict()`` holds (persistent buffers only).

A TensorDict or a state_dict given directly is taken as it is, whatever the strategy.
"""

from __future__ import annotations

import numbers
import sys
import warnings
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, Literal, Union

import torch
from torch import nn

from .layout import clip_keys

if TYPE_CHECKING:  # not imported at run time: importing tensordict costs a worker seconds (torch._dynamo)
    from tensordict import TensorDictBase

__all__ = ["Strategy", "Weights", "STRATEGIES", "is_tensordict", "flatten", "check_strategy", "meta_keys",
           "stranded_meta", "materialize", "check_holds_writes", "unwrap",
           "restore_extra_state", "EXTRA_STATE", "device_of", "warn_unsent"]

#: the key suffix of a module's extra state (``get_extra_state()``), as in its state_dict
EXTRA_STATE = "_extra_state"

Strategy = Literal["tensordict", "state_dict"]
Weights = Union[nn.Module, "TensorDictBase", Mapping[str, torch.Tensor]]
STRATEGIES: tuple[str, ...] = ("tensordict", "state_dict")


def is_tensordict(obj: Any) -> bool:
    """Whether ``obj`` is a TensorDict, without importing tensordict (whoever made one did)."""
    base = getattr(sys.modules.get("tensordict"), "TensorDictBase", None)
    return base is not None and isinstance(obj, base)


def check_strategy(strategy: str) -> Strategy:
    """Return ``strategy`` if it is known; raise ValueError naming the known ones otherwise."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    return strategy  # type: ignore[return-value]


def flatten(weights: Any, strategy: Strategy = "tensordict", *, detach: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of ``weights`` by dotted key, aliasing the originals (no copy): detached
    aliases, or with ``detach=False`` the original tensor objects (a receiver swaps their storage).

    Raises TypeError if ``weights`` is not a module, a TensorDict or a mapping of tensors.
    """
    if isinstance(weights, nn.Module):
        weights = unwrap(weights)
        extras: list[tuple[str, nn.Module]] = []
        if strategy == "state_dict":
            items = [(k, v) for k, v in weights.state_dict(keep_vars=True).items() if not k.endswith(EXTRA_STATE)]
            extras = _extra_state_modules(weights)
        else:
            items = _module_tensors(weights, extras)
        if detach:
            try:
                out = {k: v.detach() for k, v in items if v is not None}
            except ValueError:  # torch's word for a lazy module's parameter: say which, and what to do
                _refuse_uninitialized(items)
                raise
        else:
            out = {k: v for k, v in items if v is not None}
        for prefix, module in extras:
            for key, value in _extra_state_tensors(module, prefix).items():
                out[key] = value
        return out
    if is_tensordict(weights):
        out = {}
        try:
            for key, value in weights.items(include_nested=True, leaves_only=True):
                name = key if isinstance(key, str) else ".".join(key)
                if not isinstance(value, torch.Tensor):
                    raise TypeError(f"TensorDict entry {name!r} is a {type(value).__name__}, expected a tensor")
                if name in out:
                    raise TypeError(_collision(name, key))
                out[name] = _maybe_detach(value, detach)
        except RuntimeError as exc:  # a lazy stack of entries that do not stack (other shapes)
            raise TypeError(f"the TensorDict's entries cannot be read as tensors: {exc}") from exc
        return out
    if isinstance(weights, Mapping):
        out = {}
        for key, value in weights.items():
            if not isinstance(key, str):
                raise TypeError(f"state_dict keys must be strings, got {key!r}")
            if isinstance(value, Mapping) or is_tensordict(value):
                for sub, tensor in flatten(value, strategy, detach=detach).items():
                    name = f"{key}.{sub}"
                    if name in out:
                        raise TypeError(_collision(name, (key, sub)))
                    out[name] = tensor
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"state_dict entry {key!r} is a {type(value).__name__}, expected a tensor")
            if key in out:
                raise TypeError(_collision(key, key))
            out[key] = _maybe_detach(value, detach)
        return out
    raise TypeError(
        f"weights must be an nn.Module, a TensorDict or a state_dict (mapping of str to tensor), "
        f"got {type(weights).__name__}"
    )


def unwrap(weights: Any) -> Any:
    """The module a ``torch.compile`` wrapper runs (its ``_orig_mod``; ``weights`` itself for anything
    else): a compiled worker or trainer holds the same tensors under the same keys as a plain one."""
    while type(weights).__name__ == "OptimizedModule" and isinstance(getattr(weights, "_orig_mod", None), nn.Module):
        weights = weights._orig_mod
    return weights


def _collision(name: str, where: Any) -> str:
    """What to say of two entries that are one key once nested keys are joined with ``.``."""
    return (f"two entries of the weights are both named {name!r} once nested keys are joined with '.' (the "
            f"second: {where!r}): one of them would never be sent or received; rename one of them")


def _refuse_uninitialized(items: list[tuple[str, torch.Tensor | None]]) -> None:
    """Raise TypeError naming the parameters and buffers a lazy module has not made yet, if any."""
    # (torch's parameter.pyi leaves UninitializedTensorMixin out)
    lazy = [k for k, v in items if isinstance(v, nn.parameter.UninitializedTensorMixin)]  # type: ignore[attr-defined]
    if lazy:
        raise TypeError(f"{clip_keys(lazy)} of the model are not initialized yet (a lazy module such as nn.LazyLinear "
                        f"has no shape until its first forward pass): run one forward pass on a sample input, "
                        f"or build the module with its sizes, before giving it to wsync")


def check_holds_writes(weights: Any) -> None:
    """Raise TypeError if ``weights`` cannot hold what is written into it: a lazily stacked
    TensorDict (at its root or under a key) stacks its entries anew on every read, so a write to
    what it hands out lands in a copy and the model never changes; meta tensors (given memory by
    the first payload, ``materialize``) in a locked TensorDict or a read-only mapping."""
    frozen = _frozen_with_meta(weights)
    if frozen is not None:
        where, fix = frozen
        raise TypeError(f"{where} holds tensors on the meta device, which get memory from the first version by "
                        f"replacing its entries, and it takes no new entries: {fix}, or build the tensors on a "
                        f"real device")
    if not is_tensordict(weights):
        return
    lazy = [""] if weights._lazy else []
    lazy += [key if isinstance(key, str) else ".".join(key)
             for key, value in weights.items(include_nested=True) if is_tensordict(value) and value._lazy]
    if lazy:
        where = "the model" if lazy == [""] else "the model's entry " + ", ".join(repr(k) for k in lazy if k)
        raise TypeError(f"{where} is a LazyStackedTensorDict: its entries are stacked anew on every read, so "
                        f"received weights would land in copies; give the worker a dense TensorDict "
                        f"(e.g. its .contiguous()) to receive into")


def _frozen_with_meta(weights: Any, where: str = "the model") -> tuple[str, str] | None:
    """Where ``weights`` (a TensorDict or a mapping, nested) holds meta tensors in a container that
    takes no new entries (a locked TensorDict, a read-only mapping), and what to do: or None."""
    if is_tensordict(weights):
        if weights.is_locked and any(isinstance(t, torch.Tensor) and t.is_meta
                                     for t in weights.values(include_nested=True, leaves_only=True)):
            return f"{where} (a locked TensorDict)", "unlock it (unlock_())"
        return None
    if isinstance(weights, nn.Module) or not isinstance(weights, Mapping):
        return None
    for key, value in weights.items():
        if isinstance(value, torch.Tensor) and value.is_meta and not isinstance(weights, MutableMapping):
            return f"{where} (a {type(weights).__name__}, read-only)", "pass a dict"
        if isinstance(value, Mapping) or is_tensordict(value):
            inner = _frozen_with_meta(value, f"the model's entry {key!r}")
            if inner is not None:
                return inner
    return None


def _maybe_detach(t: torch.Tensor, detach: bool) -> torch.Tensor:
    return t.detach() if detach else t


def _module_tensors(module: nn.Module, extras: list[tuple[str, nn.Module]] | None = None,
                   ) -> list[tuple[str, torch.Tensor | None]]:
    """What ``named_parameters`` and ``named_buffers`` with ``remove_duplicate=False`` list (a
    tensor shared by two modules under both names), read straight from the module tree: a
    third of the cost, which counts for small models synced thousands of times a second."""
    items: list[tuple[str, torch.Tensor | None]] = []
    buffers: list[tuple[str, torch.Tensor | None]] = []
    stack = [("", module)]
    while stack:
        prefix, m = stack.pop()
        if m._parameters:  # (empty tables are common: skipping them saves a comprehension each)
            items += [(prefix + k, v) for k, v in m._parameters.items()]
        if extras is not None and type(m).get_extra_state is not nn.Module.get_extra_state:
            extras.append((prefix, m))  # modules with extra state, for the caller
        if m._buffers:
            buffers += [(prefix + k, v) for k, v in m._buffers.items()]
        if m._modules:
            stack += [(f"{prefix}{k}.", sub) for k, sub in reversed(m._modules.items()) if sub is not None]
    return items + buffers


def _extra_state_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Submodules (with their key prefix) that define ``get_extra_state``."""
    return [(f"{name}." if name else "", m) for name, m in module.named_modules()
            if type(m).get_extra_state is not nn.Module.get_extra_state]


def _extra_state_tensors(module: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """A module's extra state as tensors: a tensor, or a mapping of tensors and numbers (a
    number becomes a 0-d int64, float64 or bool tensor). Raises TypeError for anything else:
    wsync never pickles."""
    state = module.get_extra_state()
    base = prefix + EXTRA_STATE
    if state is None:
        return {}
    if isinstance(state, torch.Tensor):
        return {base: state.detach()}
    if is_tensordict(state):
        state = state.flatten_keys(".").to_dict()
    if not isinstance(state, Mapping):
        raise TypeError(f"{base}: extra state of {type(module).__name__} is a {type(state).__name__}; wsync "
                        f"carries extra state that is a tensor or a mapping of tensors and numbers (never pickled)")
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            out[f"{base}.{key}"] = value.detach()
        elif isinstance(value, bool):
            out[f"{base}.{key}"] = torch.tensor(value, dtype=torch.bool)
        elif isinstance(value, numbers.Integral):  # numpy's integers and IntEnum members too
            number = int(value)
            if not _INT64_MIN <= number <= _INT64_MAX:
                raise ValueError(f"{base}.{key}: extra state entry {number} does not fit in a 64-bit integer, "
                                 f"which is how wsync carries an integer")
            out[f"{base}.{key}"] = torch.tensor(number, dtype=torch.int64)
        elif isinstance(value, numbers.Real):  # numpy's floats too
            out[f"{base}.{key}"] = torch.tensor(float(value), dtype=torch.float64)
        else:
            raise TypeError(f"{base}.{key}: extra state entry is a {type(value).__name__}; wsync carries "
                            f"tensors and numbers (never pickled)")
    return out


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def restore_extra_state(weights: Any, targets: Mapping[str, torch.Tensor]) -> None:
    """Hand each module of ``weights`` that has extra state the values now in ``targets`` (the
    tensors ``flatten`` returned and a version was written into), through ``set_extra_state``:
    private copies, numbers back as numbers. A no-op for anything but a module."""
    if not isinstance(weights, nn.Module) or not any(EXTRA_STATE in k for k in targets):
        return
    for prefix, module in _extra_state_modules(weights):
        base = prefix + EXTRA_STATE
        if base in targets:
            module.set_extra_state(targets[base].clone())
            continue
        before = module.get_extra_state()
        if is_tensordict(before):
            before = before.flatten_keys(".").to_dict()
        if not isinstance(before, Mapping) or not before:
            continue
        state = {}
        for key, old in before.items():
            value = targets[f"{base}.{key}"]
            state[key] = value.clone() if isinstance(old, torch.Tensor) else type(old)(value.item())
        module.set_extra_state(state)


def device_of(tensors: Mapping[str, torch.Tensor]) -> torch.device:
    """The device of the first tensor (the CPU for none)."""
    for t in tensors.values():
        return t.device
    return torch.device("cpu")


def warn_unsent(weights: Any, tensors: Mapping[str, torch.Tensor], call: str) -> None:
    """Warn (UserWarning, pointing at the user's ``call``) where ``weights`` keeps weights that no
    version carries: a module's submodules or parameters held in a plain list, tuple or dict
    (PyTorch registers neither, so trainer and workers keep their own values of them), or no
    tensors at all (every version then carries nothing)."""
    plain = _unregistered(weights) if isinstance(weights, nn.Module) else []
    if plain:
        warnings.warn(f"{call}: the model keeps modules or parameters in plain containers, which PyTorch does not "
                      f"register: {clip_keys(plain)}; their weights are in no state_dict and no version carries "
                      f"them (the workers keep their own values). Use nn.ModuleList, nn.ModuleDict or "
                      f"nn.ParameterList", UserWarning, stacklevel=4)
    elif not tensors:
        warnings.warn(f"{call}: the model has no tensors: every version will carry nothing", UserWarning, stacklevel=4)


_MODULE_ATTRIBUTES = frozenset(vars(nn.Module()))


def _unregistered(module: nn.Module) -> list[str]:
    """Dotted names of the attributes of ``module`` and its submodules that are plain lists,
    tuples or dicts holding modules or parameters the module tree does not hold (a list of its
    own layers, kept for convenience, is fine)."""
    modules = dict(module.named_modules(remove_duplicate=True))
    held = {id(m) for m in modules.values()} | {id(p) for p in module.parameters()}
    found = []
    for prefix, m in modules.items():
        for attr, value in vars(m).items():
            if attr in _MODULE_ATTRIBUTES or not isinstance(value, (list, tuple, dict)):
                continue
            items = value.values() if isinstance(value, dict) else value
            if any(isinstance(v, (nn.Module, nn.Parameter)) and id(v) not in held for v in items):
                found.append(f"{prefix}.{attr}" if prefix else attr)
    return found


def meta_keys(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The keys of ``tensors`` on the meta device (shape and dtype, no data)."""
    return [k for k, t in tensors.items() if t.is_meta]


def stranded_meta(weights: Any, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The parameters and buffers of a module ``weights`` on the meta device that are not among
    the ``tensors`` that travel (``flatten``'s keys: a buffer outside the state_dict, with strategy
    "state_dict"): no version would give them values. Empty for other containers."""
    if not isinstance(weights, nn.Module):
        return []
    named = [*weights.named_parameters(remove_duplicate=False), *weights.named_buffers(remove_duplicate=False)]
    return [name for name, t in named if t.is_meta and name not in tensors]


def materialize(weights: Any, device: torch.device) -> None:
    """Give every meta-device tensor of ``weights`` real, uninitialized memory on ``device``, in the
    container the user holds: a module's parameters and buffers (a parameter shared by two modules
    stays shared), a state_dict's entries, a TensorDict's leaves. The caller fills them at once.

    Raises TypeError for a container whose entries cannot be replaced (a read-only mapping).
    """
    made: dict[int, torch.Tensor] = {}

    def real(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            if isinstance(t, nn.Parameter):
                new = nn.Parameter(new, requires_grad=t.requires_grad)
            made[id(t)] = new
        return made[id(t)]

    if isinstance(weights, nn.Module):
        for m in weights.modules():
            tables: tuple[dict[str, Any], ...] = (m._parameters, m._buffers)  # (real() keeps a Parameter one)
            for table in tables:
                for name, t in table.items():
                    if t is not None and t.is_meta:
                        table[name] = real(t)
    elif is_tensordict(weights):
        if weights.device is not None and weights.device.type == "meta":
            weights.clear_device_()
        for key, t in list(weights.items(include_nested=True, leaves_only=True)):
            if isinstance(t, torch.Tensor) and t.is_meta:
                weights.set(key, real(t))
    elif isinstance(weights, Mapping):
        if not isinstance(weights, MutableMapping):
            raise TypeError(f"a {type(weights).__name__} of meta tensors cannot be filled in place: pass a dict")
        for key, value in list(weights.items()):
            if isinstance(value, Mapping) or is_tensordict(value):
                materialize(value, device)
            elif isinstance(value, torch.Tensor) and value.is_meta:
                weights[key] = real(value)
