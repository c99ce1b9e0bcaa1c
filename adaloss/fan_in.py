"""The fan-in of a layer: the number of terms summed into one entry of its input gradient.

A layer's decision models its input gradient ``dx`` as a sum of ``n`` products of the incoming
cotangent and the weight (the ``output`` model's spread ``√n·σ``; the overflow cap
``u_max / (n·m)``). For a matmul ``n`` is the weight's extent along the output features. For a
convolution every entry of ``dx`` gathers the output positions whose window covers it:

    dx[i] = Σ_{c, k : o·s + k·d − p = i·L} g[c, o] · W[c, k]

with ``c`` the output features of ``i``'s group, ``k`` a kernel tap, ``s`` the window stride,
``d`` the kernel (rhs) dilation, ``L`` the input (lhs) dilation and ``p`` the low padding. A
stride-1 convolution sums every tap (``n = C_out/groups · ∏K``); a strided one only the taps
whose offset the stride lands on (``⌈K/s⌉`` per dimension for ``d = 1``); a transposed
convolution (``L`` > 1, stride 1: torch's ``ConvTranspose``, ``lax.conv_transpose``) every tap
again. The count here is the largest any entry away from the borders sums (one at a border sums
fewer), per spatial dimension independently; both fronts call it, so equal layers get equal
fan-ins in JAX and PyTorch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def taps_per_entry(kernel: int, stride: int = 1, dilation: int = 1, lhs_dilation: int = 1,
                   padding: int = 0) -> int:
    """The most kernel taps of one spatial dimension that meet one input entry: over the
    residues of ``i·L + p`` modulo the stride, the taps ``k < kernel`` with
    ``k·d ≡ i·L + p (mod s)``."""
    for name, v in (("kernel", kernel), ("stride", stride), ("dilation", dilation),
                    ("lhs_dilation", lhs_dilation)):
        if int(v) < 1:
            raise ValueError(f"a convolution's {name} must be >= 1, got {v}")
    if stride == 1:
        return kernel
    return max(sum(1 for k in range(kernel) if (i * lhs_dilation + padding - k * dilation) % stride == 0)
               for i in range(stride))


def conv_fan_in(out_features: int, groups: int, kernel: Sequence[int], strides: Sequence[int] | None = None,
                dilation: Sequence[int] | None = None, lhs_dilation: Sequence[int] | None = None,
                padding: Sequence[int] | None = None) -> int:
    """Terms summed into an entry of a convolution's input gradient: the output features of
    its group (``out_features / groups``) times :func:`taps_per_entry` in every spatial
    dimension (``None``: 1 each, padding 0)."""
    nd = len(kernel)
    ones = (1,) * nd
    strides, dilation = tuple(strides or ones), tuple(dilation or ones)
    lhs_dilation, padding = tuple(lhs_dilation or ones), tuple(padding or (0,) * nd)
    if not len(strides) == len(dilation) == len(lhs_dilation) == len(padding) == nd:
        raise ValueError(f"a {nd}-d kernel needs {nd} strides, dilations and paddings; got "
                         f"{strides}, {dilation}, {lhs_dilation}, {padding}")
    if groups < 1 or out_features % groups:
        raise ValueError(f"{out_features} output features do not split into {groups} groups")
    taps = math.prod(taps_per_entry(int(k), int(s), int(d), int(ld), int(p))
                     for k, s, d, ld, p in zip(kernel, strides, dilation, lhs_dilation, padding))
    return out_features // groups * taps
