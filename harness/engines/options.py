"""Engine options: an engine loaded with settings other than the harness's defaults, named
`ENGINE[key=value,...]` (e.g. `vllm[enforce_eager=false]`, `vllm[kv_cache_dtype=fp8]`). Such an engine is
judged as its plain self is, against the same reference; its findings carry the full name, and the
known issues of the plain engine apply to it (the bugs of the same code, docs/engines.md). Imports
no torch."""

from __future__ import annotations

import re

from harness.core.errors import HarnessError

NAMED = re.compile(r"^(?P<base>[^\[\]]+)\[(?P<options>[^\[\]]*)\]$")
#: per engine, each option it takes and the values it accepts, in vLLM's own `LLM(...)` spelling;
#: where they are used: harness/engines/vllm/engine.py (VllmEngine.construct)
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
    },
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


def with_options(spec: str, options: dict[str, str]) -> str:
    """`module:Class` with the options the worker gives the engine (harness.engines.load_engine)."""
    if not options:
        return spec
    return f"{spec}[{','.join(f'{key}={value}' for key, value in sorted(options.items()))}]"


#: what a campaign draws (`run --options-every N`): one of these on every N-th example, in turn,
#: each judged besides the plain engines wherever its plain engine is in the run. Compiled vLLM
#: costs a torch.compile per load (35 s for a 2-layer llama on 2 AVX2 cores against 3 s eager,
#: docs/engines.md); a 10-minute main job (1450 examples on the AMD AVX-512 kind, session 34) drew
#: two variants once each. Not drawn: a model dtype other than the checkpoint's (the reference's
#: model of it, a reference forward in that dtype, is not written). An FP8 KV cache is drawn too, E4M3 and E5M2: judged against the reference's model
#: of it, and `unsupported` at once (vLLM's words) on a CPU without AVX-512.
CAMPAIGN_VARIANTS = ("vllm[enforce_eager=false]", "vllm[kv_cache_dtype=fp8]", "vllm[kv_cache_dtype=fp8_e5m2]")
#: one example in CAMPAIGN_OPTIONS_EVERY also loads one drawn variant (0: none)
CAMPAIGN_OPTIONS_EVERY = 500


def drawn_variant(example: int, every: int, engines, variants=CAMPAIGN_VARIANTS) -> str | None:
    """The engine variant example number `example` (1-based) also loads: on every `every`-th
    example, the next in turn of those `variants` whose plain engine is among `engines`; else None."""
    mine = [variant for variant in variants if base_engine(variant) in engines and variant not in engines]
    if every < 1 or not mine or example % every:
        return None
    return mine[(example // every - 1) % len(mine)]
