"""The tiny language models' corpus: sentences from a small grammar with Zipf-skewed word choices.

Skewed choices make greedy text stable (the most likely word wins by a margin, so a harmless
perturbation does not flip it) while leaving enough entropy that perplexity measures the model.
Deterministic: the same seed gives the same bytes on every machine (random.Random, no numpy).
"""

from __future__ import annotations

import random

from harness.checkpoints.tokenizer import SPECIAL_TOKENS

BYTE_OFFSET = len(SPECIAL_TOKENS)  # token id = byte value + BYTE_OFFSET (harness/checkpoints/tokenizer.py)

WORDS = {
    "det": ["the", "a", "every", "one", "that"],
    "adj": ["old", "small", "green", "quiet", "bright", "heavy", "cold", "round"],
    "noun": ["cat", "river", "farmer", "stone", "bird", "lamp", "window", "garden", "horse", "letter"],
    "verb": ["sees", "finds", "carries", "follows", "watches", "opens", "likes", "moves"],
    "prep": ["near", "under", "behind", "over", "beside"],
    "adv": ["slowly", "again", "today", "quietly", "often"],
}
TEMPLATES = [
    ("det", "noun", "verb", "det", "noun"),
    ("det", "adj", "noun", "verb", "det", "noun"),
    ("det", "noun", "verb", "det", "adj", "noun", "prep", "det", "noun"),
    ("det", "adj", "noun", "verb", "adv"),
    ("det", "noun", "prep", "det", "noun", "verb", "det", "noun"),
]
ZIPF_EXPONENT = 1.6
TRAIN_SEED, HELDOUT_SEED = 0, 1

#: fixed prompts whose greedy continuations are golden
PROMPTS = ["the old ", "a small bird ", "every farmer sees ", "the cat near the ", "one green lamp "]


def zipf_weights(count: int) -> list[float]:
    return [1.0 / (rank + 1) ** ZIPF_EXPONENT for rank in range(count)]


def sentences(seed: int):
    """An endless, deterministic stream of sentences."""
    rng = random.Random(seed)
    template_weights = zipf_weights(len(TEMPLATES))
    weights = {part: zipf_weights(len(words)) for part, words in WORDS.items()}
    while True:
        template = rng.choices(TEMPLATES, template_weights)[0]
        words = [rng.choices(WORDS[part], weights[part])[0] for part in template]
        yield " ".join(words) + ". "


def text(seed: int, size: int) -> str:
    """At least `size` characters of corpus, whole sentences."""
    parts, length = [], 0
    for sentence in sentences(seed):
        parts.append(sentence)
        length += len(sentence)
        if length >= size:
            return "".join(parts)
    raise AssertionError("unreachable")


def encode(string: str) -> list[int]:
    return [byte + BYTE_OFFSET for byte in string.encode("utf-8")]


def decode(ids: list[int]) -> str:
    return bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256).decode("utf-8", "replace")


def heldout_sequences(count: int = 8, length: int = 128) -> list[list[int]]:
    """The held-out slice perplexity is measured on: a corpus stream the training never saw."""
    ids = encode(text(HELDOUT_SEED, count * length + 1))
    return [ids[i * length : (i + 1) * length] for i in range(count)]
