"""`transformers`: AutoModelForCausalLM.from_pretrained as users call it (checkpoint dtype, CPU)."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import torch

from harness.core.errors import first_line
from harness.engines.base import EngineUnsupported, LoadReport
from harness.engines.dequantizing_modules import applied_weights
from harness.engines.gptqmodel_modules import placed_weights
from harness.engines.hf_common import HFModelEngine, captured_warnings, input_device, stored_names


def explain(error: Exception, logged: list[str]) -> str:
    """transformers logs the cause of a conversion failure and raises a generic error: join them."""
    lines = [line.strip() for message in logged for line in message.splitlines()]
    causes = [line for line in lines if line.startswith(("ValueError", "RuntimeError", "TypeError", "Error:"))]
    message = str(error).splitlines()[0] if str(error) else type(error).__name__
    return message + (f" [logged: {'; '.join(dict.fromkeys(causes))[:600]}]" if causes else "")


def has_quantizer(method: str) -> bool:
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    return method in AUTO_QUANTIZER_MAPPING


#: how transformers' quantizers say a backend package is missing ("Loading a GPTQ quantized model
#: requires optimum (`pip install optimum`)", "... requires gptqmodel. Please install it with ...",
#: "Please install the latest version of Quark (>=0.12)")
_REQUIRES = re.compile(r"(?:requires (?:the )?|Please install the latest version of )`?([A-Za-z][\w-]*)`?")


def missing_backend(error: BaseException) -> str | None:
    """The package a quantizer says it requires, when that package is really not importable here."""
    import importlib.util

    found = _REQUIRES.search(str(error))
    if not found:
        return None
    package = found.group(1)
    return package if importlib.util.find_spec(package.replace("-", "_").lower()) is None else None


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
                    directory,
                    output_loading_info=True,
                    local_files_only=True,
                    **self.model_dtype(),
                    **self.load_options,
                )
            except Exception as error:
                method = config.get("quantization_config", {}).get("quant_method")
                if method is not None and not has_quantizer(method):
                    raise EngineUnsupported(
                        f"transformers {self.version()} has no quantizer for quant_method '{method}' "
                        f"and refuses the checkpoint: {explain(error, logged)}"
                    ) from error
                missing = missing_backend(error)
                if missing:
                    raise EngineUnsupported(
                        f"transformers {self.version()} loads quant_method '{method}' through the package "
                        f"'{missing}', which is not installed here: {first_line(error)}"
                    ) from error
                raise RuntimeError(explain(error, logged)) from error
        self.model.eval()
        names = self.checkpoint_report(
            config, info.get("missing_keys", []), info.get("unexpected_keys", []), stored=stored_names(directory)
        )
        report.missing, report.unexpected = names.missing, names.unexpected
        report.mismatched = sorted(str(k) for k in info.get("mismatched_keys", []))
        # GPTQ / AWQ kernels repack at the first forward: read what their loader placed before it;
        # AutoRound's and Quark's Linears hold codes they dequantize at each forward: read what that computes
        self.placed = placed_weights(self.model, self.fmt, self.knobs) | applied_weights(self.model)
        # compressed-tensors decompresses on the first forward: run one so weights are what it computes
        with torch.no_grad():
            self.model(input_ids=torch.tensor([[1, 3, 4, 5]], device=input_device(self.model)))
        return report

    def model_dtype(self) -> dict:
        """`dtype=` for from_pretrained where an engine option names one (`transformers[dtype=float32]`);
        none otherwise: transformers then loads in the checkpoint's dtype, as its users' default does."""
        from harness.core.dtypes import MODEL_DTYPES

        dtype = self.options.get("dtype", "auto")
        return {} if dtype == "auto" else {"dtype": MODEL_DTYPES[dtype]}

    def load_variant(self, directory: str, variant: str) -> LoadReport:
        """`dequantize`: from_pretrained with the checkpoint's own quantization config and
        `dequantize=True` (compressed-tensors' former `run_compressed=False`; FineGrainedFP8's
        dequantize), a load path transformers' own tests hold to the default one. `offload`: a
        device_map that keeps half the checkpoint's bytes in memory and offloads the rest to disk."""
        if variant == "dequantize":
            config = json.loads((Path(directory) / "config.json").read_text())
            options = {"quantization_config": dequantizing(config)}
        elif variant == "offload" and "device_map" not in type(self).load_options:
            self.offload_folder = tempfile.mkdtemp(prefix="harness-offload-")
            half = sum(f.stat().st_size for f in Path(directory).glob("*.safetensors")) // 2
            options = {"device_map": "auto", "max_memory": {"cpu": half}, "offload_folder": self.offload_folder}
        else:
            return super().load_variant(directory, variant)
        self.load_options = {**type(self).load_options, **options}
        try:
            return self.load(directory)
        except BaseException:  # a failed load is never unloaded: its offload folder goes now
            self.remove_offload_folder()
            raise
        finally:
            del self.load_options

    def remove_offload_folder(self):
        if getattr(self, "offload_folder", None):
            shutil.rmtree(self.offload_folder, ignore_errors=True)
            self.offload_folder = None

    def unload(self):
        super().unload()
        self.remove_offload_folder()


def dequantizing(config: dict):
    """The checkpoint's quantization config with `dequantize=True` as a from_pretrained argument,
    where its quantizer has that loading attribute."""
    from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING

    quantization = config.get("quantization_config")
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    config_class = AUTO_QUANTIZATION_CONFIG_MAPPING.get(method)
    if config_class is None:
        raise EngineUnsupported(f"transformers has no quantizer for quant_method {method!r} to dequantize with")
    options = config_class.from_dict({**quantization, "dequantize": True})
    if "dequantize" not in options.get_loading_attributes():
        raise EngineUnsupported(f"transformers' {config_class.__name__} has no dequantize loading option")
    return options
