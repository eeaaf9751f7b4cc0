"""A perturbed linear layer of a half-precision model in the model's own precision.

At a point ``P`` (float32) of a weight the model holds as ``W`` (half precision), the
layer computes ``x P = x W + x D`` with ``D = P - W`` (for a geodesic step, the point
minus the weight: ``xi - Gamma(xi, xi) / 2``), ``D`` split into half-precision parts

.. math::

    D \\approx \\sum_k 2^{-e_k} D_k, \\quad D_k = \\mathrm{half}(2^{e_k} r_k), \\quad
    r_0 = D, \\quad r_{k+1} = r_k - 2^{-e_k} D_k,

``2^{e_k}`` the power of two that brings ``max |r_k|`` into the binade of ``max |W|``
for float16 (exact; the parts' products as large as the weight's, within its range),
1 for bfloat16 (float32's range). Each product takes half-precision operands,
accumulates in float32 and returns float32 (``torch.mm(..., out_dtype=torch.float32)``);
the sum is float32, rounded once by the owner's output. Backward: ``dL/dP = x^T g``, a
training step's weight gradient; ``dL/dx = g W^T + g (2^{-e_0} D_0)^T``, two products.
No float32 copy of the weight is kept, and no float32 product is taken over it: the
multiplies run at the half-precision rate.

Where the model holds no whole weight (a sharded model, whose owners compute on the
point gathered from its slices), ``W`` is the point rounded to half precision: ``P = W
+ D`` all the same, ``|D| <= 2^-8 |P|`` entrywise (bfloat16's rounding) carried by
the parts to under float32's resolution of ``P``, and at the unperturbed point ``W``
is the model's weight and ``D = 0``.

Two parts carry 16 (bfloat16) or 22 (float16) bits of ``D``: its error is below
``2^-17 |D|``, under float32's resolution of ``P`` wherever the perturbation is
under ``2^-7`` of the weight, and far under the half-precision rounding of the
layer's output everywhere.

A measure splits where the device has such a kernel (CUDA): :func:`wanted`. Where it
has none (this torch's CPU) a product would return in half precision: the weight's
product with its bias is then the model's own layer, rounded once, the perturbation's
products are rounded relative to themselves, and the point's gradient is as precise as
a training step's; and at a few hundred tokens the passes over the weight that the
split makes cost more than the float32 products they replace. There the perturbed
layers keep their float32 products unless ``ENABLED = True`` (the tests, benchmarks).

>>> import torch
>>> w = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).bfloat16()
>>> p = w.float() + 1e-3 * torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
>>> parts = split(p - w.float(), torch.bfloat16, w)
>>> [part.dtype for part, _ in parts]
[torch.bfloat16, torch.bfloat16]
>>> approx = sum(part.float() * (1 if scale is None else scale) for part, scale in parts)
>>> bool((approx - (p - w.float())).abs().max() < 2**-16 * (p - w.float()).abs().max())
True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["ENABLED", "PARTS", "SplitLinears", "mm32", "split", "split_product", "wanted"]

PARTS = 2  # half-precision parts of the perturbation
ENABLED: bool | None = None  # None: where the device has the kernel; True/False: always/never
_OUT_DTYPE: dict[tuple[str, torch.dtype], bool] = {}  # (device type, dtype): has the kernel


def _has_mm32(a: Tensor) -> bool:
    """Whether ``a``'s device multiplies its dtype into float32 (tried once)."""
    key = (a.device.type, a.dtype)
    if key not in _OUT_DTYPE:
        probe = torch.zeros(1, 1, dtype=a.dtype, device=a.device)
        try:
            torch.mm(probe, probe, out_dtype=torch.float32)
            _OUT_DTYPE[key] = True
        except (RuntimeError, NotImplementedError, TypeError):
            _OUT_DTYPE[key] = False
    return _OUT_DTYPE[key]


def wanted(t: Tensor) -> bool:
    """Whether a measure splits the products with the half-precision weight ``t``:
    :data:`ENABLED` if set, else whether its device multiplies into float32."""
    return _has_mm32(t) if ENABLED is None else ENABLED


def mm32(a: Tensor, b: Tensor, bias: Tensor | None = None) -> Tensor:
    """``a @ b (+ bias)`` of half-precision operands, accumulated in float32 and
    returned in float32 where the device has the kernel; else the half-precision
    product (the bias added in it, rounded once, as the model's own layer computes)
    widened."""
    if _has_mm32(a):
        out = torch.mm(a, b, out_dtype=torch.float32)
        return out if bias is None else out.add_(bias)
    out = torch.mm(a, b) if bias is None else torch.addmm(bias, a, b)
    return out.float()


def _exponent(t: Tensor) -> Tensor:
    """The binary exponent of ``max |t|`` (of 1 where ``t`` is 0), a 0-d tensor."""
    top = t.abs().amax().float()
    return torch.frexp(torch.where(top > 0, top, torch.ones_like(top))).exponent


def split(
    d: Tensor,
    half: torch.dtype,
    like: Tensor | None = None,
    parts: int = PARTS,
    scratch: bool = False,
) -> list[tuple[Tensor, Tensor | None]]:
    """``d`` (float32) as ``[(D_k, 2^-e_k)]``: half-precision parts and their exact
    power-of-two scales (0-d float32 tensors; no host synchronisation). Float16's parts
    are scaled into the binade of ``max |like|`` (of 1 without); bfloat16 has float32's
    range and needs no scale (``None``). ``scratch``: ``d`` may be written over."""
    if half == torch.bfloat16:
        out, rest = [], d if scratch else d.clone()
        for k in range(parts):
            out.append((rest.to(half), None))
            if k + 1 < parts:
                rest.sub_(out[-1][0])
        return out
    out, rest = [], d
    target = torch.ones((), dtype=torch.int32, device=d.device) if like is None else _exponent(like)
    for k in range(parts):
        scale = torch.ldexp(torch.ones((), device=d.device), _exponent(rest) - target)
        part = (rest / scale).to(half)
        out.append((part, scale))
        if k + 1 < parts:
            rest = rest - part.float() * scale
    return out


def _scaled(y: Tensor, scale: Tensor | None) -> Tensor:
    return y if scale is None else y.mul_(scale)


class _SplitProduct(torch.autograd.Function):
    """``x @ P + c`` at the point ``P`` of a weight held as ``B`` (``x``, ``B`` and the
    constant ``c`` half precision, ``P`` float32, ``B`` and ``P`` of shape ``(in,
    out)``; ``B = None``: ``P`` rounded to half precision, :func:`_held`); float32 out."""

    @staticmethod
    def forward(ctx, x: Tensor, base: Tensor | None, point: Tensor, bias: Tensor | None) -> Tensor:
        held = _held(base, point, x.dtype)
        y = mm32(x, held, bias)
        for part, scale in _parts(held, point):
            y.add_(_scaled(mm32(x, part), scale))
        # the point, not its parts: the measure's own buffer, nothing more held
        ctx.save_for_backward(x, base, point)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, base, point = ctx.saved_tensors
        g = grad.to(x.dtype)
        grad_x = grad_point = None
        if ctx.needs_input_grad[0]:
            base = _held(base, point, x.dtype)
            hi, scale = _parts(base, point, 1)[0]
            grad_x = mm32(g, base.t()).add_(_scaled(mm32(g, hi.t()), scale)).to(x.dtype)
        if ctx.needs_input_grad[2]:  # in the layout of the point's memory (no copy there)
            grad_point = mm32(g.t(), x).t() if point.stride(0) == 1 else mm32(x.t(), g)
        return grad_x, None, grad_point, None


def _held(base: Tensor | None, point: Tensor, half: torch.dtype) -> Tensor:
    """The weight as the model holds it, or where the model holds none whole (a sharded
    one's point gathered from its slices) the point rounded to ``half``: ``P = B + D``
    either way, and at the unperturbed point ``B`` is the model's weight, ``D = 0``."""
    return point.detach().to(half) if base is None else base


def _parts(base: Tensor, point: Tensor, parts: int = PARTS) -> list[tuple[Tensor, Tensor | None]]:
    return split(torch.sub(point.detach(), base), base.dtype, base, parts, scratch=True)


def split_product(
    x: Tensor, base: Tensor | None, point: Tensor, bias: Tensor | None = None
) -> Tensor:
    """``x @ point + bias`` over any leading dimensions of ``x`` (half precision),
    computed as the module's split products (see the module) around ``base`` (``None``:
    the point rounded to half precision), in float32. The bias
    (any dtype) joins the weight's product in half precision, its remainder in float32:
    at the unperturbed point the layer is the model's own, rounded once."""
    lead = x.shape[:-1]
    held = rest = None
    if bias is not None:
        held = bias.detach().to(x.dtype)
        rest = bias - held
    y = _SplitProduct.apply(x.reshape(-1, x.shape[-1]), base, point, held)
    y = y.reshape(*lead, y.shape[-1])
    return y if rest is None else y + rest


class SplitLinears(TorchFunctionMode):
    """While an owner computes: its linear products with a perturbed weight (``F.linear``,
    ``torch.addmm``, ``@``, with the point or its transpose) as :func:`split_product`,
    where the input is a float32 copy of a half-precision tensor (``copies``, a
    :class:`~geosharp.params.UpCasts`); everything else as it is. ``weights``: each
    owner's ``{attribute: weight as the model holds it}``, ``None`` where it holds none
    whole (a sharded model: the point is split around its own rounding)."""

    def __init__(self, weights: dict[int, dict[str, Tensor]], copies):
        super().__init__()
        self.weights, self.copies = weights, copies
        self.points: dict[int, tuple[Tensor, Tensor | None]] = {}  # id(point) -> (point, weight)

    def before(self, module) -> None:
        for attr, weight in self.weights.get(id(module), {}).items():
            point = getattr(module, attr)
            if point.dtype == torch.float32 and (weight is None or point.shape == weight.shape):
                self.points[id(point)] = (point, weight)
        if self.points:
            self.__enter__()

    def after(self, module) -> None:
        if self.points:
            self.points.clear()
            self.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self._split(func, args, kwargs)
        return func(*args, **kwargs) if out is None else out

    def _split(self, func, args, kwargs) -> Tensor | None:
        if func is F.linear:
            x, weight, bias = (*args, *kwargs.values(), None)[:3]
            return self._product(x, weight.t(), bias) if isinstance(weight, Tensor) else None
        if func in (torch.addmm, Tensor.addmm) and not kwargs and len(args) == 3:
            return self._product(args[1], args[2], args[0])
        if func in _MATMULS and not kwargs and len(args) == 2 and args[1].dim() == 2:
            return self._product(args[0], args[1], None)
        return None

    def _weight(self, t) -> tuple[Tensor | None, bool] | None:
        """The held weight of the point ``t`` is of (or of whose transpose it is), and
        whether it is the transpose."""
        if not isinstance(t, Tensor):
            return None
        if id(t) in self.points:
            return self.points[id(t)][1], False
        if t.dim() != 2:
            return None
        for point, weight in self.points.values():  # a transpose: a view of the same memory
            if (
                t.untyped_storage().data_ptr() == point.untyped_storage().data_ptr()
                and t.storage_offset() == point.storage_offset()
                and t.shape == point.shape[::-1]
                and t.stride() == point.stride()[::-1]
            ):
                return weight, True
        return None

    def _product(self, x, b, bias) -> Tensor | None:
        held = self._weight(b)
        if held is None or not isinstance(x, Tensor):
            return None
        half = self.copies.half_of(x)
        if half is None:  # not a half-precision input: the float32 product as it was
            return None
        weight, transposed = held
        return split_product(
            half, weight.t() if transposed and weight is not None else weight, b, bias
        )


_MATMULS = (torch.matmul, torch.mm, Tensor.matmul, Tensor.mm, Tensor.__matmul__)
