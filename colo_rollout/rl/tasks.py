"""The verifiable tasks the RL loop trains on: prompts and their rewards, typed by task.

Owns ``task_for(rl, vocab_size)`` -> a ``Task`` (``rl.task``): ``prompt(rng)`` draws a prompt,
``reward(prompt, completion)`` scores a completion in [0, 1]. The longest prompt each draws is
``RLConfig.longest_prompt`` (the door holds it to the engine). Deterministic functions of their
inputs (every rank computes the same rewards: rl/rollout.py).

  * ``TargetToken``: reward = the share of generated tokens equal to ``rl.target_token`` --
    learnt from one token's logit, in seconds.
  * ``Reverse``: the prompt is ``rl.reverse_len`` symbols (ids 1 .. ``rl.reverse_alphabet``)
    and a separator (id ``rl.reverse_alphabet + 1``); the completion must be the symbols
    reversed; reward = the share of positions right. The policy has to read the prompt at a
    position that moves with each output token: several tokens' worth of attention to learn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class TargetToken:
    vocab_size: int
    target: int
    prompt_len_max: int

    def prompt(self, rng: random.Random) -> list[int]:
        return [rng.randrange(1, self.vocab_size) for _ in range(rng.randint(2,
                                                                            self.prompt_len_max))]

    def reward(self, prompt: list[int], completion: list[int]) -> float:
        return sum(t == self.target for t in completion) / max(len(completion), 1)


@dataclass(frozen=True)
class Reverse:
    length: int
    alphabet: int

    @property
    def separator(self) -> int:
        return self.alphabet + 1

    def prompt(self, rng: random.Random) -> list[int]:
        return [rng.randint(1, self.alphabet) for _ in range(self.length)] + [self.separator]

    def reward(self, prompt: list[int], completion: list[int]) -> float:
        want = list(reversed(prompt[: self.length]))
        return sum(a == b for a, b in zip(completion, want)) / self.length


def task_for(rl, vocab_size: int):
    """The task ``rl.task`` names, from its keys (RLConfig)."""
    if rl.task == "reverse":
        return Reverse(rl.reverse_len, rl.reverse_alphabet)
    return TargetToken(vocab_size, rl.target_token, rl.prompt_len_max)
