"""Forward rules of hand-written VJPs that keep only their declared residuals inside `lax.scan`.

A ``jax.custom_vjp`` op run inside a scan that is differentiated (the model's scanned depth) has
its forward rule linearised when JAX partially evaluates the scan body: every intermediate of
the rule's own loops is saved, although the backward rule reads only the declared residuals.
For blockwise attention that is every (query block, key block) pair's scores -- the T x T score
matrix again (tiny model, T = 4096: 576 of a 577 MiB train step) -- and for chunked KDA the
per-chunk block terms (8x its standalone temporaries). Wrapped in a full rematerialisation, the
linearisation keeps only the rule's inputs; the cost is one recomputation of the forward rule in
the backward pass, and only where it is linearised (outside a scan the wrapper changes nothing).
"""
from __future__ import annotations

import jax


def forward_rule(fn, static_argnums: tuple[int, ...] = ()):
    """``fn`` (the computation inside a custom_vjp forward rule) rematerialised with nothing saved."""
    return jax.checkpoint(fn, static_argnums=static_argnums, policy=jax.checkpoint_policies.nothing_saveable)
