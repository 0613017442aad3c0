"""Transcoders' activation functions (circuit-tracer's `transcoder/activation_functions.py`).

"relu"; "topk" (the k largest pre-activations, then ReLU, as Gao et al. 2024 and SAELens; circuit-tracer's
TopK keeps negative ones, which differs only where fewer than k are positive); "jumprelu" (pre · [pre >
threshold], Rajamanoharan et al. 2024, with its straight-through threshold gradient: SAELens's and
circuit-tracer's `JumpReLU`), and the straight-through step a JumpReLU's L0 penalty trains through.
"""

import torch
from torch import Tensor

ACTIVATIONS = ("relu", "topk", "jumprelu")
# JumpReLU's straight-through kernel width (SAELens's default bandwidth).
JUMPRELU_BANDWIDTH = 0.001


def _rectangle(x: Tensor) -> Tensor:
    return ((x > -0.5) & (x < 0.5)).to(x.dtype)


class _JumpReLU(torch.autograd.Function):
    """pre · [pre > threshold]; the threshold's gradient is the straight-through estimate
    -(θ/ε)·rect((pre-θ)/ε) (Rajamanoharan et al. 2024, eq. 11; SAELens's `JumpReLU`), the input's the
    true one (no estimate through the jump)."""

    @staticmethod
    def forward(ctx, pre: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return pre * (pre > threshold).to(pre.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        pre, threshold = ctx.saved_tensors
        bandwidth = ctx.bandwidth
        pre_grad = (pre > threshold).to(grad.dtype) * grad
        threshold_grad = -(threshold / bandwidth) * _rectangle((pre - threshold) / bandwidth) * grad
        return pre_grad, _sum_to(threshold_grad, threshold.shape), None


class _Step(torch.autograd.Function):
    """[pre > threshold], the L0 of a JumpReLU; the threshold's straight-through gradient is
    -(1/ε)·rect((pre-θ)/ε) (Rajamanoharan et al. 2024, eq. 12), the input gets none."""

    @staticmethod
    def forward(ctx, pre: Tensor, threshold: Tensor, bandwidth: float) -> Tensor:
        ctx.save_for_backward(pre, threshold)
        ctx.bandwidth = bandwidth
        return (pre > threshold).to(pre.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        pre, threshold = ctx.saved_tensors
        bandwidth = ctx.bandwidth
        threshold_grad = -(1.0 / bandwidth) * _rectangle((pre - threshold) / bandwidth) * grad
        return torch.zeros_like(pre), _sum_to(threshold_grad, threshold.shape), None


def _sum_to(grad: Tensor, shape: torch.Size) -> Tensor:
    """Sum a broadcast gradient back to the parameter's shape."""
    lead = grad.ndim - len(shape)
    grad = grad.sum(dim=tuple(range(lead))) if lead else grad
    keep = [i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1]
    return grad.sum(dim=keep, keepdim=True) if keep else grad


def jumprelu(pre: Tensor, threshold: Tensor, bandwidth: float = JUMPRELU_BANDWIDTH) -> Tensor:
    """JumpReLU with its straight-through threshold gradient."""
    return _JumpReLU.apply(pre, threshold, bandwidth)


def step(pre: Tensor, threshold: Tensor, bandwidth: float = JUMPRELU_BANDWIDTH) -> Tensor:
    """[pre > threshold] with the straight-through threshold gradient (a JumpReLU's L0 penalty)."""
    return _Step.apply(pre, threshold, bandwidth)


def topk_relu(pre: Tensor, k: int) -> Tensor:
    """The k largest entries of the last axis, through ReLU; the rest zero."""
    values, indices = pre.topk(k, dim=-1)
    return torch.zeros_like(pre).scatter(-1, indices, torch.relu(values))


def check_activation(activation: str, k: int | None, d_transcoder: int) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} must be one of {', '.join(ACTIVATIONS)}")
    if activation == "topk":
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= d_transcoder:
            raise ValueError(f"k={k!r}: a TopK transcoder needs an integer k in [1, d_transcoder={d_transcoder}]")
    elif k is not None:
        raise ValueError(f"k={k!r} is for activation='topk', not {activation!r}")


def check_size(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")

