"""Dense GLU feed-forward (SPEC §4, §5): layer 0's FFN and the MoE's shared experts.

    y = act(x W_gate, x W_up) W_down,   act = SiTU-GLU (K3) or SwiGLU (Kimi Linear)

each product plus its LoRA adapter's term when it has one (`k3jax.layers.lora`).

W_gate / W_up are the checkpoint's w1 / w3 (``gate_proj`` / ``up_proj``), W_down its w2
(``down_proj``); stored here [in, out] (the checkpoint stores [out, in]). No biases.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.layers.lora import adapted_project
from k3jax.layers.params import param, truncated_normal
from k3jax.layers.scope import scoped
from k3jax.ops.moe import glu_activation


class DenseGLU(nnx.Module):
    """A GLU MLP of hidden width ``hidden_width`` on ``d_model``-wide inputs.

    Args:
      d_model: input and output width d.
      hidden_width: hidden width F.
      activation: "situ" (with ``situ_beta``, ``situ_beta_linear``) or "swiglu".
      init_std: std of the truncated-normal init of all three weights (SPEC §5: 0.02).
      dtype: compute dtype of the matmuls (the activation itself runs in fp32).
      param_dtype: storage dtype of the weights.
    """

    LORA_WEIGHTS = {"w_gate": 1, "w_up": 1, "w_down": 1}   # weights a LoRA adapter can join: {name: input axes}

    def __init__(
        self,
        d_model: int,
        hidden_width: int,
        *,
        activation: str = "situ",
        situ_beta: float = 4.0,
        situ_beta_linear: float | None = 25.0,
        init_std: float = 0.02,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        glu_activation(activation)  # fail at construction on an unknown name
        init = truncated_normal(init_std)
        self.w_gate = param(rngs, init, (d_model, hidden_width), ("embed", "mlp"), param_dtype)
        self.w_up = param(rngs, init, (d_model, hidden_width), ("embed", "mlp"), param_dtype)
        self.w_down = param(rngs, init, (hidden_width, d_model), ("mlp", "embed"), param_dtype)
        self.activation = activation
        self.situ_beta = situ_beta
        self.situ_beta_linear = situ_beta_linear
        self.dtype = dtype

    @scoped
    def __call__(self, x: jax.Array) -> jax.Array:
        """x [..., d] -> y [..., d] in ``dtype``."""
        activation = glu_activation(self.activation, self.situ_beta, self.situ_beta_linear)
        x = x.astype(self.dtype)
        hidden = activation(adapted_project(self, "w_gate", x, self.dtype), adapted_project(self, "w_up", x, self.dtype))
        return adapted_project(self, "w_down", hidden, self.dtype)
