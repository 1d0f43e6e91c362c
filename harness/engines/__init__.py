"""Engine registry: names -> `module:Class` strings, imported only when a run asks for them."""

from __future__ import annotations

import importlib

from harness.errors import HarnessError

REGISTRY: dict[str, str] = {
    "reference": "harness.engines.reference_engine:ReferenceEngine",
    "transformers": "harness.engines.transformers_engine:TransformersEngine",
    "compressed-tensors": "harness.engines.ct_engine:CompressedTensorsEngine",
    "vllm": "harness.engines.vllm_engine:VllmEngine",
}


def engine_spec(name: str) -> str:
    """A registered name, or a user's own loader given as `package.module:Class`."""
    if name in REGISTRY:
        return REGISTRY[name]
    if ":" in name:
        return name
    raise HarnessError(f"unknown engine '{name}' (known: {', '.join(REGISTRY)}; or give package.module:Class)")


def load_engine(spec: str):
    """Import and instantiate an engine (inside the worker process)."""
    module_name, _, attribute = engine_spec(spec).partition(":")
    module = importlib.import_module(module_name)
    try:
        return getattr(module, attribute)()
    except AttributeError:
        raise HarnessError(f"{module_name} has no attribute '{attribute}'") from None
