"""`reference`: the harness's own loader. Weights from the float64 reference dequantizer,
cast once to the checkpoint's dtype, in the transformers model class for the forward.

It maps VLM-prefixed keys onto the text model and refuses what the reference refuses, i.e.
it behaves as the manifest says a correct loader must.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from harness.engines.base import Engine, LoadReport
from harness.engines.hf_common import held_weights, model_generate, model_logprobs
from harness.naming import canonical_name

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ReferenceEngine(Engine):
    name = "reference"
    package = "quant-load-harness"

    def __init__(self):
        self.model = None

    def load(self, directory: str) -> LoadReport:
        from transformers import AutoConfig, AutoModelForCausalLM

        from harness.reference import dequantize_checkpoint

        weights = {canonical_name(n): t for n, t in dequantize_checkpoint(directory)}
        raw = json.loads((Path(directory) / "config.json").read_text())
        dtype = DTYPES.get(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16", torch.bfloat16)
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        self.model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        state = {n: t.to(dtype) for n, t in weights.items()}
        result = self.model.load_state_dict(state, strict=False)
        tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
        return LoadReport(missing=sorted(set(result.missing_keys) - tied), unexpected=sorted(result.unexpected_keys))

    def weights(self):
        return held_weights(self.model)

    def logprobs(self, sequences):
        return model_logprobs(self.model, sequences)

    def generate(self, prompt, max_new_tokens):
        return model_generate(self.model, prompt, max_new_tokens)

    def unload(self):
        self.model = None
