"""The suite's exactness policy, in one place.

Bit-exact (``torch.equal``, ``==``) only where the same kernels run the same shapes in the same order:
a resume in one process layout, a replayed episode, a file's round trip, a state streamed through
another buffer. Anywhere else -- another tensor width, another process count, another CPU's kernels
(AVX2 against AVX-512 pick other blockings and reduction orders) -- two correct programs agree only up
to the rounding of reordered sums, and :func:`assert_rounding_close` is the comparison.

A sum of ``n`` terms computed in two orders differs by at most about ``n * eps * sum(|terms|)``
(Higham, *Accuracy and Stability of Numerical Algorithms*, eq. 4.3); ``length`` is that ``n`` for the
longest chain of such sums between the inputs and the compared value (e.g. width x depth of a network)
and the scale is the compared values' largest magnitude. This is a bound, not a fit to one machine.
"""

from __future__ import annotations

import torch


def rounding_atol(want: torch.Tensor, length: int, dtype: torch.dtype = torch.float32) -> float:
    """The bound above for values like ``want`` after ``length``-term sums in ``dtype``."""
    scale = float(want.detach().abs().max()) if want.numel() else 0.0
    return length * torch.finfo(dtype).eps * max(scale, torch.finfo(dtype).tiny)


def assert_rounding_close(got, want, length: int, dtype: torch.dtype = torch.float32) -> None:
    """``got`` equals ``want`` up to reordered ``length``-term sums in ``dtype`` (see the module)."""
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=rounding_atol(want, length, dtype))
