"""`compressed-tensors`: its own decompression of its own formats.

The transformers model class provides the module tree; compressed-tensors attaches its
quantization scheme, lays out the compressed parameters (`compress_model`), receives the
checkpoint's tensors unmodified, and decompresses them (`decompress_model`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from harness.checkpoint import Checkpoint
from harness.engines.base import Engine, LoadReport
from harness.engines.hf_common import captured_warnings, held_weights, model_generate, model_logprobs
from harness.naming import canonical_name

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class CompressedTensorsEngine(Engine):
    name = "compressed-tensors"
    package = "compressed-tensors"

    def __init__(self):
        self.model = None

    def unsupported_reason(self, format_name):
        if not format_name.startswith("ct-"):
            return f"compressed-tensors reads its own formats only, not {format_name}"
        return None

    def load(self, directory: str) -> LoadReport:
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
        from transformers import AutoConfig, AutoModelForCausalLM

        raw = json.loads((Path(directory) / "config.json").read_text())
        dtype = DTYPES.get(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16", torch.bfloat16)
        quantization_config = QuantizationConfig.model_validate(raw["quantization_config"])
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        report = LoadReport()
        with captured_warnings(report.warnings):
            self.model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
            apply_quantization_config(self.model, quantization_config)
            compressor = ModelCompressor(quantization_config=quantization_config)
            compressor.compress_model(self.model)
            checkpoint = Checkpoint(directory)
            state = {canonical_name(name): tensor for name, tensor in checkpoint.tensors()}
            result = self.model.load_state_dict(state, strict=False)
            compressor.decompress_model(self.model)
        tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
        report.missing = sorted(set(result.missing_keys) - tied)
        report.unexpected = sorted(result.unexpected_keys)
        return report

    def weights(self):
        return held_weights(self.model)

    def logprobs(self, sequences):
        return model_logprobs(self.model, sequences)

    def generate(self, prompt, max_new_tokens):
        return model_generate(self.model, prompt, max_new_tokens)

    def unload(self):
        self.model = None
