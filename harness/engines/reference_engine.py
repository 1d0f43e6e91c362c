"""`reference`: the harness's own loader. Weights from the float64 reference dequantizer,
cast once to the checkpoint's dtype, in the transformers model class for the forward.

It maps VLM-prefixed keys onto the text model and refuses what the reference refuses, i.e.
it behaves as the manifest says a correct loader must.
"""

from __future__ import annotations

from harness.core.naming import canonical_name
from harness.engines.base import LoadReport
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
        result = self.model.load_state_dict(state, strict=False)
        return self.checkpoint_report(checkpoint.config, result.missing_keys, result.unexpected_keys, tied)
