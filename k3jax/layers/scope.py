"""Each layer's operations named after the layer, for profiles.

    class KDALayer(nnx.Module):
        @scoped
        def __call__(self, ...): ...

`scoped` runs the call inside ``jax.named_scope(<the module's class name>)``, so every operation
it traces carries the name in its HLO ``op_name`` -- ``.../KDALayer/...``, and under
``transpose(...)`` for the backward -- which is how `bench.step_profile` attributes a step's time
to the layers. Names are metadata only: the computation, and its compiled code, are unchanged.
"""
from __future__ import annotations

import functools

import jax


def scoped(call):
    """``call`` (a module's ``__call__``) inside a named scope of the module's class name."""

    @functools.wraps(call)
    def within_scope(self, *args, **kwargs):
        with jax.named_scope(type(self).__name__):
            return call(self, *args, **kwargs)

    return within_scope
