"""`RLTrainer`: reinforcement learning on prompts (``train.objective=grpo``, settings ``rl.*``).

A step at policy step n (the optimizer has made n x ``rl.updates_per_rollout`` updates; checkpoint n
holds exactly these parameters):

    rollout   ``rl.prompts_per_step`` prompts of the data's step n, each prefilled once and forked
              into ``rl.group_size`` sessions; all completions decode together on the session store
              with the train state's own parameters (`k3jax.training.rollout`), recording each
              sampled token's log-prob; rewards (``rl.reward``, the weighted ``rl.rewards`` or the
              environment; plus DAPO's soft overlong penalty with ``rl.overlong_penalty``)
    update    group-relative advantages and ``rl.updates_per_rollout`` optimizer steps on the clipped
              policy-gradient objective (`k3jax.training.grpo`: the DAPO / GSPO options, the groups and
              completions that ``rl.dynamic_sampling`` / ``rl.overlong_filter`` leave out, and the
              groups of up to ``rl.resample_rounds`` more rounds of fresh prompts that refill them),
              the first with the very parameters that sampled (``logprob_mismatch`` = max
              |recomputed - recorded| log-prob); with
              ``rl.update_logprobs=decode`` each first replays the rollout's decode on the sampled
              tokens at its parameters for the log-probs' values (`k3jax.training.rollout.replay`:
              on the first update the recorded ones bit for bit), the training forward giving their
              gradient (``forward_gap`` = max |forward - replayed|; ``replay_seconds``)

``<run_dir>/rollouts.jsonl`` gets one record per completion (``policy_step``: its parameters are
checkpoint ``policy_step``'s, `restore_model(run_dir, step=policy_step)`, where that checkpoint is kept:
the run saves step 0 before sampling and then every ``checkpoint.every`` steps, so
``checkpoint.every=1`` with ``checkpoint.keep`` >= ``train.steps`` + 1 keeps every policy; ``prompt_index``,
``sample``, ``prompt_tokens``, ``completion_tokens``, ``completion``, ``logprobs``, ``reward``,
``advantage``, ``finish_reason``; with an environment also ``sampled``, ``tool_calls``, ``retries``;
a resampled group's ``resampling`` round; the update's groups only),
and ``metrics.jsonl`` one record per step (reward mean / std, pass@1, pass@G and completion length
of the step's own prompts; KL, clip fraction, log-prob mismatch, rollout and update seconds; with
``rl.resample_rounds`` the rounds sampled and the update's resampled groups). Held-out evaluation
(every ``train.eval_every`` steps and at the end): the mean reward of greedy completions of the first
``rl.eval_prompts`` held-out prompts. A resumed run samples exactly what the killed one would have:
the sampling keys are functions of ``(train.seed, step, prompt slot, sample)``, and records of steps
after the restored checkpoint are dropped from both files.

The reference policy of the KL penalty (``rl.kl_coef`` > 0) is ``init_from``'s parameters (a full
fine-tune keeps one more copy of them), or for LoRA the frozen base itself: the adapters set to zero,
no extra memory. Rollouts run on the run's mesh: the session pools are placed beside the (sharded)
parameters by the jitted steps themselves. A run of several processes (``python -m train ...
--num-processes N``) rolls out as one: every process makes the same store calls, each program
running on every process's shards; process 0 alone calls the rewards and sends their values to the
others (`k3jax.training.rewards.score_on_the_leader`) and alone writes ``rollouts.jsonl``; a tool
environment lives on process 0 too, which sends each turn's outcome to the others.

With ``rl.speculation.prompt_lookup`` or ``rl.speculation.draft`` rollouts decode speculatively
(`k3jax.training.rollout`, up to ``rl.speculation.k`` drafts a round) on each step's own store, so on
the current policy; the draft model is restored once, at the start: on the first device beside a
one-device run, else on a mesh of every device of its own (its heads and experts split as far as
they go), which every process runs.
``metrics.jsonl`` then also holds
the step's ``speculation_acceptance_rate``, ``speculation_mean_accepted_length``,
``speculation_tokens_per_round`` (emitted tokens per sequence-round), ``speculation_draft_seconds``
and ``speculation_verify_seconds``.
"""
from __future__ import annotations

import functools
import pathlib
import time

import jax
import numpy as np

from k3jax.checkpoint import CheckpointError, latest_meta
from k3jax.config import ConfigError, config_from_dict
from k3jax.data import DataError
from k3jax.inference.mirror import Channel
from k3jax.layers.lora import set_adapter_dropout
from k3jax.sessions import SessionStore
from k3jax.sharding import compiled_together
from k3jax.training.environments import load_environment
from k3jax.training.grpo import (group_advantages, groups_for_update, kept_completions, logprob_rows, make_logprob_step,
                                 overlong_penalty, policy_objective, update_rows)
from k3jax.training.metrics import MetricsLog, Progress
from k3jax.training.rewards import check_records, load_rewards
from k3jax.inference import InputError, draft_mesh, draft_mismatch, load_draft
from k3jax.training.rollout import Rollout, SamplingSettings, replay
from k3jax.training.signals import StopRequested, StopSignals
from k3jax.training.steps import make_train_step
from k3jax.training.trainer import Trainer


REWARD_CHANNEL = "k3jax/rl-rewards/"    # process 0's rewards to the other processes (key-value store keys)


def sampling_seed(seed: int, step: int, resampling: int = 0) -> int:
    """The 32-bit sampling seed of policy step ``step`` of a run seeded ``seed`` (``resampling`` r > 0:
    of the step's r-th resampling round, ``rl.resample_rounds``)."""
    return int(np.random.SeedSequence([seed, step, *([resampling] if resampling else [])]).generate_state(1)[0])


def check_draft(config) -> int:
    """The step of ``rl.speculation.draft``'s newest checkpoint, after checking from its saved
    config that it drafts in the policy's token ids (`k3jax.inference.draft_mismatch`)."""
    source = pathlib.Path(config.rl.speculation.draft).expanduser()
    try:
        step, meta = latest_meta(source)
        problem = draft_mismatch(config, config_from_dict(meta.get("config") or {}))
    except (CheckpointError, ConfigError) as error:
        raise ConfigError("rl.speculation.draft", f"{source}: {error}") from None
    if problem is not None:
        raise ConfigError("rl.speculation.draft", f"{source}: {problem}")
    return step


def rollout_records(groups, policy_step: int) -> list[dict]:
    """The ``rollouts.jsonl`` records of one step's groups (``step``: the step they train, policy_step + 1;
    ``source``: the prompt's file and line (JSON) or row (Parquet); ``id``: the record's own, if it has one)."""
    records = []
    for group in groups:
        for c in group:
            record = {"step": policy_step + 1, "policy_step": policy_step, "prompt_index": c.prompt_index,
                      "source": c.prompt.where, **({"id": c.prompt.record["id"]} if "id" in c.prompt.record else {}),
                      "sample": c.sample, "prompt_tokens": c.prompt.tokens.tolist(), "completion_tokens": c.tokens,
                      "completion": c.text, "logprobs": c.logprobs, "reward": c.reward, "advantage": c.advantage,
                      "finish_reason": c.finish_reason}
            if c.resampling:
                record.update(resampling=c.resampling)
            if c.reward_terms:
                record.update(rewards=c.reward_terms)
            if not all(c.sampled):
                record.update(sampled=c.sampled)
            if c.tool_calls or c.retries:
                record.update(tool_calls=c.tool_calls, retries=c.retries)
            records.append(record)
    return records


def group_metrics(groups, threshold: float) -> dict:
    """Reward mean / std (with several rewards also each one's mean), pass@1 (completions with reward
    >= threshold), pass@G (prompts with one), completion length, finish reasons and tool use of one
    step's groups."""
    rewards = np.array([[c.reward for c in group] for group in groups], np.float64)
    completions = [c for group in groups for c in group]
    passed = rewards >= threshold
    metrics = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
               "pass_at_1": float(passed.mean()), f"pass_at_{rewards.shape[1]}": float(passed.any(axis=1).mean()),
               "completion_length": float(np.mean([c.length for c in completions])),
               "finished_fraction": float(np.mean([c.finish_reason == "stop" for c in completions]))}
    for name in completions[0].reward_terms:          # with several rewards: each one's mean
        metrics[f"reward_{name}_mean"] = float(np.mean([c.reward_terms[name] for c in completions]))
    if any(c.tool_calls or c.retries for c in completions):
        metrics.update(tool_calls=sum(c.tool_calls for c in completions),
                       tool_retries=sum(c.retries for c in completions))
    return metrics


class RLTrainer(Trainer):
    """`Trainer` whose steps are rollouts and policy updates (module docstring)."""

    objectives = ("grpo",)

    @property
    def batch_size(self) -> int:
        return self.config.rl.rows

    def _check_data(self) -> None:
        """The reward or environment, and the fields they read in every record."""
        rl, records = self.config.rl, self.data.splits["train"] + self.data.splits["heldout"]
        if rl.environment is not None:
            if not self.data.chat:
                raise ConfigError("rl.environment", "a tool environment needs chat prompts (records with 'messages')")
            self.environment, self.reward = load_environment(rl.environment), None
            self._check_fields(records, getattr(self.environment, "required_fields", ()), "rl.environment")
        else:
            self.environment, self.reward = None, load_rewards(rl.reward, rl.rewards)
            for index, term in enumerate(self.reward):
                check_records(term.name, records, f"rl.rewards[{index}].name" if rl.rewards else "rl.reward")
        if not self.data.num_prompts("train"):
            raise DataError(f"{self.config.data.path}: the train split has no prompts")
        self.draft_step = check_draft(self.config) if rl.speculation.draft is not None else None
        self.reward_channel = Channel.joined(REWARD_CHANNEL)      # None in one process

    def _build_steps(self) -> None:
        config, rl = self.config, self.config.rl
        self.settings = SamplingSettings(rl.temperature, rl.top_k, rl.top_p, rl.max_new_tokens)
        self.train_step = compiled_together(
            make_train_step(self.parts, self.optimizer, accumulation=config.train.grad_accum, schedule=self.schedule,
                            shardings=self.shardings, dropout_seed=config.train.seed,
                            objective=policy_objective(*rl.clip_range, rl.kl_coef, rl.ratio)), "train step")
        self.logprob_step = make_logprob_step(self.parts, self.shardings) if rl.kl_coef else None
        self.reference = self._reference_params() if rl.kl_coef else None
        self.draft = self._draft() if rl.speculation.draft is not None else None

    def _draft(self):
        """The draft model of speculative rollouts: ``rl.speculation.draft``'s (restored here, once), on
        one device beside a one-device run, else on a mesh of every device of its own
        (`k3jax.inference.draft_mesh`), so that every process runs it."""
        try:
            draft = load_draft(str(self.config.rl.speculation.draft), self.config, step=self.draft_step,
                               mesh=draft_mesh(self.mesh.size > 1))
        except InputError as error:
            raise ConfigError("rl.speculation.draft", str(error)) from None
        set_adapter_dropout(draft, 0.0)
        return draft

    def _check_fields(self, records, fields, setting: str) -> None:
        for prompt in records:
            missing = [field for field in fields if field not in prompt.record]
            if missing:
                raise DataError(f"{prompt.where}: no {missing[0]!r} field ({setting}={getattr(self.config.rl, setting[3:])} reads it)")

    # -- a step ----------------------------------------------------------------------------------

    def policy_model(self):
        """The current policy as a model over the train state's arrays (no copy), adapter dropout off."""
        model = self.parts.merge(self.state.params, self.state.buffers, self.frozen)
        set_adapter_dropout(model, 0.0)
        return model

    def _rollout(self) -> Rollout:
        rl = self.config.rl
        return Rollout(self.policy_model(), self.data, self.settings, reward=self.reward,
                       environment=self.environment, tool_retries=rl.tool_retries, max_turns=rl.max_turns,
                       fingerprint=f"{self.run_dir}@{self.position}", speculation=rl.speculation, draft=self.draft,
                       reward_timeout=rl.reward_timeout, reward_channel=self.reward_channel)

    def rl_step(self) -> tuple[list, dict]:
        """One rollout and its updates at the current position -> (groups, metrics record)."""
        rl, policy_step = self.config.rl, self.position
        started = time.perf_counter()
        rollout = self._rollout()
        own, groups, rounds = groups_for_update(functools.partial(self._sample_round, rollout), rl.prompts_per_step,
                                                rl.resample_rounds)
        speculation = rollout.speculation_metrics()
        stats = rollout.store.stats()
        capacity = stats["slot_capacity"], stats["page_capacity"]    # the replay's pool shape: the rollout's programs
        del rollout                                          # its store holds the parameters the update donates
        shaping = self._shaping_metrics(groups)
        if rl.resample_rounds:
            shaping.update(sampling_rounds=rounds, groups_resampled=sum(group[0].resampling > 0 for group in groups))
        rewards = np.array([[c.reward for c in group] for group in groups], np.float64)
        for group, row in zip(groups, group_advantages(rewards, rl.advantage)):
            for completion, advantage in zip(group, row):
                completion.advantage = float(advantage)
        keep = kept_completions(rewards, [[c.finish_reason for c in group] for group in groups],
                                dynamic_sampling=rl.dynamic_sampling, overlong_filter=rl.overlong_filter)
        shaping.update(kept_completions=int(keep.sum()))
        if rl.dynamic_sampling:
            shaping["groups_dropped"] = int((rewards.max(axis=1) == rewards.min(axis=1)).sum())
        if rl.overlong_filter:
            shaping["completions_filtered"] = sum(c.finish_reason == "length" for group in groups for c in group)
        rolled_out = time.perf_counter()
        batch = self._device_batch(update_rows([c for group in groups for c in group], self.config.data.seq_len,
                                               rl.loss_average, rl.max_new_tokens, keep.reshape(-1).tolist()))
        if self.logprob_step is not None:
            batch = {**batch, "reference_logprobs": self._reference_logprobs(batch)}
        updates, replay_seconds = [], 0.0
        for _ in range(rl.updates_per_rollout):
            if rl.update_logprobs == "decode":
                replay_started = time.perf_counter()
                batch = {**batch, **self._device_batch({"policy_logprobs": self._replayed_logprobs(groups, capacity)})}
                replay_seconds += time.perf_counter() - replay_started
            self.state, metrics = self.train_step(self.state, batch, *self.frozen_args)
            updates.append(jax.device_get(metrics))
        updated = time.perf_counter()
        return groups, self._record(policy_step + 1, own, updates, rolled_out - started, updated - rolled_out,
                                    replay_seconds, {**speculation, **shaping})

    def _sample_round(self, rollout: Rollout, resampling: int) -> list:
        """The current step's groups of sampling round ``resampling`` (0: the step's own prompts), their
        rewards shaped (`_shape_rewards`)."""
        rl, step = self.config.rl, self.position
        groups = rollout.sample(self.data.prompts(step, rl.prompts_per_step, resampling=resampling), rl.group_size,
                                sampling_seed(self.config.train.seed, step, resampling))
        for completion in (c for group in groups for c in group):
            completion.resampling = resampling
        self._shape_rewards(groups)
        return groups

    def _penalties(self, groups) -> np.ndarray:
        """DAPO's soft overlong penalty (``rl.overlong_penalty``; `overlong_penalty`) of each completion."""
        rl = self.config.rl
        return overlong_penalty([c.length for group in groups for c in group], rl.max_new_tokens, rl.overlong_penalty)

    def _shape_rewards(self, groups) -> None:
        """Add the overlong penalty to each completion's reward (when ``rl.overlong_penalty`` is on)."""
        if self.config.rl.overlong_penalty:
            for completion, penalty in zip((c for group in groups for c in group), self._penalties(groups)):
                completion.reward += float(penalty)

    def _shaping_metrics(self, groups) -> dict:
        """The update's mean overlong penalty (none when off)."""
        if not self.config.rl.overlong_penalty:
            return {}
        return {"overlong_penalty_mean": float(self._penalties(groups).mean())}

    def _replayed_logprobs(self, groups, capacity: tuple[int, int]) -> np.ndarray:
        """The policy's log-probs of the sampled tokens at the current parameters, by the rollout's
        decode replayed (`k3jax.training.rollout.replay`) on a store of the rollout's ``capacity``
        (slots, pages), as update rows (`logprob_rows`)."""
        store = SessionStore(self.policy_model(), fingerprint=f"{self.run_dir}@{self.position}", prefix_cache=False)
        store.reserve(*capacity)
        values = replay(store, groups)
        return logprob_rows([c for group in groups for c in group], self.config.data.seq_len,
                            [v for group_values in values for v in group_values])

    def _record(self, step: int, groups, updates: list[dict], rollout_seconds: float, update_seconds: float,
                replay_seconds: float, speculation: dict) -> dict:
        first, last = updates[0], updates[-1]
        sampled = max(float(first["sampled_tokens"]), 1.0)
        record = {"step": step, "loss": float(first["loss"]), "grad_norm": float(first["grad_norm"]),
                  "learning_rate": float(first["learning_rate"]),
                  **group_metrics(groups, self.config.rl.pass_threshold),
                  "logprob_mismatch": float(first["logprob_mismatch_max"]),
                  "ratio_mean": float(first["ratio_sum"]) / sampled,
                  "clip_fraction": float(np.mean([float(u["clipped_tokens"]) for u in updates])) / sampled,
                  "rollout_seconds": rollout_seconds, "update_seconds": update_seconds,
                  "tokens_per_second": sampled / max(rollout_seconds + update_seconds, 1e-9),
                  "skipped": not all(bool(u["finite"]) for u in updates), "skipped_in_a_row": int(last["skipped"]),
                  **speculation}
        if "forward_gap_max" in first:
            record.update(forward_gap=float(first["forward_gap_max"]), replay_seconds=replay_seconds)
        if "kl_sum" in first:
            record["kl"] = float(first["kl_sum"]) / sampled
        return record

    # -- the loop ----------------------------------------------------------------------------------

    def _loop(self, signals: StopSignals, log: MetricsLog, board, progress: Progress, flops_per_token: float,
              peak: float) -> None:
        cfg = self.config.train
        rollouts = MetricsLog(self.run_dir / "rollouts.jsonl", self.position) if self.primary else None
        try:
            if self.position == 0:
                self.save(force=True)                            # policy step 0 can be restored like the others
                self._periodic_evaluation(log, board, progress)  # the policy before RL too
            while self.position < cfg.steps and signals.received is None:
                try:
                    groups, record = self.rl_step()
                    self.position += 1
                    if rollouts is not None:
                        for line in rollout_records(groups, self.position - 1):
                            rollouts.write(line)
                    self._log_step(record, log, board, progress)
                    self._periodic_evaluation(log, board, progress)
                except StopRequested:        # a signal inside a reward or environment call: the rest is dropped
                    break
                if self.checkpoints.due(self.position):
                    self.save(force=True)
        finally:
            if rollouts is not None:
                rollouts.close()

    # -- evaluation --------------------------------------------------------------------------------

    def evaluate(self, signals: StopSignals | None = None) -> dict:
        """Greedy completions of the first ``rl.eval_prompts`` held-out prompts: their mean reward and
        the fraction with reward >= ``rl.pass_threshold``."""
        count = self.config.rl.eval_prompts
        prompts = self.data.heldout(count) if count else []
        if not prompts or (signals is not None and signals.received):
            return {}
        groups = self._rollout().sample(prompts, 1, seed=0, greedy=True)
        rewards = np.array([group[0].reward for group in groups])
        return {"heldout_reward": float(rewards.mean()),
                "heldout_pass": float(np.mean(rewards >= self.config.rl.pass_threshold)),
                "heldout_prompts": len(prompts)}
