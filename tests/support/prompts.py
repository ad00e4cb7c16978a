"""Prompts and expected positions shared by the engine tests of selections and returns."""

from __future__ import annotations

import random


def shared_prefix_prompts(vocab: int, n: int, seed: int, shared: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(20 + 9 * i)] for i in range(n)]


def expected_positions(mode, prompt_len: int, fed_len: int) -> list[int]:
    every = range(fed_len)
    if mode == "all":
        return list(every)
    if mode == "prompt":
        return [p for p in every if p < prompt_len]
    if mode == "generated":
        return [p for p in every if p >= prompt_len]
    if mode == "last_prompt":
        return [prompt_len - 1]
    if mode == "last":
        return [fed_len - 1]
    return [p for p in mode if p < fed_len]
