"""Evaluation of trained runs: ``python -m eval RUN_DIR`` (`eval.cli`), ``python -m eval.generate``,
``python -m eval.chat``; installed as ``k3jax.eval`` (the ``k3jax-eval`` console script)."""
