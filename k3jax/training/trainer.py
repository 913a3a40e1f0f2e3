"""One training run: set up (or resume), train, checkpoint, evaluate.

    Trainer(config).run() -> summary dict

The run directory holds ``config.yaml`` (the resolved config), ``checkpoints/`` (Orbax),
``metrics.jsonl``, ``summary.json`` and, when enabled, ``tensorboard/``. If it already holds a
checkpoint the run resumes from the latest one exactly: the state is restored bit for bit and
the data continues at the saved position (batches are a pure function of the data seed and the
step). ``init_from`` starts a fresh run from another run's parameters (fine-tuning). Where the
state comes from is `k3jax.training.resume`; the held-out scores are `k3jax.training.evaluation`.

SIGTERM and SIGINT finish the current step, save a checkpoint and end the run cleanly; during the
start (see `StopSignals`) they end it before anything is written.

The state lives on the device mesh of ``config.mesh`` (`k3jax.sharding`), and a checkpoint
restores onto whatever mesh the resuming run has. With several processes each one feeds its own
rows of every batch and writes its shards of each checkpoint; only process 0 writes
``config.yaml``, ``summary.json`` and ``metrics.jsonl`` (process p: ``metrics.process<p>.jsonl``).
"""
from __future__ import annotations

import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from k3jax.checkpoint import RunCheckpoints
from k3jax.checkpoint import CheckpointError, restore_subtree
from k3jax.config import PREFERENCE_OBJECTIVES, Config, ConfigError, to_dict
from k3jax.data import make_dataset
from k3jax.data.prefetch import Prefetcher
from k3jax.flops import measured_peak_flops, training_flops
from k3jax.host import enable_compilation_cache
from k3jax.sharding import compiled_together, global_batch, process_rows
from k3jax.training.evaluation import HeldOutScores, byte_lengths_of, check_heldout, log_evaluation
from k3jax.training.finetune import BASE_META
from k3jax.training.layout import lay_out_run
from k3jax.training.metrics import MetricsLog, Progress, TensorBoard, jsonable
from k3jax.training.resume import start_run
from k3jax.disk import write_atomically
from k3jax.training.run_dir import RunError, RunLock, prepare_run_dir, remove_if_empty
from k3jax.training.signals import StopSignals
from k3jax.training.steps import make_eval_step, make_train_step


TRAINER_OF = {"lm": "k3jax.training.Trainer", "grpo": "k3jax.training.RLTrainer",
              **{kind: "k3jax.training.PreferenceTrainer" for kind in PREFERENCE_OBJECTIVES}}


class Trainer:
    """Builds everything a run needs from its `Config` (``train.objective=lm``; `RLTrainer` runs ``grpo``,
    `PreferenceTrainer` the preference objectives: `TRAINER_OF`)."""

    objectives = ("lm",)

    def __init__(self, config: Config, signals: StopSignals | None = None):
        """``signals``: the caller's `StopSignals`, checked between the phases of the start (a signal
        there raises `StopRequested` and writes nothing) and between steps (else `run` installs its own)."""
        self.config = config
        self.signals = signals
        self.primary = jax.process_index() == 0   # holds the lock; writes config.yaml, summary.json, metrics.jsonl
        created = not pathlib.Path(config.run_dir).expanduser().exists()
        self.run_dir = prepare_run_dir(config.run_dir)
        self._lock = RunLock(self.run_dir) if self.primary else None
        try:
            self._set_up()
        except BaseException:
            self.close()
            if created and self.primary:
                remove_if_empty(self.run_dir)
            raise

    def close(self) -> None:
        """Release the run directory (the trainer cannot be used afterwards)."""
        if self._lock:
            self._lock.release()

    def _stop_point(self) -> None:
        if self.signals is not None:
            self.signals.check()

    def _set_up(self) -> None:
        config = self.config
        if config.train.objective not in self.objectives:
            raise ConfigError("train.objective", f"{config.train.objective} runs with {TRAINER_OF[config.train.objective]}")
        enable_compilation_cache(config.train.compilation_cache)
        if config.logging.tensorboard and self.primary:
            try:
                import tensorboardX  # noqa: F401
            except ImportError:
                raise ConfigError("logging.tensorboard", "needs tensorboardX: pip install 'k3jax[tensorboard]'") from None
        self.data = make_dataset(config.data)
        self.data_hash = self.data.content_hash()   # saved with each checkpoint, checked on resume
        self._check_data()
        self._stop_point()
        if self.data.vocab_size > config.model.vocab_size:
            raise ConfigError("model.vocab_size", f"{config.model.vocab_size} is smaller than the data's "
                                                  f"vocabulary ({self.data.vocab_size} tokens)")
        check_heldout(config, self.data)
        # Shapes and their layout on the device mesh first; the state itself is then created or
        # restored shard by shard, where it lives.
        layout = lay_out_run(config)
        self.mesh, self.parts = layout.mesh, layout.parts
        self.schedule, self.optimizer = layout.schedule, layout.optimizer
        self.abstract_state, self.shardings = layout.state, layout.shardings
        self.abstract_frozen = layout.frozen
        self.batch_rows = process_rows(self.shardings.batch, self.batch_size)
        self.checkpoints = RunCheckpoints(self.run_dir / "checkpoints", keep=config.checkpoint.keep,
                                          every=config.checkpoint.every, async_save=config.checkpoint.async_save)
        self._last_evaluation = (None, {})   # (step, result) of the latest periodic evaluation
        self.byte_lengths = byte_lengths_of(self.data)
        self._stop_point()
        # position: batches consumed; frozen, base: a LoRA run's base, its arrays and where they came from
        self.state, self.position, self.resumed_from, self.frozen, self.base = start_run(
            config, layout, self.checkpoints, self.data_hash, self.run_dir, self.primary)
        self._stop_point()
        if self.primary:
            write_atomically(self.run_dir / "config.yaml", yaml.safe_dump(to_dict(config), sort_keys=False))
        self.frozen_args = () if self.frozen is None else (self.frozen,)
        self._build_steps()

    def _check_data(self) -> None:
        """What the objective needs of the data, checked before anything is computed."""

    @property
    def batch_size(self) -> int:
        """Rows of each global batch."""
        return self.config.train.batch_size

    def _build_steps(self) -> None:
        """The jitted programs of the run: its train step and eval step."""
        config = self.config
        # Several processes start each program together: gloo's collectives wait only 30 s for a peer.
        self.train_step = compiled_together(
            make_train_step(self.parts, self.optimizer, accumulation=config.train.grad_accum, schedule=self.schedule,
                            shardings=self.shardings, dropout_seed=config.train.seed), "train step")
        self.eval_step = compiled_together(make_eval_step(self.parts, self.shardings), "eval step")

    def _reference_params(self):
        """The reference policy's parameters (GRPO's KL penalty, DPO): None for LoRA (the frozen base:
        the adapters set to zero, `_reference_logprobs`), else ``init_from``'s, restored once more."""
        if self.base is not None:
            return None
        source = pathlib.Path(self.config.init_from).expanduser()
        try:
            params, _ = restore_subtree(source, "params", self.abstract_state.params)
        except CheckpointError as error:
            raise CheckpointError(f"init_from={source}: {error}") from None
        return params

    def _reference_logprobs(self, batch) -> jax.Array:
        """The reference policy's log-prob of each target of ``batch`` (``self.logprob_step``,
        `k3jax.training.grpo.make_logprob_step`, at ``self.reference`` or zero adapters)."""
        params = self.reference if self.reference is not None else jax.tree.map(jnp.zeros_like, self.state.params)
        return self.logprob_step(params, self.state.buffers, batch, *self.frozen_args)

    # -- checkpoints ---------------------------------------------------------------------------

    def _meta(self) -> dict:
        meta = {"config": to_dict(self.config), "data_position": self.position,
                "data": self.data.describe(), "data_hash": self.data_hash, "optimizer_step": int(self.state.step),
                "jax_version": jax.__version__}
        return meta if self.base is None else {**meta, BASE_META: self.base}

    def save(self, force: bool = False) -> None:
        """Save at the current position when due (or ``force``), unless it is saved already; raises
        `CheckpointError` as soon as an earlier asynchronous save is known to have failed."""
        self.checkpoints.check()
        if self.checkpoints.latest_step() != self.position:
            self.checkpoints.save(self.position, self.state, self._meta(), force=force)

    # -- loop ----------------------------------------------------------------------------------

    def _host_batch(self, step: int, split: str = "train"):
        """This process's block of rows of global batch ``step``."""
        index, count = self.batch_rows
        return self.data.batch(step, self.batch_size, split, process_index=index, process_count=count)

    def _device_batch(self, rows):
        """The global batch assembled from every process's block of ``rows``."""
        return global_batch(rows, self.shardings.batch, self.batch_size)

    def run(self) -> dict:
        """Train to ``train.steps`` (or until SIGTERM/SIGINT), save, evaluate; releases the run directory."""
        try:
            if self.signals is None:
                with StopSignals() as signals:
                    return self._run(signals)
            return self._run(self.signals)
        finally:
            self.close()

    def _run(self, signals: StopSignals) -> dict:
        cfg = self.config.train
        log_name = "metrics.jsonl" if self.primary else f"metrics.process{jax.process_index()}.jsonl"
        log = MetricsLog(self.run_dir / log_name, self.position)
        board = TensorBoard(self.run_dir / "tensorboard") if self.config.logging.tensorboard and self.primary else None
        progress = Progress(self.config.logging.progress, self.position, cfg.steps, cfg.log_every)
        flops_per_token = training_flops(self.config.model, self.config.data.seq_len).total
        peak = (self.config.logging.peak_tflops * 1e12 if self.config.logging.peak_tflops
                else measured_peak_flops(self.config.model.compute_dtype))
        if self.resumed_from is not None:
            progress.write(f"resumed from checkpoint {self.resumed_from} in {self.run_dir}")
        started = time.perf_counter()
        first = self.position
        self._loop(signals, log, board, progress, flops_per_token, peak)
        if self.position != first:
            self.save(force=True)
        self.checkpoints.wait()
        progress.close()
        log.close()
        if board:
            board.close()
        elapsed = time.perf_counter() - started
        summary = {"step": self.position, "train_seconds": elapsed, "devices": jax.device_count()}
        if signals.received is None:
            evaluated_step, result = self._last_evaluation
            summary.update(result if evaluated_step == self.position else self.evaluate(signals))
        stopped_by = signals.received
        if stopped_by:
            saved = (f"saved checkpoint {self.position} in {self.run_dir / 'checkpoints'}" if self.position != first
                     else "stopped before the first step, nothing to save")
            print(f"{stopped_by} received: {saved}; run again to resume", flush=True)
            return {"stopped_by": stopped_by, "step": self.position}
        if self.primary:
            write_atomically(self.run_dir / "summary.json", json.dumps(jsonable(summary), indent=2, allow_nan=False))
        return summary

    def _loop(self, signals: StopSignals, log: MetricsLog, board, progress: Progress, flops_per_token: float,
              peak: float) -> None:
        """The steps, their batches read ahead (the prefetch thread also moves each onto the devices)."""
        read_batch = lambda step: self._device_batch(self._host_batch(step))  # noqa: E731
        with Prefetcher(read_batch, self.position, self.config.train.steps, self.config.data.prefetch) as batches:
            self._train_loop(batches, signals, log, board, progress, flops_per_token, peak)

    def _train_loop(self, batches: Prefetcher, signals: StopSignals, log: MetricsLog, board, progress: Progress,
                    flops_per_token: float, peak: float) -> None:
        """Steps from ``self.position`` to ``train.steps`` (or a signal), each logged, evaluated and saved when due.

        The loop runs one step ahead of its metrics: step n + 1 is dispatched before step n's
        metrics are read (JAX dispatches asynchronously), so the host's work between steps --
        reading the metrics, logging, dispatching the next program -- overlaps the device's.
        Where step n's state itself is needed (an evaluation or a checkpoint due at n, the last
        step, a stop signal), step n is finished before anything else is dispatched."""
        cfg = self.config.train
        tokens_per_step = self.batch_size * self.config.data.seq_len
        last_finished = [time.perf_counter()]

        def finish(step: int, metrics) -> None:
            """Read step ``step``'s metrics (waiting for it) and log them."""
            metrics = jax.device_get(metrics)
            now = time.perf_counter()
            tokens_per_second = tokens_per_step / max(now - last_finished[0], 1e-9)
            last_finished[0] = now
            self._log_step(self._record(step, metrics, tokens_per_second, flops_per_token, peak), log, board, progress)

        pending = None   # (step, metrics) of the step dispatched last, not yet read
        while self.position < cfg.steps and signals.received is None:
            self.state, metrics = self.train_step(self.state, next(batches), *self.frozen_args)
            self.position += 1
            if pending is not None:
                finish(*pending)
            pending = (self.position, metrics)
            evaluation_due = bool(cfg.eval_every) and self.position % cfg.eval_every == 0
            save_due = self.checkpoints.due(self.position)
            if evaluation_due or save_due or self.position >= cfg.steps or signals.received is not None:
                finish(*pending)
                pending = None
                self._periodic_evaluation(log, board, progress)   # before the save: a checkpoint's evaluation is logged
                if save_due:
                    self.save(force=True)
        if pending is not None:
            finish(*pending)

    def _log_step(self, record: dict, log: MetricsLog, board, progress: Progress) -> None:
        """Log one step's record; stop the run after ``train.max_nonfinite_steps`` non-finite steps in a row."""
        cfg = self.config.train
        step = record["step"]
        if record["skipped"]:
            progress.write(f"step {step}: non-finite loss ({record['loss']}), gradient norm "
                           f"({record['grad_norm']}) or updated parameters; update skipped")
            if record["skipped_in_a_row"] >= cfg.max_nonfinite_steps:
                log.write(record)
                raise RunError(f"{record['skipped_in_a_row']} non-finite steps in a row at step {step}; "
                               f"stopping (lower optimizer.learning_rate or check the data); "
                               f"last checkpoint: {self.checkpoints.latest_step()}")
        if step % cfg.log_every == 0 or step == cfg.steps or record["skipped"]:
            log.write(record)
            if board:
                board.write(record)
        progress.update(1, record["loss"], record["tokens_per_second"])

    def _record(self, step: int, metrics: dict, tokens_per_second: float, flops_per_token: float,
                peak: float) -> dict:
        record = {"step": step, "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
                  "learning_rate": float(metrics["learning_rate"]), "tokens_per_second": tokens_per_second,
                  "model_tflops": tokens_per_second * flops_per_token / 1e12,
                  "utilization": tokens_per_second * flops_per_token / peak,
                  "skipped": not bool(metrics["finite"]), "skipped_in_a_row": int(metrics["skipped"])}
        for name in ("expert_load_max_over_mean", "experts_idle_fraction", "moe_dropped_assignments"):
            if name in metrics:
                record[name] = np.asarray(metrics[name]).tolist()
        return record

    # -- evaluation ----------------------------------------------------------------------------

    def evaluate(self, signals: StopSignals | None = None) -> dict:
        """Held-out loss over ``train.eval_batches`` batches (cut short by a signal), and on text, token
        shards and chat its bits per byte (over the loss mask's targets), on MQAR the recall. Batch ``i``
        of every evaluation is held-out batch ``i`` (rows the training batches never see), so
        evaluations of the same state are equal.

            heldout_loss = Σ NLL / scored tokens;   heldout_bits_per_byte = Σ NLL / ln 2 / scored bytes
        """
        batches = self.config.train.eval_batches
        if not batches:
            return {}
        scores = HeldOutScores(self.data, self.config.train.batch_size, self.byte_lengths)
        for index in range(batches):
            if signals is not None and signals.received:
                break
            batch = self._device_batch(self._host_batch(index, split="heldout"))
            scores.add(index, *self.eval_step(self.state.params, self.state.buffers, batch, *self.frozen_args))
        return scores.result()

    def _periodic_evaluation(self, log: MetricsLog, board, progress: Progress) -> None:
        """Every ``train.eval_every`` steps: evaluate, write an ``{"kind": "eval"}`` record, log a line."""
        every = self.config.train.eval_every
        if not every or self.position % every:
            return
        result = self.evaluate()
        self._last_evaluation = (self.position, result)
        log_evaluation(self.position, result, log, board, progress)
