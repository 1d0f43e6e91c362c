"""Tolerances are data (cases/tolerances.toml); this module reads and checks them."""

from __future__ import annotations

import tomllib
from collections.abc import Iterable
from dataclasses import astuple, dataclass
from pathlib import Path

from harness.core.dtypes import MODEL_DTYPES
from harness.core.errors import HarnessError
from harness.core.paths import CASES_DIR

DEFAULT_FILE = CASES_DIR / "tolerances.toml"


@dataclass(frozen=True)
class Tolerances:
    weight_rel: float
    weight_abs: float
    logprob_max_abs_delta: float
    top_k: int
    max_topk_miss_fraction: float
    perplexity_rel: float
    #: max |delta logprob| of an engine that quantizes activations as specified, in its own arithmetic
    activation_max_abs_delta: float
    #: the same where the checkpoint quantizes the KV cache too
    activation_kv_max_abs_delta: float


def _check_keys(where: str, table: dict, allowed: set[str]) -> None:
    unknown = set(table) - allowed
    if unknown:
        raise HarnessError(f"tolerances: unknown key(s) {sorted(unknown)} in [{where}]")


def load_tolerances(format_name: str, dtype: str, path: Path = DEFAULT_FILE) -> Tolerances:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise HarnessError(f"{path}: cannot read tolerances ({error})") from None
    _check_keys("top level", data, {"weights", "logprobs", "perplexity", "activations", "formats"})
    if dtype not in MODEL_DTYPES:
        raise HarnessError(f"tolerances: no entry for dtype {dtype}")
    weights = data["weights"][dtype]
    logprobs = dict(data["logprobs"][dtype])
    perplexity = dict(data["perplexity"])
    activations = dict(data["activations"][dtype])
    _check_keys(f"weights.{dtype}", weights, {"rel", "abs"})
    override = data.get("formats", {}).get(format_name, {})
    _check_keys(f"formats.{format_name}", override, {"logprobs", "perplexity", "activations"})
    logprobs.update(override.get("logprobs", {}))
    for key, value in override.get("activations", {}).items():  # for every dtype, or a dtype's own table
        if key not in MODEL_DTYPES:
            activations[key] = value
        elif key == dtype:
            activations.update(value)
    _check_keys("activations", activations, {"max_abs_delta", "with_kv_cache"})
    perplexity.update(override.get("perplexity", {}))
    _check_keys("logprobs", logprobs, {"max_abs_delta", "top_k", "max_topk_miss_fraction"})
    _check_keys("perplexity", perplexity, {"rel"})
    return Tolerances(
        weights["rel"],
        weights["abs"],
        logprobs["max_abs_delta"],
        int(logprobs["top_k"]),
        float(logprobs["max_topk_miss_fraction"]),
        perplexity["rel"],
        activations["max_abs_delta"],
        activations["with_kv_cache"],
    )


def loosest_tolerances(format_names: Iterable[str], dtype: str, path: Path = DEFAULT_FILE) -> Tolerances:
    """The tolerances of a checkpoint whose modules are stored in several formats (a mixed
    checkpoint's config groups): each bound the loosest of theirs, since its logits carry every
    format's error; top_k is the dtype's own (no format overrides it)."""
    each = [load_tolerances(name, dtype, path) for name in dict.fromkeys(format_names)]
    if not each:
        raise HarnessError("tolerances: no format named")
    fields = zip(*map(astuple, each), strict=True)
    return Tolerances(*(max(values) if isinstance(values[0], float) else values[0] for values in fields))
