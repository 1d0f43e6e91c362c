"""What the engines that run a transformers model class share: forward, generation, weights."""

from __future__ import annotations

import json
import logging
import re
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

from harness.core.dtypes import MODEL_DTYPES as DTYPES
from harness.core.naming import canonical_name
from harness.engines.base import Engine, EngineUnsupported, LoadReport
from harness.engines.gptqmodel_modules import MARKER, is_quantized_linear


def checkpoint_dtype(directory: str | Path) -> torch.dtype:
    """The dtype the checkpoint declares (config.json `dtype`, or the older `torch_dtype`)."""
    raw = json.loads((Path(directory) / "config.json").read_text())
    return DTYPES.get(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16", torch.bfloat16)


#: set while `sentinel_storage` is active
_SENTINEL: list[bool] = []


def unquantized_model(directory: str | Path, dtype: torch.dtype | None = None):
    """The checkpoint's transformers model class, randomly initialised in `dtype` (default: the
    checkpoint's), with no quantizer attached: the caller fills in the weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # experts one by one in plain matmuls (the definition), not torch's grouped_mm, whose CPU
    # kernel refuses rows whose byte stride is not a multiple of 16 (an expert width of 18)
    config._experts_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype or checkpoint_dtype(directory)).eval()
    if _SENTINEL:  # the relation `sentinel`: the caller must write every parameter
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.is_floating_point():
                    parameter.fill_(float("nan"))
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    return model, tied


@contextmanager
def sentinel_storage():
    """Parameters materialized NaN-filled before the loader writes them, as vLLM's reload tests
    do: a model built by `unquantized_model` starts all NaN, and transformers' initialization of
    the parameters it did not load (after its own init, so computed buffers stay right) leaves
    NaN. A NaN left after loading is a parameter the loader never wrote."""
    from transformers import PreTrainedModel

    original = PreTrainedModel._initialize_weights

    def initialize_then_fill(self, module, is_custom_code: bool = False):
        if getattr(module, "_is_hf_initialized", False):
            return
        original(self, module, is_custom_code)
        with torch.no_grad():
            for parameter in module.parameters(recurse=False):
                if parameter.is_floating_point() and not getattr(parameter, "_is_hf_initialized", False):
                    parameter.fill_(float("nan"))

    _SENTINEL.append(True)
    PreTrainedModel._initialize_weights = initialize_then_fill
    try:
        yield
    finally:
        PreTrainedModel._initialize_weights = original
        _SENTINEL.pop()


class HFModelEngine(Engine):
    """An engine whose loaded model is a transformers module: forward, generation and weights
    are read the same way; subclasses implement `load` and set `model` (and `fmt`/`knobs` when
    the model may keep packed weights)."""

    def __init__(self):
        self.model = None
        self.fmt = self.knobs = None
        #: what GPTQ / AWQ Linears held before their kernels repacked them (gptqmodel_modules)
        self.placed = {}

    @staticmethod
    def checkpoint_report(config: dict, missing, unexpected, tied=frozenset(), stored=None) -> LoadReport:
        """A load report in the checkpoint's names (`stored`, its tensor names, say which): the
        model's key names mapped back (`model_layout.report_names`: packed experts, Mixtral's
        `mlp`), tied heads not missing."""
        from harness.checkpoints.model_layout import report_names

        return LoadReport(
            missing=sorted(set(report_names(config, [k for k in missing if k not in tied], stored))),
            unexpected=sorted(set(report_names(config, list(unexpected), stored))),
        )

    def weights(self):
        from harness.checkpoints.model_layout import to_checkpoint_names

        held = held_weights(self.model, self.fmt, self.knobs, self.placed)
        return to_checkpoint_names(loaded_config(self.model), held, stored_names(loaded_directory(self.model)))

    def logprobs(self, sequences):
        return model_logprobs(self.model, sequences)

    def generate(self, prompt, max_new_tokens):
        return model_generate(self.model, prompt, max_new_tokens)

    def probe_linears(self, inputs):
        return run_linears(self.model, inputs)

    def kv_cache_scales(self):
        """compressed-tensors' kv_cache_scheme gives each attention module `k_scale` and `v_scale`
        parameters (in the model dtype), which its cache hooks quantize with; amd-quark's QParamsLinear
        gives k_proj and v_proj an `output_quantizer` whose `scale` quantizes their outputs (Quark's KV
        cache, harness.oracle.kv_cache)."""
        held = {}
        for name, module in self.model.named_modules():
            own = dict(module.named_parameters(recurse=False))
            if "k_scale" in own and "v_scale" in own:
                held[name] = tuple(float(own[s].detach().reshape(-1)[0]) for s in ("k_scale", "v_scale"))
            outputs = [getattr(getattr(module, p, None), "output_quantizer", None) for p in ("k_proj", "v_proj")]
            scales = [getattr(quantizer, "scale", None) for quantizer in outputs]
            if all(isinstance(scale, torch.Tensor) for scale in scales):
                held[name] = tuple(float(scale.detach().reshape(-1)[0]) for scale in scales)
        return held

    def unload(self):
        self.model = None
        self.placed = {}

    def load_variant(self, directory, variant):
        if variant != "sentinel":
            return super().load_variant(directory, variant)
        with sentinel_storage():
            return self.load(directory)

    def save(self, directory):
        quantizer = getattr(self.model, "hf_quantizer", None)
        if quantizer is not None and not quantizer.is_serializable():  # its own declaration (Quark's)
            method = quantizer.quantization_config.quant_method
            raise EngineUnsupported(
                f"transformers declares a model quantized with {getattr(method, 'value', method)} not serializable"
            )
        self.model.save_pretrained(directory)


def input_device(model) -> torch.device:
    """Where a forward's inputs go: the model's device, or the CPU when every parameter is offloaded
    to disk (the `offload` relation: the model's device is then `meta`, and accelerate's hooks move
    the inputs along)."""
    return torch.device("cpu") if model.device.type == "meta" else model.device


@torch.no_grad()
def model_logprobs(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    rows = []
    for sequence in sequences:
        ids = torch.tensor([sequence], device=input_device(model))
        logits = model(input_ids=ids).logits[0, :-1].to(torch.float32)
        rows.append(torch.log_softmax(logits, dim=-1))
    return rows


#: in a probe's inputs, `NAME + LEAD` is the shape the model's forward gives NAME before its last
#: dimension, -1 for the tokens (DeepSeek-V3 hands kv_b_proj [batch, 1, tokens, rank])
LEAD = "#lead"


@torch.no_grad()
def run_linears(model, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each named module of `model` called on its input rows (on the module's device), shaped as the
    model's forward shapes it (`LEAD`; [1, rows, K] by default): its output, [rows, out]. A packed
    experts module (`NAME#experts`) runs every row through each expert in turn: `NAME#experts.E`;
    where the engine holds the experts unpacked instead (a ModuleList of per-expert MLPs, as
    auto-round's MoE blocks do), each MLP runs every row, which is the same output."""
    from harness.oracle.expert_activations import EXPERTS, run_each_expert

    modules = dict(model.named_modules())
    outputs = {}
    for name, rows in inputs.items():
        if name.endswith(EXPERTS):  # a packed experts module: every row to one expert at a time
            experts = modules.get(name.removesuffix(EXPERTS))
            packed = getattr(experts, "gate_up_proj", None)
            if isinstance(packed, torch.Tensor) and packed.dim() == 3:
                for expert, output in enumerate(run_each_expert(experts, rows.to(packed.device))):
                    outputs[f"{name}.{expert}"] = output.detach().cpu()
            elif isinstance(experts, torch.nn.ModuleList):
                for expert, mlp in enumerate(experts):
                    held = next(iter([*mlp.parameters(), *mlp.buffers()]), None)
                    if held is not None:  # run where its tensors are
                        outputs[f"{name}.{expert}"] = mlp(rows.to(held.device)).detach().cpu()
            continue
        module = modules.get(name)
        device = linear_device(module)
        if name.endswith(LEAD) or device is None:
            continue  # e.g. a fused or renamed module: the probe judges what it can find
        lead = inputs.get(name + LEAD, torch.tensor([1, -1])).tolist()
        shaped = [rows.shape[0] if d == -1 else d for d in lead]
        if torch.Size(shaped).numel() != rows.shape[0]:
            shaped = [1, rows.shape[0]]
        result = module(rows.reshape(*shaped, rows.shape[-1]).to(device))
        outputs[name] = result.reshape(rows.shape[0], -1).detach().cpu()
    return outputs


def linear_device(module) -> torch.device | None:
    """Where a Linear's inputs go: its 2-D weight's device, or its packed codes' for a Linear that
    holds no float weight (GPTQ / AWQ's `qweight`; `weight_packed`, as AutoRound's MXFP4 Linear
    holds compressed-tensors' tensors); None for anything else."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return weight.device
    if is_quantized_linear(module):
        return getattr(module, MARKER).device
    packed = getattr(module, "weight_packed", None)
    return packed.device if isinstance(packed, torch.Tensor) and hasattr(module, "in_features") else None


@torch.no_grad()
def model_generate(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=input_device(model))
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


#: the parameters and buffers compared: weights, biases, a transformers experts module's packed
#: 3-D tensors and gpt-oss's packed expert biases (harness.checkpoints.model_layout), DeepSeek-V3's
#: router score bias and gpt-oss's attention sinks
COMPARED = (
    "weight",
    "bias",
    "gate_up_proj",
    "down_proj",
    "gate_up_proj_bias",
    "down_proj_bias",
    "e_score_correction_bias",
    "sinks",
)


def loaded_directory(model) -> Path:
    """The directory the model was loaded from."""
    return Path(str(getattr(model.config, "name_or_path", "")))


def loaded_config(model) -> dict:
    """The config.json the model was loaded from (its field names, which transformers may rename
    in `config.to_dict()`: Qwen3-MoE's num_experts), else the model's config."""
    path = loaded_directory(model) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else model.config.to_dict()


def stored_names(directory: str | Path) -> list[str] | None:
    """The tensor names a checkpoint directory stores, or None where it cannot be read as one (a
    hostile layout an engine loaded anyway): they tell which naming its experts use."""
    from harness.checkpoints.reader import Checkpoint
    from harness.core.errors import CheckpointError

    try:
        return Checkpoint(directory).names() if (Path(directory) / "config.json").is_file() else None
    except CheckpointError:
        return None


#: integer dtypes a weight holds codes in (ct-w8a8's int8, MXFP4 blocks)
CODE_DTYPES = (torch.uint8, torch.int8)


def held_weights(model, fmt=None, knobs=None, placed=None) -> dict[str, torch.Tensor]:
    """The model's parameters under canonical names, float32. A Linear that still holds packed
    tensors (its weight not floating point, or FP8) is dequantized with the format's reference
    from exactly the tensors it holds; one that holds codes but not the format's scale (a module
    the loader took for unquantized) holds the codes as its values. A module in `placed` (module
    name -> its weights, read before a kernel repacked them) holds those."""
    result = {}
    for module_name, module in model.named_modules():
        if placed and module_name in placed:
            result.update(placed[module_name])
            continue
        params = dict(module.named_parameters(recurse=False)) | dict(module.named_buffers(recurse=False))
        if not params:
            continue
        packed = "weight" in params and (params["weight"].dtype in (torch.float8_e4m3fn, *CODE_DTYPES))
        packed = packed or ("weight_packed" in params)
        if packed and fmt is not None and fmt.marker in params:
            tensors = {k: v for k, v in params.items() if k in fmt.suffixes}
            result[canonical_name(f"{module_name}.weight")] = fmt.dequantize_held(tensors, knobs).to(torch.float32)
            if "bias" in params:
                result[canonical_name(f"{module_name}.bias")] = params["bias"].float()
            continue
        for name, tensor in params.items():
            if name in COMPARED and (tensor.is_floating_point() or tensor.dtype in CODE_DTYPES):
                result[canonical_name(f"{module_name}.{name}" if module_name else name)] = tensor.float()
    return result


class _Collect(logging.Handler):
    def __init__(self, sink: list[str], full: list[str] | None):
        super().__init__(logging.WARNING)
        self.sink, self.full = sink, full

    def emit(self, record):
        message = record.getMessage()
        self.sink.append(message.splitlines()[0][:300] if message else "")
        if self.full is not None:  # load-report tables pad every row to the widest cell: squeeze first
            self.full.append(re.sub(r"[ \t]{2,}", " ", message)[:20000])


@contextmanager
def captured_warnings(
    sink: list[str], loggers=("transformers", "compressed_tensors", "vllm"), full: list[str] | None = None
):
    """Collect warnings and WARNING log records raised while loading: the first line of each
    into `sink`, and whole messages (multi-line load reports) into `full` when given."""
    handler = _Collect(sink, full)
    for name in loggers:
        logging.getLogger(name).addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            for name in loggers:
                logging.getLogger(name).removeHandler(handler)
            sink.extend(str(w.message).splitlines()[0][:300] for w in caught if str(w.message))
