"""Engine registry: one entry per engine (its `module:Class`, the package it needs, the project
environments that may hold that package), imported only when a run asks for it. Imports no torch.
Adding an engine: its module beside this file and one entry here."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from harness.core.errors import HarnessError
from harness.core.plugins import load_plugins


@dataclass(frozen=True)
class EngineEntry:
    spec: str  # `module:Class`
    package: str | None = None  # importable name whose absence sends the worker to `environments`
    #: interpreters under the project root (e.g. `.tox/vllm-cpu/bin/python`) to try when the
    #: current one lacks `package`; $HARNESS_<ENGINE>_PYTHON comes first (environments.py)
    environments: tuple[str, ...] = ()
    #: (variable, value) pairs the worker's environment sets over the user's, which it otherwise
    #: inherits unchanged: each only because correctness needs it (say why where it is used)
    overrides: tuple[tuple[str, str], ...] = ()
    #: whether a run that names no engines uses it (ENGINE_NAMES); an engine that cannot compute a
    #: forward anywhere CI runs, in an environment of its own, is named when wanted
    in_full_run: bool = True


#: the CPU engines run with no GPU visible: where one is, transformers' FineGrainedFP8 keeps FP8
#: weights for its CUDA kernel instead of its CPU path, and every fp8-block load of the CPU
#: `transformers` engine failed at its first forward (measured on an H200, issue 16). The GPU
#: lane's engines (`harness.engines.transformers_cuda_engine`) are not registry entries and see it.
CPU_ONLY = (("CUDA_VISIBLE_DEVICES", ""),)
ENGINES: dict[str, EngineEntry] = {
    "reference": EngineEntry("harness.engines.reference_engine:ReferenceEngine", "transformers", overrides=CPU_ONLY),
    "transformers": EngineEntry(
        "harness.engines.transformers_engine:TransformersEngine", "transformers", overrides=CPU_ONLY
    ),
    "compressed-tensors": EngineEntry(
        "harness.engines.ct_engine:CompressedTensorsEngine", "compressed_tensors", overrides=CPU_ONLY
    ),
    "vllm": EngineEntry(
        "harness.engines.vllm.engine:VllmEngine", "vllm", (".venv-vllm/bin/python", ".tox/vllm-cpu/bin/python")
    ),
    # SGLang's loaders with stand-in kernel choices (harness.engines.sglang): they build on CPU only
    # with no GPU visible (where one is, SGLang's layers take their CUDA kernels for the CPU tensors
    # its loader builds here); weights judged, no forward
    "sglang": EngineEntry(
        "harness.engines.sglang.engine:SglangEngine",
        "sglang",
        (".venv-sglang/bin/python", ".tox/sglang/bin/python"),
        overrides=CPU_ONLY,
        in_full_run=False,
    ),
}
#: the engines a full run uses, in order
ENGINE_NAMES = tuple(name for name, entry in ENGINES.items() if entry.in_full_run)
REGISTRY: dict[str, str] = {name: entry.spec for name, entry in ENGINES.items()}


def register_engine(name: str, entry: EngineEntry) -> None:
    """Add an engine from outside the package (a plugin, harness.core.plugins). A plugin's engine
    is addressable by name but not added to the default run (ENGINE_NAMES)."""
    if name in ENGINES and ENGINES[name] != entry:
        raise ValueError(f"engine '{name}' is already registered as {ENGINES[name].spec}")
    ENGINES[name] = entry
    REGISTRY[name] = entry.spec


#: the harness's own loader: what it holds and computes is the oracle every other engine is judged against
REFERENCE = "reference"


def judged_with_reference(engine: str) -> list[str]:
    """The engines a run of `engine` needs: the reference first, then `engine` (once)."""
    return [REFERENCE] if engine == REFERENCE else [REFERENCE, engine]


def engine_spec(name: str) -> str:
    """A registered name, or a user's own loader given as `package.module:Class`; with options
    (`vllm[enforce_eager=false]`, harness.engines.options) the spec carries them."""
    from harness.engines.options import split_engine, with_options

    base, options = split_engine(name)
    if base in REGISTRY:
        return with_options(REGISTRY[base], options)
    if ":" in base:
        return with_options(base, options)
    raise HarnessError(f"unknown engine '{name}' (known: {', '.join(REGISTRY)}; or give package.module:Class)")


def load_engine(spec: str):
    """Import and instantiate an engine (inside the worker process), its options set."""
    from harness.engines.options import NAMED

    found = NAMED.match(spec)
    spec, text = (found.group("base"), found.group("options")) if found else (spec, "")
    module_name, _, attribute = engine_spec(spec).partition(":")
    module = importlib.import_module(module_name)
    try:
        engine = getattr(module, attribute)()
    except AttributeError:
        raise HarnessError(f"{module_name} has no attribute '{attribute}'") from None
    engine.options = dict(item.split("=", 1) for item in text.split(",") if item)
    return engine


load_plugins()  # last: a plugin registers into the registries above
