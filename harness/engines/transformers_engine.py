"""`transformers`: AutoModelForCausalLM.from_pretrained as users call it (checkpoint dtype, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from harness.engines.base import EngineUnsupported, LoadReport
from harness.engines.hf_common import HFModelEngine, captured_warnings


def explain(error: Exception, logged: list[str]) -> str:
    """transformers logs the cause of a conversion failure and raises a generic error: join them."""
    lines = [line.strip() for message in logged for line in message.splitlines()]
    causes = [line for line in lines if line.startswith(("ValueError", "RuntimeError", "TypeError", "Error:"))]
    message = str(error).splitlines()[0] if str(error) else type(error).__name__
    return message + (f" [logged: {'; '.join(dict.fromkeys(causes))[:600]}]" if causes else "")


def has_quantizer(method: str) -> bool:
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    return method in AUTO_QUANTIZER_MAPPING


class TransformersEngine(HFModelEngine):
    name = "transformers"
    package = "transformers"
    #: extra from_pretrained arguments (the CUDA variant places the model on the GPU)
    load_options: dict = {}

    # No unsupported_reason: a checkpoint whose quant_method transformers has no quantizer for
    # still loads (a warning, "Unknown quantization type"): the stored values become the weights.
    # That is what its users get, so it is judged like any other load (cases/known_issues.toml).

    def load(self, directory: str) -> LoadReport:
        from transformers import AutoModelForCausalLM

        from harness.checkpoints.reader import declared_format

        config = json.loads((Path(directory) / "config.json").read_text())
        self.fmt, self.knobs = declared_format(directory) if "quantization_config" in config else (None, None)
        report = LoadReport()
        logged: list[str] = []
        with captured_warnings(report.warnings, full=logged):
            try:
                self.model, info = AutoModelForCausalLM.from_pretrained(
                    directory, output_loading_info=True, local_files_only=True, **self.load_options
                )
            except Exception as error:
                method = config.get("quantization_config", {}).get("quant_method")
                if method is not None and not has_quantizer(method):
                    raise EngineUnsupported(
                        f"transformers {self.version()} has no quantizer for quant_method '{method}' "
                        f"and refuses the checkpoint: {explain(error, logged)}"
                    ) from error
                raise RuntimeError(explain(error, logged)) from error
        self.model.eval()
        names = self.checkpoint_report(config, info.get("missing_keys", []), info.get("unexpected_keys", []))
        report.missing, report.unexpected = names.missing, names.unexpected
        report.mismatched = sorted(str(k) for k in info.get("mismatched_keys", []))
        # compressed-tensors decompresses on the first forward: run one so weights are what it computes
        with torch.no_grad():
            self.model(input_ids=torch.tensor([[1, 3, 4, 5]], device=self.model.device))
        return report
