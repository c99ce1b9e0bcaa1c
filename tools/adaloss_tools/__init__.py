"""Instruments for reading what adaloss compiles to: the repository's tests and benchmarks
use them; the ``adaloss`` wheel does not ship them.

- :mod:`adaloss_tools.gpu_program`: the program XLA:GPU compiles for a GPU target, read on a
  machine without one (kernels, bytes, FP8 GEMMs, attribution).
- :mod:`adaloss_tools.audit`: the FP8 conversions of a traced step and whether a full
  reduction of their data lies on their input's path.
- :mod:`adaloss_tools.jaxpr_walk`: re-evaluates a jaxpr equation by equation.
"""
