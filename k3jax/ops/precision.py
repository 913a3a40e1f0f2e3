"""Full-precision contractions for fp32 state math.

TPUs (and GPUs with TF32) lower fp32 matmuls to reduced precision by default; the KDA
recurrences need true fp32, so their contractions ask for HIGHEST explicitly.
"""
import functools

import jax
import jax.numpy as jnp

einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)
