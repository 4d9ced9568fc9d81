"""exact: the receiver's model equals the sender's snapshot bit for bit (every dtype, shape, container)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from hypothesis import given, strategies as st
from wsync_core import WorkerTimeoutError

from .. import profiles
from ..context import Context
from ..guarantees import capability, guarantee, violated
from ..models import KINDS, ModelSpec, TensorSpec, many_spec, random_values, rich_spec
from ..strategies import model_specs, seeds, value_styles
from .base import thorough

__all__ = ["ExactChecks"]


class ExactChecks:
    """The exact tests (a mixin of ``TransportSuite``)."""

    large_mib: ClassVar[int]  # (SuiteBase's, in TransportSuite)

    @guarantee("exact")
    @pytest.mark.parametrize("kind", KINDS)
    def test_exact_every_dtype_and_shape(self, wsync: Context, kind: str) -> None:
        """Random bits, extremes, 0-d, empty, large, transposed/strided/shared/tied sources,
        parameters and buffers, as a module, TensorDict and state_dict: equal bit for bit."""
        s = wsync.session(rich_spec(kind, self.large_mib))
        s.check(0)

        @profiles.scaled(0.6)
        @given(seed=seeds(), styles=value_styles(s.spec))
        def run(seed: int, styles: dict[str, str]) -> None:
            s.fill(random_values(s.spec, seed, styles))
            s.check(s.send())

        run()

    @guarantee("exact")
    def test_exact_drawn_structures(self, wsync: Context) -> None:
        """Hypothesis-drawn nested structures (kinds, dtypes, shapes, sources, ties)."""
        workers = wsync.workers(2)

        @profiles.scaled(0.5 if wsync.process else 1.5, at_least=2)
        @given(spec=model_specs(large=True), seed=seeds(), styles=st.data())
        def run(spec: ModelSpec, seed: int, styles) -> None:
            s = wsync.session(spec, workers=workers, connect=False)
            try:
                s.fill(random_values(spec, seed ^ 1))
                s.connect()
                s.check(0)
                s.fill(random_values(spec, seed, styles.draw(value_styles(spec))))
                s.check(s.send())
            finally:
                s.close()

        run()

    @guarantee("exact")
    def test_exact_send_weights_views(self, wsync: Context) -> None:
        """``send(weights=...)`` of transposed views and slices of one storage arrives exactly."""
        spec = ModelSpec("state_dict", (TensorSpec("a", (6, 4), "float32"), TensorSpec("b", (4, 6), "bfloat16"),
                                        TensorSpec("c", (5,), "int64"), TensorSpec("d", (5,), "int64")))
        s = wsync.session(spec)
        storage = torch.arange(100, dtype=torch.int64)
        weights = {"a": torch.randn(4, 6).t(), "b": torch.randn(6, 4).to(torch.bfloat16).t(),
                   "c": storage[10:15], "d": storage[::20]}
        assert not weights["a"].is_contiguous() and not weights["d"].is_contiguous()
        s.check(s.send(weights=weights))

    @guarantee("exact")
    def test_exact_empty_model(self, wsync: Context) -> None:
        """A model whose every tensor has no element (a (0, 3) parameter and an empty buffer: a
        payload of 0 bytes) connects, and sends to everyone and to one worker return, acked by
        their targets, each worker holding exactly its version (an endpoint must deliver an empty
        payload as a delivery, never take it for nothing received)."""
        spec = ModelSpec("module", (TensorSpec("w", (0, 3), "float32"), TensorSpec("b", (0,), "int64", buffer=True)))
        s = wsync.session(spec, connect=False)
        try:
            s.connect()
            s.check(0)
            s.check(s.send())
            if wsync.caps.subset_send:
                s.check(s.send(worker_ids=[1]), [1])
            s.check(s.send())
        except WorkerTimeoutError as exc:
            raise violated("exact", f"a model whose every tensor is empty (a payload of 0 bytes): {exc} (a "
                                    f"receiver endpoint must deliver an empty payload, not take it for nothing "
                                    f"received)") from exc

    @guarantee("exact")
    def test_exact_many_tensors(self, wsync: Context) -> None:
        """A model of 4,608 small tensors named as a compiled, FSDP-wrapped mixture-of-experts
        model's are (a state_dict): a worker's first delivery carries the whole layout, a header
        of about 0.7 MiB (an endpoint carries headers up to ``MAX_HEADER_BYTES``, whole); every
        worker connects and each send arrives exactly."""
        keys = [f"_orig_mod.module._fsdp_wrapped_module.model.language_model.layers.{layer}."
                f"_checkpoint_wrapped_module.mlp.experts.{expert}.{part}_proj.weight"
                for layer in range(24) for expert in range(64) for part in ("gate", "up", "down")]
        spec = ModelSpec("state_dict", tuple(TensorSpec(k, (2,), "float32") for k in keys))
        s = wsync.session(spec, n=2, connect=False)
        try:
            s.connect()
            s.check(0)
            s.fill(random_values(s.spec, 1))
            s.check(s.send())
        except WorkerTimeoutError as exc:
            raise violated("exact", f"a model of {len(keys)} tensors (a first header of about 0.7 MiB): {exc} (an "
                                    f"endpoint must carry headers up to MAX_HEADER_BYTES, whole)") from exc

    @guarantee("exact")
    def test_exact_after_worker_writes(self, wsync: Context) -> None:
        """Workers write all of their model (a state_dict over the zero-copy threshold) after each
        receive, while part of the trainer's model never changes (a frozen layer): each full
        version still arrives exactly, through more versions than a transport has buffers (memory
        a zero-copy worker wrote must be delivered whole again, not only where versions differ)."""
        s = wsync.session(many_spec("state_dict", 2.0, count=12), n=2)
        frozen = random_values(s.spec, 77)
        keys = sorted(frozen)[::2]
        for step in range(1, 9):
            values = random_values(s.spec, 7000 + step)
            values.update((k, frozen[k]) for k in keys)
            s.fill(values)
            s.send()
            for w in s.workers:
                w.request("fill", seed=9000 + step).raise_for_error("the worker writing its model")

    @guarantee("exact")
    @capability("cuda")
    def test_exact_cpu_sender_cuda_receivers(self, wsync: Context) -> None:
        """A CPU trainer syncing CUDA receivers (only with --wsync-device cuda)."""
        if wsync.device != "cuda":
            pytest.skip("only with --wsync-device cuda (CPU sender, CUDA receivers)")
        wsync.sender_device = "cpu"
        s = wsync.session(rich_spec("module", 1), receiver_device="cuda")
        s.fill(random_values(s.spec, 7))
        s.check(s.send())

    @guarantee("exact")
    @thorough()
    def test_exact_large_model(self, wsync: Context) -> None:
        """(--thorough) A 64 MiB model of 200 tensors in every dtype, three versions: exact each time."""
        s = wsync.session(many_spec("module", 64.0, count=200), n=2)
        for seed in range(3):
            s.fill(random_values(s.spec, 4000 + seed))
            s.send()
