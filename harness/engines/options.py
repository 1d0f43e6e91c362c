"""Engine options: an engine loaded with settings other than the harness's defaults, named
`ENGINE[key=value,...]` (e.g. `vllm[enforce_eager=false]`, `vllm[kv_cache_dtype=fp8]`). Such an engine is
judged as its plain self is, against the same reference; its findings carry the full name, and the
known issues of the plain engine apply to it (the bugs of the same code, docs/engines.md). Imports
no torch."""

from __future__ import annotations

import re

from harness.core.errors import HarnessError

#: the `dtype` option's values: the checkpoint's own (auto), or a model dtype (harness.core.dtypes)
MODEL_DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
#: the `quantization` option's values: the online schemes the reference models (harness.oracle.online.SCHEMES)
ONLINE_SCHEMES = ("fp8_per_channel", "fp8_per_block")
NAMED = re.compile(r"^(?P<base>[^\[\]]+)\[(?P<options>[^\[\]]*)\]$")
#: per engine, each option it takes and the values it accepts, in the engine's own spelling (vLLM's
#: `LLM(...)`, transformers' `from_pretrained`); where they are used: harness/engines/vllm/engine.py
#: (VllmEngine.construct), harness/engines/transformers_engine.py (TransformersEngine.model_dtype)
OPTIONS: dict[str, dict[str, tuple[str, ...]]] = {
    "vllm": {
        # False: torch.compile of the model (inductor on CPU), as vLLM serves by default; the same
        # math as eager, so judged by the same bounds as the plain engine
        "enforce_eager": ("true", "false"),
        # the KV cache's dtype; fp8 quantizes it with the checkpoint's k/v scales (1.0 without).
        # Judged against the reference's model of it (harness.oracle.specified.MODELLED_OPTIONS): where
        # the checkpoint declares the cache, its own forward; where not, the same forward with the
        # cache quantized at scale 1.0, in E4M3 (fp8/fp8_e4m3) or E5M2 (fp8_e5m2, which vLLM declines
        # for checkpoints whose method could carry KV scales: `unsupported`, in its words)
        "kv_cache_dtype": ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
        # the model dtype, cast from the checkpoint's (users pick float16 where a GPU has no bfloat16,
        # and for methods that refuse bfloat16). Judged in that dtype: weights against the truth
        # cast once to it, logits against the reference's forward in it (the reference loaded again
        # in that dtype), with that dtype's tolerances; the probes of the applied weights, whose
        # inputs are the checkpoint dtype's, are not run for it
        "dtype": MODEL_DTYPE_CHOICES,
        # online quantization of an unquantized checkpoint while loading (vLLM's shorthands): judged
        # against the reference's model of the scheme (harness.oracle.online: the weights quantized as
        # the scheme defines, activations quantized dynamically), weights and logits; the probes of the
        # applied weights are not run for it. A quantized or mixture-of-experts checkpoint: unsupported
        "quantization": ONLINE_SCHEMES,
    },
    # from_pretrained's `dtype`, judged as vLLM's is
    "transformers": {"dtype": MODEL_DTYPE_CHOICES},
}


def split_engine(name: str) -> tuple[str, dict[str, str]]:
    """(`name` without its options, its options) for `ENGINE[key=value,...]`; a plain name has
    none. A malformed or unknown option is a HarnessError (one line)."""
    found = NAMED.match(name)
    if not found:
        if "[" in name or "]" in name:
            raise HarnessError(
                f"engine {name!r}: options are written ENGINE[key=value,...], e.g. vllm[enforce_eager=false]"
            )
        return name, {}
    base, options = found.group("base"), {}
    known = OPTIONS.get(base)
    for item in filter(None, (part.strip() for part in found.group("options").split(","))):
        key, equals, value = (text.strip() for text in item.partition("="))
        if not equals or not key or not value:
            raise HarnessError(f"engine {name!r}: option {item!r} is not key=value")
        if known is None:
            raise HarnessError(f"engine {name!r}: {base} takes no options (engines with options: {', '.join(OPTIONS)})")
        if key not in known:
            raise HarnessError(f"engine {name!r}: {base} has no option {key!r} (it takes {', '.join(known)})")
        if value.lower() not in known[key]:
            raise HarnessError(f"engine {name!r}: {key}={value!r} is not one of {', '.join(known[key])}")
        options[key] = value.lower()
    return base, options


def base_engine(name: str) -> str:
    """The engine a name with options is a setting of (`vllm[enforce_eager=false]` -> `vllm`)."""
    return split_engine(name)[0]


def model_dtype(name: str) -> str | None:
    """The model dtype an engine's `dtype` option names (`vllm[dtype=float32]` -> `float32`);
    None for the checkpoint's own (no option, or `auto`)."""
    dtype = split_engine(name)[1].get("dtype", "auto")
    return None if dtype == "auto" else dtype


def with_options(spec: str, options: dict[str, str]) -> str:
    """`module:Class` with the options the worker gives the engine (harness.engines.load_engine)."""
    if not options:
        return spec
    return f"{spec}[{','.join(f'{key}={value}' for key, value in sorted(options.items()))}]"


#: what a campaign draws (`run --options-every N`): one of these on every N-th example, in turn,
#: each judged besides the plain engines wherever its plain engine is in the run. Compiled vLLM
#: costs a torch.compile per load (35 s for a 2-layer llama on 2 AVX2 cores against 3 s eager,
#: docs/engines.md); an FP8 KV cache (E4M3, E5M2) is judged against the reference's model of it and
#: is `unsupported` at once (vLLM's words) on a CPU without AVX-512; a model dtype (float16, as users
#: pick where a GPU has no bfloat16, and float32) against the reference's forward in that dtype.
CAMPAIGN_VARIANTS = (
    "vllm[enforce_eager=false]",
    "transformers[dtype=float16]",
    "vllm[kv_cache_dtype=fp8]",
    "vllm[dtype=float16]",
    "vllm[kv_cache_dtype=fp8_e5m2]",
    "transformers[dtype=float32]",
)
#: one example in CAMPAIGN_OPTIONS_EVERY also loads one drawn variant (0: none): a 10-minute main
#: job (1800-1850 examples on the AMD AVX-512 kind, session 35) draws each once or twice
CAMPAIGN_OPTIONS_EVERY = 250


#: variants drawn on the examples of one format only, one of them on every FORMAT_VARIANTS_EVERY-th
#: example of it, in turn: online quantization starts from an unquantized checkpoint (its block
#: scheme has no kernel on a CPU without AMX: `unsupported`, in vLLM's words, at no cost);
#: compressed-tensors decompresses int4 in the dtype of its scales, so a model dtype other than the
#: checkpoint's is where a loader must cast (transformers-ct-int-experts-decompressed-in-scale-dtype,
#: which the campaign's one-in-250 option draws never reached: session 43's main job)
FORMAT_VARIANTS = {
    "unquantized": ("vllm[quantization=fp8_per_channel]", "vllm[quantization=fp8_per_block]"),
    "ct-int4": ("transformers[dtype=float32]",),
}
FORMAT_VARIANTS_EVERY = 3


def format_variant(seen: int, fmt: str, engines, every: int = FORMAT_VARIANTS_EVERY) -> str | None:
    """The variant the `seen`-th example (1-based) of format `fmt` also loads (FORMAT_VARIANTS), or None."""
    return drawn_variant(seen, every, engines, FORMAT_VARIANTS.get(fmt, ()))


def drawn_variant(example: int, every: int, engines, variants=CAMPAIGN_VARIANTS) -> str | None:
    """The engine variant example number `example` (1-based) also loads: on every `every`-th
    example, the next in turn of those `variants` whose plain engine is among `engines`; else None."""
    mine = [variant for variant in variants if base_engine(variant) in engines and variant not in engines]
    if every < 1 or not mine or example % every:
        return None
    return mine[(example // every - 1) % len(mine)]
