"""Causal depthwise conv with carried state against the float64 NumPy loop (SPEC §1.1)."""
import jax
import numpy as np

from k3jax.ops.conv import causal_depthwise_conv, conv_tails
from tests import numpy_reference as ref

conv = jax.jit(causal_depthwise_conv)


def test_matches_numpy_with_state_and_segments():
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((2, 9, 5)), rng.standard_normal((5, 4))
    state = rng.standard_normal((2, 3, 5))
    segments = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2], [3, 3, 3, 3, 3, 3, 3, 4, 4]])
    y, new_state = conv(x.astype(np.float32), w.astype(np.float32), state.astype(np.float32), segments)
    y_ref, state_ref = ref.causal_conv(x, w, state, segments)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new_state, state_ref, rtol=1e-6, atol=1e-6)


def test_pieces_with_carried_state_equal_one_call():
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((1, 10, 3)).astype(np.float32), rng.standard_normal((3, 4)).astype(np.float32)
    y_full, state_full = causal_depthwise_conv(x, w)
    pieces, state = [], None
    for start, stop in [(0, 2), (2, 3), (3, 10)]:   # includes pieces shorter than the window
        y, state = causal_depthwise_conv(x[:, start:stop], w, state)
        pieces.append(y)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), y_full, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(state, state_full)
    np.testing.assert_allclose(state, x[:, -3:])


def test_tails_after_every_token_are_the_carried_windows_of_each_prefix():
    rng = np.random.default_rng(2)
    x, w, state = rng.standard_normal((2, 5, 3)), rng.standard_normal((3, 4)), rng.standard_normal((2, 3, 3))
    tails = conv_tails(x.astype(np.float32), state.astype(np.float32))
    assert tails.shape == (2, 5, 3, 3)
    for t in range(5):                                 # 5 tokens, more and fewer than the window of 3
        _, state_ref = ref.causal_conv(x[:, : t + 1], w, state)
        np.testing.assert_allclose(tails[:, t], state_ref, rtol=1e-6, atol=1e-6)
