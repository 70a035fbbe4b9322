"""kernels._common.EagerOp: in plain eager mode an op's body runs without the dispatcher; anything that must see
the op (a dispatch mode such as selective checkpointing's, meta tensors) still gets it, and an in-place op still
bumps its argument's version counter."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kernels._common import EagerOp, eager_op


@eager_op
@torch.library.custom_op("ligermodels_test::scaled", mutates_args=())
def _scaled(x: torch.Tensor, k: float) -> torch.Tensor:
    return x * k


@_scaled.register_fake
def _(x, k):
    return torch.empty_like(x)


@eager_op
@torch.library.custom_op("ligermodels_test::scale_", mutates_args={"x"})
def _scale_(x: torch.Tensor, k: float) -> None:
    x.data.mul_(k)  # as a Triton kernel writes: memory changes, no version bump of its own


class _Spy:
    """Stands in for the registered op, counting calls."""

    def __init__(self, op):
        self.op, self.calls = op, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.op(*args, **kwargs)


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_plain_eager_call_runs_the_body_without_the_registered_op(monkeypatch):
    assert isinstance(_scaled, EagerOp) and callable(_scaled.register_fake)  # the op's attributes pass through
    spy = _Spy(_scaled.op)
    monkeypatch.setattr(_scaled, "op", spy)
    x = torch.randn(3, 5)
    torch.testing.assert_close(_scaled(x, 2.5), x * 2.5)
    assert spy.calls == 0


def test_a_dispatch_mode_sees_the_registered_op():
    x = torch.randn(4)
    with _OpLog() as log:
        out = _scaled(x, 3.0)
    torch.testing.assert_close(out, x * 3.0)
    assert "ligermodels_test.scaled.default" in log.ops


def test_meta_tensors_go_through_the_registered_op():
    out = _scaled(torch.empty(2, 7, device="meta"), 2.0)
    assert out.device.type == "meta" and out.shape == (2, 7)


def test_in_place_op_bumps_the_version_counter_as_the_dispatcher_does():
    direct, dispatched = torch.ones(6), torch.ones(6)
    before = direct._version
    _scale_(direct, 2.0)
    torch.ops.ligermodels_test.scale_(dispatched, 2.0)
    assert torch.equal(direct, dispatched)
    assert direct._version - before == dispatched._version - before > 0
    _scale_(x=direct, k=0.5)  # by keyword too
    assert direct._version - before == 2 * (dispatched._version - before)
