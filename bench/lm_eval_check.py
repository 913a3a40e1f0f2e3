"""lm-evaluation-harness through `eval.serve` against the model's own log-likelihoods: a local
multiple-choice task (``configs/lm_eval/k3_digits``) scored here without lm-eval or the server.

For each question: the prompt is K3's chat format as `k3jax.inference.chat` renders a user turn and the
assistant's generation prompt with the run's chat settings; each choice is tokenized with the run's
tokenizer; one full forward of the model over prompt + choice (no session store, no cache) gives
the choice's log-likelihood, the sum of the log-softmax of its tokens; the answer is the argmax
(acc), or the argmax of the log-likelihood per character of the choice (acc_norm, as lm-eval).
Then the same numbers are read from lm-eval's output (``--output_path`` with ``--log_samples``):
its acc and acc_norm and, per question and choice, its log-likelihood; the table shows both
accuracies and the largest per-choice |difference| of log-likelihood. The task's ``doc_to_text``
(its marker names read as the markers, as the server's /tokenize reads them) must give the
renderer's prompt ids, and each sample's context the task's text: else the check stops.

Neither torch nor lm_eval is imported: lm-eval's results and samples files are read as JSON.

    lm_eval --model local-completions --model_args base_url=http://127.0.0.1:8123/v1/completions,model=chat,\\
        tokenizer_backend=remote,tokenized_requests=True --tasks k3_digits --include_path configs/lm_eval \\
        --output_path OUT --log_samples              # against python -m eval.serve RUN_DIR --port 8123
    python -m bench.lm_eval_check RUN_DIR --lm-eval-output OUT [--task-dir configs/lm_eval/k3_digits] \\
        [--out CHECK.json]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from bench.common import table, write_json
from k3jax.inference import InputError, load_run
from k3jax.inference.chat import chat_turns_for

QUESTION = "{{question}}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the run lm-eval's server served (a run trained with data.kind=chat)")
    parser.add_argument("--task-dir", default="configs/lm_eval/k3_digits", help="the lm-eval task's directory")
    parser.add_argument("--lm-eval-output", required=True,
                        help="lm_eval's --output_path: the newest results_*.json and samples_<task>_*.jsonl under it")
    parser.add_argument("--out", default=None, help="write the numbers here as JSON")
    return parser.parse_args(argv)


def read_task(task_dir: pathlib.Path) -> tuple[dict, list[dict]]:
    """The task YAML (the one file in ``task_dir`` with a ``task:`` key) and its questions (the
    JSONL its ``data_files`` name, found from the current directory or else beside the YAML)."""
    configs = [yaml.safe_load(path.read_text()) for path in sorted(task_dir.glob("*.yaml"))]
    configs = [config for config in configs if isinstance(config, dict) and "task" in config]
    if len(configs) != 1:
        raise SystemExit(f"{task_dir}: expected one task YAML, found {len(configs)}")
    task = configs[0]
    data_files = task["dataset_kwargs"]["data_files"]
    path = pathlib.Path(data_files[task["test_split"]] if isinstance(data_files, dict) else data_files)
    if not path.is_file():
        path = task_dir / path.name
    docs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return task, docs


def lm_eval_files(output: pathlib.Path, task: str) -> tuple[pathlib.Path, pathlib.Path]:
    """The newest results JSON and samples JSONL of ``task`` under lm-eval's output path."""
    newest = lambda paths: max(paths, key=lambda path: path.stat().st_mtime) if paths else None
    results = newest(list(output.rglob("results_*.json")))
    samples = newest(list(output.rglob(f"samples_{task}_*.jsonl")))
    if results is None or samples is None:
        raise SystemExit(f"{output}: no results_*.json or samples_{task}_*.jsonl (run lm_eval with --output_path "
                         f"and --log_samples)")
    return results, samples


def sample_arguments(sample: dict) -> list[tuple[str, str]]:
    """A samples record's (context, continuation) per choice: lm-eval writes them as a dict
    ``{"gen_args_I": {"arg_0": context, "arg_1": continuation}}`` (0.4.13 does) or as a list
    of pairs (older versions)."""
    arguments = sample["arguments"]
    if isinstance(arguments, dict):
        return [(entry["arg_0"], entry["arg_1"]) for _, entry in
                sorted(arguments.items(), key=lambda item: int(item[0].rpartition("_")[2]))]
    return [tuple(pair[:2]) for pair in arguments]


def encode_with_markers(text: str, tokenizer) -> list[int]:
    """``text`` with the tokenizer's special token names read as those tokens (as `eval.serve`'s
    /tokenize and Hugging Face tokenizers do)."""
    specials = tokenizer.special_tokens
    pattern = "(" + "|".join(map(re.escape, sorted(specials, key=len, reverse=True))) + ")"
    ids = []
    for piece in re.split(pattern, text):
        ids += [specials[piece]] if piece in specials else list(tokenizer.encode(piece)) if piece else []
    return ids


def log_likelihoods(model, contexts: list[np.ndarray], choices: list[list[int]]) -> np.ndarray:
    """``[questions, choices]``: the sum of log-softmax of each choice's tokens after its context,
    from one full forward over context + choice (one jitted program per length)."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def token_log_probs(state, tokens):
        logits = nnx.merge(graphdef, state)(tokens[None]).logits[0]
        log_probs = jax.nn.log_softmax(logits[:-1], axis=-1)
        return jnp.take_along_axis(log_probs, tokens[1:, None], axis=-1)[:, 0]

    scores = np.zeros((len(contexts), len(choices)))
    for q, context in enumerate(contexts):
        for c, choice in enumerate(choices):
            tokens = np.concatenate([context, np.asarray(choice, context.dtype)]).astype(np.int32)
            per_token = np.asarray(token_log_probs(state, tokens), np.float64)
            scores[q, c] = per_token[len(context) - 1:].sum()
    return scores


class Questions(NamedTuple):
    """The task's questions as the model reads them: lm-eval's prompt template, the choices' texts
    and token ids (after the task's delimiter), each question's chat prompt ids and answer."""

    template: str
    delimiter: str
    choice_texts: list[str]
    choices: list[list[int]]
    contexts: list[np.ndarray]
    answers: np.ndarray


def questions_of(task: dict, docs: list[dict], chat) -> Questions:
    """The `Questions` of ``docs``, checked: every question has the same choices, and the task's
    ``doc_to_text`` gives exactly the chat renderer's prompt."""
    template = task["doc_to_text"]
    choice_texts = [list(doc["choices"]) for doc in docs]
    if any(texts != choice_texts[0] for texts in choice_texts):
        raise SystemExit("every question must have the same choices")
    delimiter = task.get("target_delimiter", " ")     # lm-eval's default; this task's is ""
    contexts = []
    for doc in docs:
        ids = chat.user_turn(doc["question"])
        if encode_with_markers(template.replace(QUESTION, doc["question"]), chat.tokenizer) != ids.tolist():
            raise SystemExit(f"the task's doc_to_text does not give the chat renderer's prompt for {doc['question']!r}")
        contexts.append(ids)
    choices = [list(chat.tokenizer.encode(delimiter + text)) for text in choice_texts[0]]
    return Questions(template, delimiter, choice_texts[0], choices, contexts, np.array([doc["answer"] for doc in docs]))


def lm_eval_scores(output: str, task: dict, docs: list[dict], questions: Questions) -> dict:
    """What lm-eval wrote under ``output``: its accuracies and each (question, choice)'s
    log-likelihood from its samples, checked to be the requests of the task's text."""
    results_path, samples_path = lm_eval_files(pathlib.Path(output), task["task"])
    metrics = json.loads(results_path.read_text())["results"][task["task"]]
    samples = [json.loads(line) for line in samples_path.read_text().splitlines() if line.strip()]
    if len(samples) != len(docs):
        raise SystemExit(f"{samples_path}: {len(samples)} samples for {len(docs)} questions")
    scores = np.zeros((len(docs), len(questions.choices)))
    by_question = {doc["question"]: q for q, doc in enumerate(docs)}
    for sample in samples:
        q = by_question[sample["doc"]["question"]]
        if any(context != questions.template.replace(QUESTION, docs[q]["question"])
               or continuation != questions.delimiter + text
               for (context, continuation), text in zip(sample_arguments(sample), questions.choice_texts)):
            raise SystemExit(f"{samples_path}: the requests of {docs[q]['question']!r} are not the task's text")
        scores[q] = [float(resp[0][0]) for resp in sample["resps"]]
    return {"results": results_path, "samples": samples_path, "acc": metrics["acc,none"],
            "acc_norm": metrics["acc_norm,none"], "scores": scores}


def compare(run, task: dict, questions: Questions, lm: dict, direct: np.ndarray, forward_seconds: float,
            out: str | None) -> bool:
    """Print lm-eval's scores beside the direct ones (and write them to ``out``): whether they agree."""
    answers, lm_scores = questions.answers, lm["scores"]
    choice_chars = np.array([len(text) for text in questions.choice_texts])
    direct_acc = float(np.mean(direct.argmax(1) == answers))
    direct_acc_norm = float(np.mean((direct / choice_chars).argmax(1) == answers))
    sample_acc = float(np.mean(lm_scores.argmax(1) == answers))
    delta = np.abs(lm_scores - direct)
    disagreements = int(np.sum(lm_scores.argmax(1) != direct.argmax(1)))
    print(f"{run.run_dir} step {run.step}; {len(answers)} questions x {len(questions.choices)} choices; "
          f"lm-eval: {lm['results']}")
    print(table(["scored by", "acc", "acc_norm"], [
        ["lm-eval (local-completions, eval.serve)", f"{lm['acc']:.4f}", f"{lm['acc_norm']:.4f}"],
        ["direct (full forward here)", f"{direct_acc:.4f}", f"{direct_acc_norm:.4f}"],
    ]))
    print(f"max |delta log-likelihood| over {delta.size} (question, choice) pairs: {delta.max():.3g} nats "
          f"(mean {delta.mean():.3g}); argmax disagreements: {disagreements}; direct forwards {forward_seconds:.1f} s")
    same = lm["acc"] == direct_acc and lm["acc_norm"] == direct_acc_norm and sample_acc == direct_acc
    print("match" if same else "MISMATCH")
    if out:
        write_json(out, {
            "run_dir": str(run.run_dir), "step": run.step, "task": task["task"], "questions": len(answers),
            "choices": questions.choice_texts, "lm_eval_results": str(lm["results"]),
            "lm_eval_samples": str(lm["samples"]),
            "lm_eval": {"acc": lm["acc"], "acc_norm": lm["acc_norm"], "acc_from_samples": sample_acc},
            "direct": {"acc": direct_acc, "acc_norm": direct_acc_norm, "forward_seconds": forward_seconds},
            "max_abs_delta_loglikelihood": float(delta.max()), "mean_abs_delta_loglikelihood": float(delta.mean()),
            "argmax_disagreements": disagreements, "match": same,
        })
    return same


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    task, docs = read_task(pathlib.Path(args.task_dir))
    try:
        run = load_run(args.run_dir)
    except InputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    chat = chat_turns_for(run.config)
    if chat is None:
        print(f"error: {args.run_dir} has no chat format (train it with data.kind=chat)", file=sys.stderr)
        return 2
    questions = questions_of(task, docs, chat)
    start = time.perf_counter()
    direct = log_likelihoods(run.model, questions.contexts, questions.choices)
    forward_seconds = time.perf_counter() - start
    lm = lm_eval_scores(args.lm_eval_output, task, docs, questions)
    return 0 if compare(run, task, questions, lm, direct, forward_seconds, args.out) else 1


if __name__ == "__main__":
    sys.exit(main())
