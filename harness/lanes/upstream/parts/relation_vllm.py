"""The relation: vLLM's weight loaders at each tensor-parallel size, under a mocked rank.

No GPU, no second process and no kernel: each parallel Linear of the first decoder layer is built as
vLLM's Llama and Qwen2 build it, while vLLM's tensor-parallel group is replaced by a stand-in that
answers rank r of tp (as vLLM's own loading tests mock the rank), and is fed the checkpoint through
its parameters' own weight_loader. What rank r then holds, read as vLLM's kernel reads it (one scale
grid over the fused rows, per-part scalars part by part), must equal its slice of the checkpoint's
values by the format's definition: its share of the output rows (q/k/v by heads, kv heads repeated
where tp exceeds them) or of the input columns. A Linear vLLM refuses at a size (its own error) is
no bug. Where vLLM has no matmul kernel for the format on this machine, its kernel choice answers a
stand-in that loading never calls."""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from harness.lanes.upstream.parts.checkpoint import rename
from harness.lanes.upstream.parts.common import MODEL_DTYPE, ranges
from harness.lanes.upstream.parts.fp8 import dequantize_definition  # or nvfp4, mxfp4: the format piece
from harness.lanes.upstream.parts.parameters import TENSOR_PARALLEL

# ---- reproduce.py ----

#: vLLM modules that imported a kernel chooser by name (it raises where no kernel fits this machine)
KERNEL_CHOOSERS = (
    ("vllm.model_executor.layers.quantization.fp8", "init_fp8_linear_kernel"),
    ("vllm.model_executor.layers.quantization.modelopt", "init_fp8_linear_kernel"),
    ("vllm.model_executor.layers.quantization.modelopt", "init_nvfp4_linear_kernel"),
    ("vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_fp8", "init_fp8_linear_kernel"),
    ("vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4", "init_nvfp4_linear_kernel"),
    ("vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_mxfp4", "init_mxfp4_linear_kernel"),
)  # fmt: skip


class RankGroup:
    """What vLLM's parallel layers read of the tensor-parallel group: this rank and the size."""

    def __init__(self, rank, size):
        self.rank_in_group, self.world_size, self.rank = rank, size, rank


class NoKernel:
    """Stands in for a matmul kernel vLLM lacks on this machine; loading never calls it."""

    def input_quant_key(self):
        return None

    def __getattr__(self, name):
        raise RuntimeError("no vLLM kernel on this machine: this layer is for loading only")


@contextmanager
def as_rank(rank, size):
    from vllm.distributed import parallel_state

    names = ("_TP", "_DP", "_PCP", "_EP")
    previous = {name: getattr(parallel_state, name, None) for name in names}
    parallel_state._TP = RankGroup(rank, size)
    for name in names[1:]:
        setattr(parallel_state, name, previous[name] or RankGroup(0, 1))
    try:
        yield
    finally:
        for name, group in previous.items():
            setattr(parallel_state, name, group)


@contextmanager
def loading_without_kernels():
    patched = []
    for module_name, name in KERNEL_CHOOSERS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if not hasattr(module, name):
            continue
        original = getattr(module, name)

        def choose(*args, _original=original, **kwargs):
            try:
                return _original(*args, **kwargs)
            except ValueError as error:
                if "Failed to find a kernel" not in str(error):
                    raise
                return NoKernel()

        patched.append((module, name, original))
        setattr(module, name, choose)
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


@contextmanager
def quantization_config(directory):
    """vLLM's quantization config for the checkpoint, under a current VllmConfig, as its loader makes it."""
    from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.weight_utils import get_quant_config

    model_config = ModelConfig(model=str(directory), dtype=MODEL_DTYPE, skip_tokenizer_init=True, max_model_len=256)
    with set_current_vllm_config(VllmConfig(model_config=model_config)):
        config = get_quant_config(model_config, LoadConfig())
        config.packed_modules_mapping = {
            "qkv_proj": ["q_proj", "k_proj", "v_proj"],
            "gate_up_proj": ["gate_proj", "up_proj"],
        }
        yield config


def build_linear(linear, config):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    common = {"bias": linear["bias"], "quant_config": config, "prefix": linear["prefix"], "params_dtype": MODEL_DTYPE}
    if linear["kind"] == "qkv":
        heads, kv_heads, head_dim = linear["attention"]
        return QKVParallelLinear(linear["input_size"], head_dim, heads, kv_heads, **common)
    if linear["kind"] == "merged":
        return MergedColumnParallelLinear(linear["input_size"], [rows for _, _, rows in linear["parts"]], **common)
    return RowParallelLinear(linear["input_size"], linear["parts"][0][2], **common)


def feed(layer, linear, read):
    """Each tensor of each part through its parameter's weight_loader, with vLLM's shard id."""
    params = dict(layer.named_parameters())
    for module, shard, _ in linear["parts"]:
        for suffix, tensor in read(module).items():
            parameter = params[suffix]
            if shard is None:
                parameter.weight_loader(parameter, tensor)
            else:
                parameter.weight_loader(parameter, tensor, shard)


def owned(linear, part, size, rank):
    """(axis, first, stop) of the part's checkpoint weight that `rank` of `size` must hold."""
    _, shard, rows = linear["parts"][part]
    if linear["kind"] == "row":
        share = linear["input_size"] // size
        return 1, rank * share, (rank + 1) * share
    if linear["kind"] == "qkv" and shard in ("k", "v"):
        _, kv_heads, head_dim = linear["attention"]
        if size >= kv_heads:  # kv heads repeated: rank r holds head r // (size / kv heads)
            head = rank // (size // kv_heads)
            return 0, head * head_dim, (head + 1) * head_dim
    share = rows // size
    return 0, rank * share, (rank + 1) * share


def held_values(held, sizes):
    """Each part's rows of what a rank holds, dequantized as vLLM's kernel reads the fused weight:
    row and block scales over the fused rows, per-part scalars (1-D, one per part) part by part."""
    scalars = {n for n, t in held.items() if t.dim() <= 1 and t.numel() == len(sizes)}
    if len(sizes) == 1 or not scalars:
        whole = dequantize_definition(held)
        return list(torch.split(whole, sizes))
    values, start = [], 0
    for part, size in enumerate(sizes):
        rows = {
            n: (t.reshape(-1)[part].reshape(1) if n in scalars else t[start : start + size]) for n, t in held.items()
        }
        values.append(dequantize_definition(rows))
        start += size
    return values


def rank_problems(linear, size, rank, config, read, expected):
    with as_rank(rank, size):
        try:
            layer = build_linear(linear, config)
            feed(layer, linear, read)
        except Exception as error:  # vLLM refuses this split, with its own error: not a bug
            return (
                [],
                f"{linear['prefix'].rpartition('.')[2]} refused at tp {size}: {type(error).__name__}: {str(error)[:160]}",
            )
    held = {name: p.detach().clone() for name, p in layer.named_parameters() if name != "bias"}
    sizes = [int(s) for s in getattr(layer, "output_partition_sizes", [held[next(iter(held))].shape[0]])]
    where = f"tp {size} rank {rank} {linear['prefix'].rpartition('.')[2]}"
    try:
        values = held_values(held, sizes)
    except (RuntimeError, ValueError, IndexError) as error:
        shapes = ", ".join(f"{n} {list(t.shape)}" for n, t in held.items())
        return [f"{where}: what the rank holds cannot be read as the format defines ({shapes}): {error}"], None
    problems = []
    for part, value in enumerate(values):
        module = linear["parts"][part][0]
        axis, first, stop = owned(linear, part, size, rank)
        want = expected[module].narrow(axis, first, stop - first)
        if value.shape != want.shape:
            problems.append(f"{where}: {module} held {list(value.shape)}, its slice is {list(want.shape)}")
            continue
        differ = value != want
        if bool(differ.any()):
            lines = differ.any(dim=1 - axis).nonzero().flatten() + first
            side = "rows" if axis == 0 else "columns"
            problems.append(
                f"{where}: {module.rpartition('.')[2]} differs from its slice at checkpoint {side} "
                f"{ranges(lines.tolist())} (max |delta| {float((value - want).abs().max()):.3g})"
            )
    return problems, None


def shard_problems(directory, expected):
    """Every rank's problems at each size (against `expected`: each module's weight by the format's
    definition); vLLM's refusals are printed, not problems."""
    handles = [safe_open(str(path), "pt") for path in sorted(Path(directory).glob("*.safetensors"))]

    def read(module):
        stored = rename(module) + "."
        return {
            key[len(stored) :]: handle.get_tensor(key)
            for handle in handles
            for key in handle.keys()
            if key.startswith(stored) and "." not in key[len(stored) :]
        }

    problems, refusals = [], []
    with quantization_config(directory) as config, loading_without_kernels():
        for size in TENSOR_PARALLEL["sizes"]:
            for rank in range(size):
                for linear in TENSOR_PARALLEL["linears"]:
                    found, refused = rank_problems(linear, size, rank, config, read, expected)
                    problems += found
                    if refused and refused not in refusals:
                        refusals.append(refused)
    for refused in refusals:
        print(f"note: vLLM refuses a split (not a bug): {refused}")
    return problems
