"""Samples from fixed prompts (`k3jax.inference.generation.generate`), one set per seed.

Prompts follow the run's data: for text runs the fixed `TEXT_PROMPTS` in the run's tokenizer (EOS
ends a sample); for chat runs the same texts as one user turn each in K3's chat format, followed by
the generation prompt (``<|end_of_msg|>`` ends a sample); for MQAR runs the first ``mqar_prompts`` held-out rows cut just after their first
query key, so the right continuation is the value bound to that key. Sampling: temperature and
top-p of the definition, the seed as the sampling seed. Per seed the task reports the mean sample
length, the fraction of distinct tokens in a sample and, for MQAR prompts, how often the first
sampled token is the bound value.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar, NamedTuple

import numpy as np

from k3jax.data import DataError, MQARDataset, load_tokenizer
from k3jax.flops import decode_flops, forward_flops
from k3jax.inference.chat import ChatTurns
from k3jax.inference.generation import generate

from ..stats import t_interval
from .common import TaskOutput, TaskSkipped, canonical_json, require_vocabulary, sha256_text
from .mqar import base_mqar_dataset

TEXT_PROMPTS = ("The capital of France is", "Once upon a time, there was a", "def fibonacci(n):\n")


class Prompt(NamedTuple):
    tokens: np.ndarray          # [T] int32
    shown: str                  # the prompt as a reader sees it
    expected: int | None        # the right next token (MQAR), or None


class PromptSet(NamedTuple):
    prompts: list[Prompt]
    render: Callable[[list[int]], str]   # token ids -> what a reader sees
    eos_id: int | None
    vocab_size: int


def mqar_prompts(dataset: MQARDataset, count: int) -> PromptSet:
    """Held-out rows up to and including their first query key; expected: its bound value."""
    first_query = int(dataset.answer_positions[0])
    prompts = []
    for index in range(count):
        row = dataset.row(index, "heldout")
        prompts.append(Prompt(row[: first_query + 1], " ".join(map(str, row[: first_query + 1])),
                              int(row[first_query + 1])))
    return PromptSet(prompts, lambda ids: " ".join(map(str, ids)), None, dataset.vocab_size)


def text_prompts(tokenizer, texts: tuple[str, ...]) -> PromptSet:
    prompts = [Prompt(np.asarray(tokenizer.encode(text), np.int32), text, None) for text in texts]
    return PromptSet(prompts, tokenizer.decode, tokenizer.eos_id, tokenizer.vocab_size)


def chat_prompts(data_config, texts: tuple[str, ...]) -> PromptSet:
    """Each text as a user turn, rendered with the run's chat settings and ending in the generation prompt
    (`k3jax.inference.chat`); a sample is shown decoded, without the ids beyond the tokenizer's vocabulary
    that a model with a larger embedding can sample."""
    turns = ChatTurns(load_tokenizer(data_config.tokenizer), data_config.chat_thinking, data_config.chat_thinking_effort)
    prompts = [Prompt(turns.user_turn(text), text, None) for text in texts]
    return PromptSet(prompts, turns.decode, turns.eos_id, turns.tokenizer.vocab_size)


@dataclasses.dataclass(frozen=True)
class SamplesTask:
    """Sampled continuations of fixed prompts, one set per seed."""

    name: ClassVar[str] = "samples"
    text_prompts: tuple[str, ...] = TEXT_PROMPTS
    mqar_prompts: int = 3
    max_new_tokens: int = 32
    temperature: float = 0.8
    top_p: float = 0.95

    def _prompt_set(self, config) -> PromptSet:
        try:
            if config.data.kind == "mqar":
                return mqar_prompts(base_mqar_dataset(config), self.mqar_prompts)
            if config.data.kind == "chat":
                return chat_prompts(config.data, self.text_prompts)
            return text_prompts(load_tokenizer(config.data.tokenizer), self.text_prompts)
        except DataError as error:
            raise TaskSkipped(str(error)) from None

    def run(self, context, cost, progress) -> TaskOutput:
        config = context.config.model
        prompt_set = self._prompt_set(context.config)
        require_vocabulary(config.vocab_size, prompt_set.vocab_size, "the sample prompts")
        progress.reset(total=len(context.seeds) * len(prompt_set.prompts))
        examples, lengths, distinct, correct = [], [], [], []
        for seed in context.seeds:
            seed_lengths, seed_distinct, seed_correct = [], [], []
            for prompt in prompt_set.prompts:
                out = generate(context.model, prompt.tokens, max_new_tokens=self.max_new_tokens,
                               temperature=self.temperature, top_p=self.top_p, seed=seed, eos_id=prompt_set.eos_id)
                new = np.asarray(out.tokens)[: int(out.lengths)]
                context_length = prompt.tokens.size + self.max_new_tokens
                cost.add(prompt.tokens.size, forward_flops(config, prompt.tokens.size).total)
                cost.add(new.size, decode_flops(config, context_length).total)
                seed_lengths.append(new.size)
                seed_distinct.append(np.unique(new).size / new.size)
                if prompt.expected is not None:
                    seed_correct.append(float(new[0] == prompt.expected))
                examples.append({"seed": seed, "prompt": prompt.shown, "continuation": prompt_set.render(new.tolist()),
                                 "expected_next": prompt.expected})
                progress.update()
            lengths.append(np.mean(seed_lengths))
            distinct.append(np.mean(seed_distinct))
            correct.append(np.mean(seed_correct) if seed_correct else None)
        row = {"prompts": len(prompt_set.prompts), "max_new_tokens": self.max_new_tokens,
               "new_tokens": t_interval(lengths), "distinct_token_fraction": t_interval(distinct)}
        if prompt_set.prompts[0].expected is not None:
            row["first_token_is_bound_value"] = t_interval(correct)
        data = {"prompts": [p.tokens.tolist() for p in prompt_set.prompts], "eos_id": prompt_set.eos_id}
        return TaskOutput([row], sha256_text(canonical_json(data)), examples)
