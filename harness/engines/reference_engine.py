"""`reference`: the harness's own loader. Weights from the float64 reference dequantizer,
cast once to the checkpoint's dtype, in the transformers model class for the forward.

It maps VLM-prefixed keys onto the text model and refuses what the reference refuses, i.e.
it behaves as the manifest says a correct loader must.
"""

from __future__ import annotations

from harness.core.naming import canonical_name
from harness.engines.base import EngineUnsupported, LoadReport
from harness.engines.hf_common import HFModelEngine, checkpoint_dtype, unquantized_model


class ReferenceEngine(HFModelEngine):
    name = "reference"
    package = "quant-load-harness"

    def load(self, directory: str) -> LoadReport:
        from harness.checkpoints.kv_scales import is_kv_scale
        from harness.checkpoints.model_layout import to_model_state
        from harness.checkpoints.reader import Checkpoint
        from harness.oracle.reference import dequantize_checkpoint

        dtype = checkpoint_dtype(directory)
        checkpoint = Checkpoint(directory)
        if "quantization_config" in checkpoint.config:  # quantized: the oracle's dequantization
            tensors = dequantize_checkpoint(directory)
        else:  # an unquantized model (e.g. the tiny models' bf16 originals): its tensors as stored
            tensors = ((name, checkpoint.tensor(name)) for name in checkpoint.names())
        # KV-cache scales are consumed: this engine runs its KV cache unquantized (docs/findings.md)
        state = {
            canonical_name(n): t.to(dtype) if t.is_floating_point() else t for n, t in tensors if not is_kv_scale(n)
        }
        state = to_model_state(checkpoint.config, state)
        self.model, tied = unquantized_model(directory)
        self.activations = activation_plan(checkpoint)
        result = self.model.load_state_dict(state, strict=False)
        return self.checkpoint_report(checkpoint.config, result.missing_keys, result.unexpected_keys, tied)

    def activation_logprobs(self, sequences):
        """The checkpoint's full definition: weights as dequantized, and each quantized Linear's
        input quantized as its config specifies (harness.oracle.activations)."""
        from harness.core.errors import HarnessError
        from harness.engines.hf_common import model_logprobs
        from harness.oracle.activations import install

        if isinstance(self.activations, str):
            raise EngineUnsupported(self.activations)
        scheme, modules = self.activations
        try:
            handles = install(self.model, modules, scheme)
        except HarnessError as error:  # e.g. experts packed in 3-D: not Linears to hook
            raise EngineUnsupported(f"activation candidate: {error}") from None
        try:
            return model_logprobs(self.model, sequences)
        finally:
            for handle in handles:
                handle.remove()

    def unload(self):
        super().unload()
        self.activations = "no checkpoint loaded"


def activation_plan(checkpoint) -> tuple | str:
    """(scheme, module -> its static scale or None) for the quantized Linears whose inputs the
    config quantizes, or why there is no such candidate (a weight-only format, a scheme or layout
    the definition here does not cover)."""
    from harness.core.errors import HarnessError
    from harness.oracle.activations import declared_ignored, scheme_of
    from harness.oracle.reference import format_and_knobs, group_modules

    config = checkpoint.config.get("quantization_config")
    if not isinstance(config, dict):
        return "the checkpoint is not quantized"
    try:
        scheme = scheme_of(config)
        fmt = format_and_knobs(checkpoint)[0]
    except HarnessError as error:
        return str(error)
    if scheme is None:
        return "the config quantizes weights only"
    if config.get("kv_cache_scheme") or config.get("kv_cache_quant_algo"):  # the oracle issue's next step
        return "the config also quantizes the KV cache, which the reference does not model yet"
    modules, _ = group_modules(checkpoint.names(), fmt, checkpoint.storage_dtypes())
    plan = {}
    for module, parts in modules.items():
        if declared_ignored(config, module) or module.endswith("embed_tokens"):  # targets: Linear, not ignored
            continue
        if scheme.static and scheme.static not in parts:
            return f"{module} has no {scheme.static} ({scheme.describe()})"
        plan[canonical_name(module)] = checkpoint.tensor(parts[scheme.static]) if scheme.static else None
    return scheme, plan
