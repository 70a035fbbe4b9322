"""Helpers shared by the tests: the device under test, relative error and its per-dtype bounds."""

from __future__ import annotations

import torch

import kernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

#: Bound on ||out - ref|| / ||ref|| against a float64 reference, by the dtype the op ran in.
BOUNDS = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out holds a NaN or inf."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if not torch.isfinite(out).all():
        return float("inf")
    denom = ref.norm().item()
    return (out - ref).norm().item() / (denom if denom > 0 else 1.0)


def assert_rel(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str, bound: float | None = None):
    """Assert the relative error of ``out`` against the float64 ``ref`` is within the dtype's bound."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    err = rel_err(out, ref)
    bound = BOUNDS[dtype] if bound is None else bound
    assert err <= bound, f"{what}: relative error {err:.3e} > {bound:.1e} ({dtype})"
    return err


def assert_triton_runs(x: torch.Tensor) -> None:
    """Guard against a test silently exercising the PyTorch fallback instead of the kernels."""
    assert kernels.use_triton(x), "the Triton path is off: set TRITON_INTERPRET=1 on CPU"


def randn(*shape, dtype=torch.float32, scale: float = 1.0, seed: int | None = None) -> torch.Tensor:
    """Fresh random normal tensor on the device under test."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(DEVICE)


def snapshot(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copies of tensors, to check later that an op did not modify its inputs."""
    return [t.detach().clone() for t in tensors]


def assert_unchanged(before: list[torch.Tensor], *after: torch.Tensor) -> None:
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        assert torch.equal(b, a.detach()), f"input {i} was modified in place"
