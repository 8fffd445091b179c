"""Linear layers on the CPU through oneDNN: the same float32 arithmetic, faster on AMD CPUs (where MKL runs
AVX2 kernels), per shape class only where :mod:`easyvlm.models.kernel_choice` measured it faster.
``EASYVLM_CPU_LINEAR``: ``auto``, ``onednn`` or ``aten``. docs/architecture.md, "Set-up decisions"."""

from __future__ import annotations

import os
import platform
import time

import torch
import torch.nn.functional as F
from torch import nn

from easyvlm.models.kernel_choice import KERNELS, KernelChooser, ShapeClass, default_cache_file, machine_key, shape_class

ENV_SWITCH = "EASYVLM_CPU_LINEAR"  # "auto" (the default: measured), "onednn" or "aten"
CHOICES = ("auto", "onednn", "aten")
# Below this many multiply-adds (rows x in_features x out_features) a call stays with F.linear: oneDNN's
# fixed cost per call (~50 us here) outweighs its faster kernel (bench/cpu_matmul.py: at 256 x 64 x 64
# oneDNN's forward + backward took 1.5x as long as F.linear's; from ~2^23 on it is 1.4-2.1x faster).
MIN_ONEDNN_MACS = 2**23

# oneDNN keeps every primitive it made (one per shape) in two caches of 1024 entries, and a training
# step makes new ones each micro-batch (its token count varies): +0.3-0.4 GiB at the bench run's peak.
# 32 holds one micro-batch's shapes (~25: forward and backward of each linear type), so the update
# runs as fast (docs/benchmarks.md, "The update's matrix products"). Read once, when a process makes its
# first primitive: set here, at import, before any model runs; a value set by the user is kept.
PRIMITIVE_CACHE_CAPACITY = "32"
for _variable in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):  # oneDNN's, and torch's ideep's
    os.environ.setdefault(_variable, PRIMITIVE_CACHE_CAPACITY)


def linear_mode() -> str:
    """``EASYVLM_CPU_LINEAR``, checked: auto, onednn or aten."""
    mode = os.environ.get(ENV_SWITCH, "auto")
    if mode not in CHOICES:
        raise ValueError(f"{ENV_SWITCH}={mode!r}: use 'auto' (the default: the faster kernel per shape, timed on this "
                         "machine), 'onednn' (oneDNN always) or 'aten' (torch's F.linear always)")
    return mode


def onednn_linear_available() -> bool:
    """Whether this process's CPU linears may use oneDNN: x86-64, torch built with it, not turned off."""
    return linear_mode() != "aten" and platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()


def onednn_mm_t(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b.T (+ bias)`` for 2-D float32 CPU tensors, through oneDNN (strided operands are accepted)."""
    return torch.ops.mkldnn._linear_pointwise(a, b, bias, "none", [], "")


class _OneDNNLinearFunction(torch.autograd.Function):
    """y = x W^T + b, with dy/dx = g W and dy/dW = g^T x computed by oneDNN too."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        y = onednn_mm_t(x2, weight, bias)
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        # not a view of the 2-D product (as matmul's own result): FSDP2 warns about view outputs, whose
        # in-place changes would skip its backward hook
        return torch.ops.aten._unsafe_view(y, (*x.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.ops.aten._unsafe_view(onednn_mm_t(g2, weight.t()), x.shape)  # g W
        if ctx.needs_input_grad[1]:
            grad_w = onednn_mm_t(g2.t(), x.reshape(-1, x.shape[-1]).t())  # g^T x
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2.sum(0)
        return grad_x, grad_w, grad_b


def time_kernels(shape: ShapeClass, rounds: int = 3) -> dict[str, float]:
    """Seconds per call of each kernel on ``shape`` (forward, plus the backward products for a
    training class), the fastest of ``rounds`` alternated calls after a warm-up. No autograd: under
    gradient checkpointing a nested backward would recompute the layer and deadlock the chooser."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(shape.rows, shape.in_features, generator=generator)
    weight = torch.randn(shape.out_features, shape.in_features, generator=generator) * shape.in_features**-0.5
    grad = torch.randn(shape.rows, shape.out_features, generator=generator)

    def onednn() -> None:
        onednn_mm_t(x, weight)  # y = x W^T
        if shape.backward:  # _OneDNNLinearFunction.backward's two products
            onednn_mm_t(grad, weight.t())  # g W
            onednn_mm_t(grad.t(), x.t())  # g^T x

    def aten() -> None:
        F.linear(x, weight)
        if shape.backward:  # F.linear's autograd: two matrix products
            torch.mm(grad, weight)
            torch.mm(grad.t(), x)

    kernels = {"onednn": onednn, "aten": aten}

    def once(kernel) -> float:
        start = time.perf_counter()
        kernel()
        return time.perf_counter() - start

    samples: dict[str, list[float]] = {name: [] for name in KERNELS}
    with torch.no_grad():
        for name in KERNELS:
            once(kernels[name])
        for _ in range(rounds):
            for name in KERNELS:
                samples[name].append(once(kernels[name]))
    return {name: min(values) for name, values in samples.items()}


_choosers: dict[int, KernelChooser] = {}  # by torch's thread count: the timings depend on it


def chooser() -> KernelChooser:
    """This process's kernel chooser for its current thread count (made on first use)."""
    threads = torch.get_num_threads()
    found = _choosers.get(threads)
    if found is None:
        machine = machine_key()
        found = _choosers[threads] = KernelChooser(time_kernels, machine, default_cache_file(machine))
    return found


def _takes_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    plain = type(x) is torch.Tensor and type(weight) in (torch.Tensor, nn.Parameter)
    if not (plain and x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32):
        return False
    if x.numel() * weight.shape[0] < MIN_ONEDNN_MACS:  # rows x in_features x out_features
        return False
    if torch.compiler.is_compiling() or linear_mode() == "onednn":  # a compiled graph keeps the size rule alone
        return True
    backward = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    rows = x.numel() // x.shape[-1]
    return chooser().kernel(shape_class(rows, x.shape[-1], weight.shape[0], backward)) == "onednn"


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through oneDNN for plain float32 CPU tensors."""
    if _takes_onednn(x, weight) and (bias is None or type(bias) in (torch.Tensor, nn.Parameter)):
        return _OneDNNLinearFunction.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is :func:`onednn_linear`; same parameters, same state dict."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.weight, self.bias)


def use_onednn_linears(model: nn.Module) -> int:
    """Make every plain ``nn.Linear`` of ``model`` a :class:`OneDNNLinear` in place; returns how many."""
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear:  # subclasses (e.g. quantized or PEFT layers) keep their own forward
            module.__class__ = OneDNNLinear
            changed += 1
    return changed
