"""An offline byte-level tokenizer (tokenizer.json) that transformers and vLLM load without a hub.

Byte-level BPE without merges: three special tokens, then one token per byte, so any text
round-trips. This is the layout transformers' own Qwen2 tokenizer class rebuilds from a
tokenizer.json, so `AutoTokenizer` gives the same ids for llama and qwen2 checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
BYTE_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values (the ByteLevel alphabet)."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    table = dict(zip(printable, codes, strict=True))
    return [chr(table[byte]) for byte in range(256)]


def vocabulary() -> dict[str, int]:
    tokens = [*SPECIAL_TOKENS, *byte_symbols()]
    return {token: index for index, token in enumerate(tokens)}


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    if vocab_size < BYTE_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {BYTE_VOCAB_SIZE} for the byte-level tokenizer")
    added = [
        {
            "id": i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocabulary(),
            "merges": [],
        },
    }
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer, indent=1, ensure_ascii=False))
    config = {
        "tokenizer_class": "TokenizersBackend",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<unk>",
        "model_max_length": 256,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
