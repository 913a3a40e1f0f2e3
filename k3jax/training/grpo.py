"""GRPO-family policy optimisation: group-relative advantages, the update's rows, the clipped
policy-gradient objective with an optional KL penalty (DeepSeekMath, arXiv 2402.03300; Dr. GRPO,
arXiv 2503.20783; DAPO, arXiv 2503.14476; GSPO, arXiv 2507.18071).

For a group of G completions of one prompt with rewards r_1..r_G (``rl.rewards``: r_i = sum_k w_k
r_k,i, each function called on the step's batch; with ``rl.overlong_penalty`` = L_c > 0, DAPO's
soft overlong penalty of a completion of |y_i| sampled tokens, L = ``rl.max_new_tokens``, is added:

    R_len(y) = 0                          |y| <= L - L_c
             = (L - L_c - |y|) / L_c      L - L_c < |y| <= L      (0 down to -1 at the limit)
             = -1                         |y| > L)

    grpo      A_i = (r_i - mean(r)) / (std(r) + 1e-6)      (population std)
    dr_grpo   A_i = r_i - mean(r)

Each sampled token t of completion i, with policy log-prob l_t under the update's parameters, the
log-prob recorded while sampling o_t and the reference's l^ref_t:

    ratio_t = exp(l_t - o_t)                                   (``rl.ratio=token``)
            = s_i = exp(mean_{u in i} (l_u - o_u))             (``sequence``: GSPO, every token of i)
    pg_t    = -min(ratio_t A_i, clip(ratio_t, 1 - eps_low, 1 + eps_high) A_i)
    kl_t    = exp(l^ref_t - l_t) - (l^ref_t - l_t) - 1           (k3, an unbiased KL(policy || ref) >= 0)
    loss    = sum_t w_t (pg_t + beta kl_t) / sum_t c_t

with eps_low = ``rl.clip_low``, eps_high = ``rl.clip_high`` (each ``rl.clip`` unset; DAPO's
clip-higher raises eps_high) and, on every sampled token of a kept completion (``rl.loss_average``):

    token     w_t = 1,            c_t = 1            (the mean over all sampled tokens)
    sequence  w_t = 1 / |y_i|,    c_t = 1 / |y_i|    (each completion weighs the same)
    dr_grpo   w_t = 1,            c_t = L / |y_i|    (sum over the batch / (completions x L): a constant)

A completion leaves the update (w_t = c_t = 0 on its tokens, the rows keep their shape) when its
group's rewards are all equal and ``rl.dynamic_sampling`` is on (DAPO's dynamic sampling: such a
group's advantages are all 0), or when it was cut at the length limit (finish reason ``length``)
and ``rl.overlong_filter`` is on. With ``rl.resample_rounds`` = N > 0, dynamic sampling refills
first: up to N more rounds of ``rl.prompts_per_step`` fresh prompts are sampled while fewer than
that many groups have reward spread, and the update takes the groups with spread in the order
sampled (`groups_for_update`; the update keeps its shape, so the same compiled step). A step that
keeps no completion updates with zero gradients.

Where l_t's value comes from (``rl.update_logprobs``):

    replay    p_t: the rollout's decode replayed on the sampled tokens at the update's parameters
              (`k3jax.training.rollout.replay`; the batch's ``policy_logprobs``), and its gradient
              the training forward's f_t:  l_t = p_t + (f_t - stop_gradient(f_t)). The sampler's
              own arithmetic defines the policy's probabilities, so on the first update of a rollout
              l_t = o_t bit for bit and the ratio is exactly 1; the gradient is f_t's, the same
              function computed in the chunked order (they differ by fp32 rounding,
              ``forward_gap_max`` = max_t |f_t - p_t|).
    forward   l_t = f_t: no replay; on the first update l_t - o_t is that rounding difference.

The step reports ``logprob_mismatch_max`` = max_t |l_t - o_t|.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.layers.lora import set_adapter_dropout

ADVANTAGE_EPS = 1e-6


def overlong_penalty(lengths: np.ndarray, max_tokens: int, cache: int) -> np.ndarray:
    """DAPO's soft overlong penalty R_len (module docstring) of completions of ``lengths`` sampled
    tokens, limit ``max_tokens`` = L, ramp ``cache`` = L_c > 0, float64."""
    lengths = np.asarray(lengths, np.float64)
    ramp = (max_tokens - cache - lengths) / cache
    return np.where(lengths <= max_tokens - cache, 0.0, np.where(lengths <= max_tokens, ramp, -1.0))


def kept_completions(rewards: np.ndarray, finish_reasons, *, dynamic_sampling: bool, overlong_filter: bool
                     ) -> np.ndarray:
    """Which completions ``[P, G]`` stay in the update (module docstring): not in a group of equal
    rewards (with ``dynamic_sampling``), not cut at the length limit (with ``overlong_filter``)."""
    rewards = np.asarray(rewards, np.float64)
    keep = np.ones(rewards.shape, bool)
    if dynamic_sampling:
        keep &= (rewards.max(axis=1) > rewards.min(axis=1))[:, None]
    if overlong_filter:
        keep &= np.asarray(finish_reasons) != "length"
    return keep


def has_spread(group) -> bool:
    """Whether a group's completions' rewards differ (max > min): otherwise its advantages are all 0."""
    rewards = [completion.reward for completion in group]
    return max(rewards) > min(rewards)


def groups_for_update(sample_round, count: int, extra_rounds: int) -> tuple[list, list, int]:
    """The groups of a step's update, with DAPO's dynamic sampling resampling: ``sample_round(r)`` ->
    sampling round r's ``count`` groups (rewarded). Without ``extra_rounds``: round 0's. Else the
    groups with reward spread (`has_spread`) of rounds 0, 1, ... in order, a round sampled only while
    fewer than ``count`` have spread, at most ``extra_rounds`` after round 0; groups without spread
    (round 0's first) fill what is still missing, and leave the update by `kept_completions`.
    -> (round 0's groups, the update's ``count`` groups, rounds sampled)."""
    own = sample_round(0)
    if not extra_rounds:
        return own, own, 1
    spread, flat, groups, rounds = [], [], own, 0
    while True:
        for group in groups:
            (spread if has_spread(group) else flat).append(group)
        rounds += 1
        if len(spread) >= count or rounds > extra_rounds:
            return own, (spread + flat)[:count], rounds
        groups = sample_round(rounds)


def group_advantages(rewards: np.ndarray, kind: str) -> np.ndarray:
    """Advantages ``[P, G]`` of rewards ``[P, G]`` (one row per prompt's group), float64."""
    rewards = np.asarray(rewards, np.float64)
    centred = rewards - rewards.mean(axis=1, keepdims=True)
    if kind == "dr_grpo":
        return centred
    if kind == "grpo":
        return centred / (rewards.std(axis=1, keepdims=True) + ADVANTAGE_EPS)
    raise ValueError(f"unknown advantage {kind!r}; expected grpo or dr_grpo")


def sampled_positions(completion) -> np.ndarray:
    """The positions of a completion's update row whose targets are its sampled tokens."""
    return completion.prompt.tokens.size - 1 + np.flatnonzero(np.asarray(completion.sampled, bool))


def logprob_rows(completions: Sequence, seq_len: int, logprobs: Sequence) -> np.ndarray:
    """``[N, seq_len]`` float32: row i holds ``logprobs[i]`` (one per sampled token of completion i)
    at `sampled_positions`, zero elsewhere."""
    rows = np.zeros((len(completions), seq_len), np.float32)
    for row, (completion, values) in enumerate(zip(completions, logprobs)):
        rows[row, sampled_positions(completion)] = values
    return rows


def update_rows(completions: Sequence, seq_len: int, loss_average: str, max_tokens: int = 0,
                keep: Sequence[bool] | None = None) -> dict[str, np.ndarray]:
    """The update's batch ``[N, seq_len]`` of N completions (`k3jax.training.rollout.Completion`):
    row i is prompt + completion i (``seq_len + 1`` tokens at most) as inputs / targets, padded with
    segment 0; ``loss_mask`` marks the targets the policy sampled, ``old_logprobs`` their recorded
    log-probs, ``advantages`` the completion's advantage, ``weights`` w_t and ``counts`` c_t (module
    docstring; ``max_tokens``: L of ``dr_grpo``; zero in the rows that ``keep`` leaves out)."""
    rows = len(completions)
    keep = [True] * rows if keep is None else keep
    batch = {name: np.zeros((rows, seq_len), np.int32) for name in ("tokens", "targets", "segment_ids")}
    batch.update({name: np.zeros((rows, seq_len), np.float32)
                  for name in ("loss_mask", "weights", "counts", "advantages")})
    for row, completion in enumerate(completions):
        sequence = np.concatenate([completion.prompt.tokens, np.asarray(completion.tokens, np.int32)])
        if sequence.size > seq_len + 1:
            raise ValueError(f"completion {row} has {sequence.size} tokens with its prompt, more than seq_len + 1")
        positions = sequence.size - 1
        batch["tokens"][row, :positions] = sequence[:-1]
        batch["targets"][row, :positions] = sequence[1:]
        batch["segment_ids"][row, :positions] = 1
        where = sampled_positions(completion)
        batch["loss_mask"][row, where] = 1.0
        batch["advantages"][row, :positions] = completion.advantage
        if keep[row]:
            sampled = max(len(where), 1)
            batch["weights"][row, where] = 1.0 / sampled if loss_average == "sequence" else 1.0
            batch["counts"][row, where] = {"token": 1.0, "sequence": 1.0 / sampled,
                                           "dr_grpo": max_tokens / sampled}[loss_average]
    batch["old_logprobs"] = logprob_rows(completions, seq_len, [[lp for lp, sampled in zip(c.logprobs, c.sampled)
                                                                  if sampled] for c in completions])
    return batch


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """``log_softmax(logits)[targets]`` ``[B, T]`` in fp32 from logits ``[B, T, V]``."""
    logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logprobs, targets[..., None], axis=-1)[..., 0]


def policy_objective(clip_low: float, clip_high: float, kl_coef: float, ratio_level: str = "token"):
    """The GRPO objective (`k3jax.training.steps.make_train_step`'s ``objective``) -> ``(sum_t w_t
    loss_t, sum_t c_t, metrics)``, the ratio per token or (``ratio_level="sequence"``, GSPO) per
    completion; the batch is `update_rows`'s, plus ``reference_logprobs`` when
    ``kl_coef`` > 0 and the replayed ``policy_logprobs`` p_t with ``rl.update_logprobs=replay``
    (`logprob_rows`). Metrics: sampled tokens, the sums of kl_t, of clipped tokens and of the ratio,
    ``logprob_mismatch_max`` and, with p_t, ``forward_gap_max``."""

    def objective(logits, batch):
        mask, advantages = batch["loss_mask"], batch["advantages"]
        logprobs = token_logprobs(logits, batch["targets"])
        metrics = {}
        if "policy_logprobs" in batch:           # p_t's value, f_t's gradient (module docstring)
            metrics["forward_gap_max"] = jnp.max(jnp.where(mask > 0, jnp.abs(logprobs - batch["policy_logprobs"]), 0.0))
            logprobs = batch["policy_logprobs"] + (logprobs - jax.lax.stop_gradient(logprobs))
        delta = jnp.where(mask > 0, logprobs - batch["old_logprobs"], 0.0)
        if ratio_level == "sequence":          # s_i = exp(mean over the completion's sampled tokens)
            mean = jnp.sum(delta, axis=-1, keepdims=True) / jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0)
            ratio = jnp.exp(jnp.where(mask > 0, mean, 0.0))
        else:
            ratio = jnp.exp(delta)
        clipped_ratio = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
        loss = -jnp.minimum(ratio * advantages, clipped_ratio * advantages)
        metrics |= {"sampled_tokens": jnp.sum(mask),
                    "clipped_tokens": jnp.sum(mask * (ratio * advantages > clipped_ratio * advantages)),
                    "ratio_sum": jnp.sum(mask * jax.lax.stop_gradient(ratio)),
                    "logprob_mismatch_max": jnp.max(jnp.abs(jax.lax.stop_gradient(delta)))}
        if kl_coef:
            log_ratio = jnp.where(mask > 0, batch["reference_logprobs"] - logprobs, 0.0)
            kl = jnp.exp(log_ratio) - log_ratio - 1.0
            loss = loss + kl_coef * kl
            metrics["kl_sum"] = jnp.sum(mask * jax.lax.stop_gradient(kl))
        return jnp.sum(batch["weights"] * loss), jnp.sum(batch["counts"]), metrics

    return objective


def make_logprob_step(parts, shardings=None):
    """The jitted ``logprob_step(params, buffers, batch[, frozen]) -> [B, T]``: the model's log-prob
    of each target (adapter dropout off) -- the reference policy's, given its parameters."""

    def logprob_step(params, buffers, batch, *frozen):
        model = parts.merge(params, buffers, frozen[0] if frozen else None)
        set_adapter_dropout(model, 0.0)
        out = model(batch["tokens"], segment_ids=batch["segment_ids"])
        return token_logprobs(out.logits, batch["targets"])

    if shardings is None:
        return jax.jit(logprob_step)
    frozen = () if parts.frozen is None else (shardings.frozen,)
    return jax.jit(logprob_step, in_shardings=(shardings.state.params, shardings.state.buffers, shardings.batch, *frozen),
                   out_shardings=shardings.batch)
