"""The relation: vLLM's weight loaders at each tensor-parallel size, under a mocked rank.

No GPU, no second process and no kernel: each parallel Linear of the first decoder layer is built as
vLLM's Llama and Qwen2 build it, while vLLM's tensor-parallel group is replaced by a stand-in that
answers rank r of tp (as vLLM's own loading tests mock the rank), and is fed the checkpoint through
its parameters' own weight_loader. What rank r then holds, read as vLLM's kernel reads it (one scale
grid over the fused rows, per-part scalars part by part), must equal its slice of the checkpoint's
values by the format's definition: its share of the output rows (q/k/v by heads, kv heads repeated
where tp exceeds them) or of the input columns. A Linear vLLM refuses at a size (its own error) is
no bug. Where vLLM has no matmul kernel for the format on this machine, its kernel choice answers a
stand-in that loading never calls.
gpt-oss (TENSOR_PARALLEL["through_model"]) is split by its model, not by its layers' loaders: the
layer is built as vLLM's gpt-oss builds it (its MLPBlock, the attention's Linears and sinks) inside
a stand-in of its model, whose own load_weights gets the stored tensors. An expert's width is split
in whole 32-column groups, ceil(groups / size) a rank, padded with zeros; w2's bias is rank 0's.
Under expert parallelism (ep sizes) each rank holds whole experts in the slots vLLM's expert_map
gives them, and every expert must be held by exactly one rank."""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from harness.lanes.upstream.parts.checkpoint import rename
from harness.lanes.upstream.parts.common import MODEL_DTYPE, ranges
from harness.lanes.upstream.parts.fp8 import dequantize_definition  # or nvfp4, mxfp4: the format piece
from harness.lanes.upstream.parts.parameters import CONFIG, TENSOR_PARALLEL, WEIGHT_TOLERANCE

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
#: vLLM modules that imported an int4 (WNA16) kernel chooser by name: it returns a kernel class
MP_KERNEL_CHOOSERS = (
    (
        "vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_wNa16",
        "choose_mp_linear_kernel",
    ),
    ("vllm.model_executor.layers.quantization.auto_gptq", "choose_mp_linear_kernel"),
    ("vllm.model_executor.layers.quantization.auto_awq", "choose_mp_linear_kernel"),
)


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
def as_rank(rank, size, expert_parallel=False):
    """vLLM's tensor-parallel group as rank `rank` of `size`; with `expert_parallel`, as
    --enable-expert-parallel makes it: the expert group the same ranks."""
    from vllm.config import get_current_vllm_config
    from vllm.distributed import parallel_state

    names = ("_TP", "_DP", "_PCP", "_EP")
    previous = {name: getattr(parallel_state, name, None) for name in names}
    parallel = get_current_vllm_config().parallel_config
    was_enabled = parallel.enable_expert_parallel
    parallel_state._TP = RankGroup(rank, size)
    for name in names[1:]:
        setattr(parallel_state, name, previous[name] or RankGroup(0, 1))
    if expert_parallel:
        parallel_state._EP = RankGroup(rank, size)
    parallel.enable_expert_parallel = expert_parallel
    try:
        yield
    finally:
        for name, group in previous.items():
            setattr(parallel_state, name, group)
        parallel.enable_expert_parallel = was_enabled


class NoKernelClass(NoKernel):
    """An int4 kernel class vLLM lacks here: its instances stand in as NoKernel does."""

    def __init__(self, *args, **kwargs):
        pass


def whole_words_and_groups(config):
    """Whether a rank's int4 layer has whole groups of inputs and whole int32 words of outputs, as
    every vLLM WNA16 kernel requires (Marlin: input_size_per_partition divisible by group_size)."""
    inputs, outputs = config.partition_weight_shape
    group = config.group_size
    return (group in (-1, None) or inputs % group == 0) and outputs % (32 // config.weight_type.size_bits) == 0


@contextmanager
def loading_without_kernels():
    """vLLM's kernel choosers, answering a stand-in where no kernel fits this machine; an int4
    chooser asked for a rank whose inputs are not whole groups keeps its own refusal (every vLLM
    WNA16 kernel refuses that split)."""
    patched = []
    for module_name, name, answer in [
        *((m, n, NoKernel) for m, n in KERNEL_CHOOSERS),
        *((m, n, NoKernelClass) for m, n in MP_KERNEL_CHOOSERS),
    ]:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if not hasattr(module, name):
            continue
        original = getattr(module, name)

        def choose(*args, _original=original, _answer=answer, **kwargs):
            if _answer is NoKernelClass and not whole_words_and_groups(args[0]):
                return _original(*args, **kwargs)
            try:
                return _original(*args, **kwargs)
            except ValueError as error:
                if "Failed to find a kernel" not in str(error):
                    raise
                return _answer() if _answer is NoKernel else _answer

        patched.append((module, name, original))
        setattr(module, name, choose)
    try:
        yield
    finally:
        for module, name, original in patched:
            setattr(module, name, original)


@contextmanager
def emulated_moe_backend():
    """Where no MXFP4 MoE backend runs on this machine, vLLM's EMULATION (loading never calls it;
    it also sets how vLLM rounds a rank's width: to whole 32-column groups)."""
    module = importlib.import_module("vllm.model_executor.layers.quantization.mxfp4")
    original = module.select_mxfp4_moe_backend

    def choose(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except NotImplementedError:
            return importlib.import_module(original.__module__).Mxfp4MoeBackend.EMULATION, None

    module.select_mxfp4_moe_backend = choose
    try:
        yield
    finally:
        module.select_mxfp4_moe_backend = original


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


def held_values(held, sizes, columns):
    """Each part's rows of what a rank holds, dequantized as vLLM's kernel reads the fused weight:
    row and block scales over the fused rows, per-part scalars (1-D, one per part) part by part.
    A held weight_shape is vLLM's bookkeeping of one part: the kernel reads the held rows and the
    rank's `columns`, so that is the shape the definition is given."""
    shaped = held.pop("weight_shape", None) is not None
    scalars = {n for n, t in held.items() if t.dim() <= 1 and t.numel() == len(sizes)}

    def shape(rows):
        return {"weight_shape": torch.tensor([rows, columns])} if shaped else {}

    if len(sizes) == 1 or not scalars:
        whole = dequantize_definition(held | shape(sum(sizes)))
        return list(torch.split(whole, sizes))
    values, start = [], 0
    for part, size in enumerate(sizes):
        rows = {
            n: (t.reshape(-1)[part].reshape(1) if n in scalars else t[start : start + size]) for n, t in held.items()
        }
        values.append(dequantize_definition(rows | shape(size)))
        start += size
    return values


def rank_problems(linear, size, rank, config, read, expected):
    where = f"tp {size} rank {rank} {linear['prefix'].rpartition('.')[2]}"
    refusal = f"{linear['prefix'].rpartition('.')[2]} refused at tp {size}"
    with as_rank(rank, size):
        try:
            layer = build_linear(linear, config)
        except Exception as error:  # vLLM refuses this split while it builds the layer, in its words: not a bug
            return [], f"{refusal}: {type(error).__name__}: {str(error)[:160]}"
        try:
            feed(layer, linear, read)
        except (RuntimeError, IndexError) as error:  # its weight loader crashing on a layer it built: a bug
            return [f"{where}: vLLM's weight loader fails: {type(error).__name__}: {str(error)[:160]}"], None
        except Exception as error:  # a deliberate refusal while loading (ValueError, NotImplementedError)
            return [], f"{refusal}: {type(error).__name__}: {str(error)[:160]}"
    held = {name: p.detach().clone() for name, p in layer.named_parameters() if name != "bias"}
    # ModelOpt's FP8_PB_WO grid is held 4-D [out blocks, 1, in blocks, 1] until vLLM's processing squeezes it
    held = {name: t[:, 0, :, 0] if t.dim() == 4 else t for name, t in held.items()}
    sizes = [int(s) for s in getattr(layer, "output_partition_sizes", [held[next(iter(held))].shape[0]])]
    try:
        values = held_values(dict(held), sizes, int(getattr(layer, "input_size_per_partition", linear["input_size"])))
    except (RuntimeError, ValueError, IndexError) as error:
        shapes = ", ".join(f"{n} {list(t.shape)}" for n, t in held.items())
        return [f"{where}: what the rank holds cannot be read as the format defines ({shapes}): {error}"], None
    problems = []
    stored = read(linear["parts"][0][0])
    rounded = [n for n, t in held.items() if n in stored and t.is_floating_point() and t.dtype != stored[n].dtype]
    for part, value in enumerate(values):
        module = linear["parts"][part][0]
        axis, first, stop = owned(linear, part, size, rank)
        if TENSOR_PARALLEL.get("rotary") and linear["parts"][part][1] in ("q", "k"):
            value = unpermuted_rows(value, (stop - first) // linear["attention"][2])  # checkpoint row order
        want = expected[module].narrow(axis, first, stop - first)
        if value.shape != want.shape:
            problems.append(f"{where}: {module} held {list(value.shape)}, its slice is {list(want.shape)}")
            continue
        differ = value != want
        note = ""
        if rounded:  # vLLM holds a scale in the model dtype (GPTQ/AWQ's float16 scales): one rounding allowed
            differ = ~((value - want).abs() <= WEIGHT_TOLERANCE["rel"] * want.abs() + WEIGHT_TOLERANCE["abs"])
            note = f"; {', '.join(rounded)} held as {str(held[rounded[0]].dtype)[6:]}: compared within its rounding"
        if bool(differ.any()):
            lines = differ.any(dim=1 - axis).nonzero().flatten() + first
            side = "rows" if axis == 0 else "columns"
            problems.append(
                f"{where}: {module.rpartition('.')[2]} differs from its slice at checkpoint {side} "
                f"{ranges(lines.tolist())} (max |delta| {float((value - want).abs().max()):.3g}{note})"
            )
    return problems, None


def rotary_permutation():
    """What vLLM's model does to each tensor before any loader: Llama-4's Llama4ForCausalLM.load_weights
    permutes each head's q/k rows (and a scale named weight_scale of more than one element) for its
    rotary embedding; nothing for the others."""
    if not TENSOR_PARALLEL.get("rotary"):
        return lambda name, tensor: tensor
    from types import SimpleNamespace

    from vllm.model_executor.models.llama4 import Llama4ForCausalLM

    heads = {key: CONFIG[key] for key in ("num_attention_heads", "num_key_value_heads")}
    model = SimpleNamespace(config=SimpleNamespace(**heads))
    return lambda name, tensor: Llama4ForCausalLM.permute_qk_weight_for_rotary(model, name, tensor)[1]


def unpermuted_rows(value, heads):
    """Rows vLLM permuted for its rotary embedding (each head's (d/2, 2) as (2, d/2)) back in order."""
    rows, columns = value.shape
    return value.reshape(heads, 2, rows // heads // 2, columns).transpose(1, 2).reshape(rows, columns)


def shard_problems(directory, expected):
    """Every rank's problems at each size (against `expected`: each module's weight by the format's
    definition); vLLM's refusals are printed, not problems."""
    if TENSOR_PARALLEL.get("through_model"):
        return gpt_oss_problems(directory, expected)
    handles = [safe_open(str(path), "pt") for path in sorted(Path(directory).glob("*.safetensors"))]

    rotary = rotary_permutation()

    def read(module):
        stored = rename(module) + "."
        return {
            key[len(stored) :]: rotary(key, handle.get_tensor(key))
            for handle in handles
            for key in handle.keys()
            if key.startswith(stored) and "." not in key[len(stored) :]
        }

    problems, refusals = [], []
    with quantization_config(directory) as config, loading_without_kernels():
        mapper = config.get_checkpoint_weight_mapper() if hasattr(config, "get_checkpoint_weight_mapper") else None
        if mapper is not None:  # what vLLM's model loader discards before any layer sees it (GPTQ's g_idx)
            loaded = read

            def read(module, _loaded=loaded):
                kept = {
                    suffix: t
                    for suffix, t in _loaded(module).items()
                    if mapper.map_name(f"{module}.{suffix}") is not None
                }
                return kept

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


def gpt_oss_layer(linears, config):
    """A stand-in of vLLM's GptOssModel holding decoder layer 0: the attention's Linears and sinks as
    OAIAttention makes them, vLLM's own MLPBlock, GptOssModel's loading methods bound to it."""
    import types

    from vllm.config import get_current_vllm_config
    from vllm.distributed import get_tensor_model_parallel_world_size
    from vllm.model_executor.models import gpt_oss

    vllm_config = get_current_vllm_config()
    vllm_config.compilation_config.static_forward_context.pop("model.layers.0.mlp.experts", None)
    block, attention = torch.nn.Module(), torch.nn.Module()
    for linear in linears:
        if linear["expert"] is None and linear["kind"] != "heads":  # the sinks are made below
            setattr(attention, linear["prefix"].rpartition(".")[2], build_linear(linear, config))
    heads = CONFIG["num_attention_heads"] // get_tensor_model_parallel_world_size()
    attention.sinks = torch.nn.Parameter(torch.empty(heads, dtype=MODEL_DTYPE), requires_grad=False)
    block.attn = attention
    block.mlp = gpt_oss.MLPBlock(vllm_config, 0, prefix="model.layers.0.mlp")
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": block})
    model.config, model.parallel_config = vllm_config.model_config.hf_config, vllm_config.parallel_config
    for name in ("load_weights", "_load_weights_mxfp4", "_load_weights_quark", "_load_weights_other"):
        setattr(model, name, types.MethodType(getattr(gpt_oss.GptOssModel, name), model))
    model._try_load_streamed_expert = gpt_oss.GptOssModel._try_load_streamed_expert
    return model


def load_filled(model, stored, byte):
    """The model's parameters after its load_weights, into storage filled with `byte`."""
    from vllm.model_executor.models.gpt_oss import GptOssForCausalLM

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.data.view(torch.uint8).fill_(byte)
    weights = GptOssForCausalLM.hf_to_vllm_mapper.apply((n, t.clone()) for n, t in stored.items())
    model.load_weights((name.removeprefix("model."), tensor) for name, tensor in weights)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def group_split(width, size, rank):
    """[start, stop) of an expert's width rank `rank` of `size` owns: whole 32-column groups,
    ceil(groups / size) a rank (the last ranks shorter or empty)."""
    per_rank = -(-(width // 32) // size) * 32
    start = min(rank * per_rank, width)
    return start, min(start + per_rank, width)


def unwritten(first, last):
    return (
        int(
            (first.reshape(first.numel(), -1).view(torch.uint8) != last.reshape(last.numel(), -1).view(torch.uint8))
            .any(dim=1)
            .sum()
        )
        if first.numel()
        else 0
    )


def expert_problems(where, held, first, made, expert, span, rank, stored, expected):
    """One expert's w13 and w2 as a rank holds them (its slot of each stacked parameter; `span`: the
    share of its width) against the definition's slice; padding must be zero bytes."""
    start, stop = span
    problems = []
    base = f"model.layers.0.mlp.experts.{expert}"
    for group, module, axis in (("w13", f"{base}.gate_up_proj", 0), ("w2", f"{base}.down_proj", 1)):
        tensors, pads = {}, 0
        for suffix, per_column in (("weight", 2), ("weight_scale", 32), ("bias", None)):
            tensor, before, created = (t[f"{group}_{suffix}"] for t in (held, first, made))
            if axis == 0:
                share = (slice(0, 2 * (stop - start)),)
            elif per_column is None:
                share = (slice(None),)
            else:
                share = (slice(None), slice(0, (stop - start) // per_column))
            count = unwritten(before[share], tensor[share])
            if count:
                problems.append(f"{where} experts.{expert}.{group}: {count} element(s) of {suffix} never written")
            outside = torch.ones(tensor.shape, dtype=torch.bool)
            outside[share] = False
            pads += int(created[outside].reshape(-1).view(torch.uint8).ne(0).sum()) if outside.any() else 0
            tensors[suffix] = tensor[share]
        if pads:
            problems.append(f"{where} experts.{expert}.{group}: the padding past its share is not zero bytes")
        if stop == start:
            continue  # a rank with no share of the width holds padding only
        value = dequantize_definition({"weight_packed": tensors["weight"], "weight_scale": tensors["weight_scale"]})
        want = expected[module]
        want = want[2 * start : 2 * stop] if axis == 0 else want[:, start:stop]
        bias = stored[f"{module}.bias"]
        if axis == 0:
            bias = bias[2 * start : 2 * stop]
        elif rank > 0:
            bias = torch.zeros_like(bias)  # every rank adds its w2 bias before the all-reduce: rank 0's alone
        if value.shape != want.shape or not torch.equal(value, want):
            held_from = [
                e
                for e in range(CONFIG["num_local_experts"])
                if torch.equal(value, cut_expert(expected, e, group, span))
            ]
            whose = f" (it holds expert {', '.join(map(str, held_from))}'s)" if held_from else ""
            problems.append(
                f"{where} experts.{expert}.{group}: {module.rpartition('.')[2]} differs from its slice{whose}"
            )
        elif not torch.equal(tensors["bias"].to(torch.float64), bias.to(torch.float64)):
            problems.append(f"{where} experts.{expert}.{group}: its bias differs from its slice")
    return problems


def cut_expert(expected, expert, group, span):
    start, stop = span
    if group == "w13":
        return expected[f"model.layers.0.mlp.experts.{expert}.gate_up_proj"][2 * start : 2 * stop]
    return expected[f"model.layers.0.mlp.experts.{expert}.down_proj"][:, start:stop]


def loaded_rank(linears, config, disk, size, rank, parallel):
    """One rank's layer: its parameters as created, after a load into 0x00 and into 0xFF bytes, and
    the slot of each expert (-1: another rank's); vLLM's refusal propagates."""
    with as_rank(rank, size, parallel == "ep"):
        model = gpt_oss_layer(linears, config)
        made = {n: p.detach().clone() for n, p in model.named_parameters()}
        first, held = (load_filled(model, disk, byte) for byte in (0x00, 0xFF))
    experts = model.layers["0"].mlp.experts
    expert_map = getattr(getattr(experts, "routed_experts", experts), "_expert_map", None)
    slots = list(range(CONFIG["num_local_experts"])) if expert_map is None else expert_map.tolist()
    return made, first, held, slots


def attention_problems(where, linears, first, held):
    """Elements of the attention's weights and biases that the load never wrote."""
    problems = []
    for linear in (item for item in linears if item["expert"] is None and item["kind"] != "heads"):
        name = linear["prefix"].rpartition(".")[2]
        for suffix in ("weight", "bias"):
            key = f"layers.0.attn.{name}.{suffix}"
            count = unwritten(first[key], held[key]) if key in held else 0
            if count:
                problems.append(f"{where} {name}: {count} element(s) of {suffix} never written")
    return problems


def gpt_oss_problems(directory, expected):
    """Every rank's problems at each tensor-parallel size (attention and experts) and expert-parallel
    size (experts), vLLM's refusals printed as notes."""
    handles = [safe_open(str(path), "pt") for path in sorted(Path(directory).glob("*.safetensors"))]
    prefix = rename("model.layers.0.")
    disk = {
        "model.layers.0." + k[len(prefix) :]: h.get_tensor(k) for h in handles for k in h.keys() if k.startswith(prefix)
    }
    stored = {}  # per-expert views of the packed biases
    for name, tensor in disk.items():
        if name.endswith("_bias") and ".experts." in name:
            base, _, projection = name.removesuffix("_bias").rpartition(".")
            stored |= {f"{base}.{e}.{projection}.bias": tensor[e] for e in range(tensor.shape[0])}
    linears = TENSOR_PARALLEL["linears"]
    problems, refusals = [], []
    with quantization_config(directory) as config, loading_without_kernels(), emulated_moe_backend():
        plan = [("tp", s) for s in TENSOR_PARALLEL["sizes"]] + [("ep", s) for s in TENSOR_PARALLEL["ep_sizes"]]
        for parallel, size in plan:
            holders, refused = {}, False
            for rank in range(size):
                where = f"{parallel} {size} rank {rank}"
                try:
                    made, first, held, slots = loaded_rank(linears, config, disk, size, rank, parallel)
                except Exception as error:  # vLLM refuses this split, with its own error: not a bug
                    refusals.append(f"{where}: {type(error).__name__}: {str(error)[:160]}")
                    refused = True
                    continue
                if parallel == "tp":
                    problems += attention_problems(where, linears, first, held)
                params = {
                    n.rpartition(".")[2]: n
                    for n in held
                    if ".mlp.experts." in n and n.rpartition(".")[2][:3] in ("w13", "w2_")
                }
                span = group_split(CONFIG["intermediate_size"], *((1, 0) if parallel == "ep" else (size, rank)))
                for expert, slot in enumerate(slots):
                    if slot >= 0:
                        holders.setdefault(expert, []).append(rank)
                        mine = [{k: t[n][slot] for k, n in params.items()} for t in (held, first, made)]
                        owner = 0 if parallel == "ep" else rank
                        problems += expert_problems(where, *mine, expert, span, owner, stored, expected)
            for expert in range(CONFIG["num_local_experts"]) if parallel == "ep" and not refused else ():
                if len(holders.get(expert, [])) != 1:
                    problems.append(f"ep {size}: expert {expert} held by ranks {holders.get(expert, [])}")
    for refused in refusals:
        print(f"note: vLLM refuses a split (not a bug): {refused}")
    return problems
