"""What each quantized Linear does to its input.

The config specifies how every quantized Linear's input is quantized before the matmul (routed
experts included, which transformers packs into one module per layer: each expert's gate, up and
down projections are Linears in the checkpoint): FP8 e4m3
with scale = amax / 448 per token (compressed-tensors strategy "token"), per group of K along each
token (strategy "group", FineGrainedFP8's dynamic 1 x block activations), per tensor (dynamic: amax
of the whole input; static: the stored `input_scale`). Each module's input and output are recorded
during the engine's own forward pass, in the shapes the model gives them; the output must be what
the module's held weight computes from the input quantized so (the "specified" output), not from
the raw input (the "weight-only" output). A module is judged per token (row): wrong when some row
is further from the specified output than a quarter of the two outputs' distance (relative norms).
Judged in float32 only, where that distance is ~1e-2 and the numerical noise ~1e-6: in bfloat16 an
engine's own rounding of the quantized input moved a static-scale module's output 0.048 from this
definition with the two outputs 0.024 apart (measured on a llama ct-fp8-tensor checkpoint)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from harness.lanes.upstream.parts.checkpoint import rename
from harness.lanes.upstream.parts.common import MODEL_DTYPE
from harness.lanes.upstream.parts.parameters import CONFIG, PACKED_EXPERTS

# ---- reproduce.py ----

E4M3_MAX_INPUT = 448.0


def activation_scheme() -> dict | None:
    """The input activations the config specifies: {"strategy", "dynamic", "group_size"}, or None."""
    config = CONFIG["quantization_config"]
    if config.get("quant_method") == "fp8" and "weight_block_size" not in config:  # vLLM's / AutoFP8's per tensor
        return {"strategy": "tensor", "dynamic": config.get("activation_scheme") == "dynamic", "group_size": None}
    if config.get("quant_method") == "fp8":  # FineGrainedFP8: dynamic 1 x block_cols groups
        if config.get("activation_scheme") != "dynamic":
            return None
        if config["weight_block_size"] is None:  # one scale per weight: per token
            return {"strategy": "token", "dynamic": True, "group_size": None}
        return {"strategy": "group", "dynamic": True, "group_size": config["weight_block_size"][1]}
    for group in (config.get("config_groups") or {}).values():
        inputs = group.get("input_activations")
        if inputs and (inputs.get("type"), inputs.get("num_bits")) == ("float", 8):
            return {
                "strategy": inputs["strategy"],
                "dynamic": inputs["dynamic"],
                "group_size": inputs.get("group_size"),
            }
    if config.get("quant_method") == "modelopt":  # static per-tensor input_scale
        return {"strategy": "tensor", "dynamic": False, "group_size": None}
    return None


def quantize_input(x: torch.Tensor, scheme: dict, input_scale) -> torch.Tensor:
    """The input as the config specifies it quantized: e4m3(x / scale) * scale, in float64."""
    rows = x.reshape(-1, x.shape[-1]).float()
    if not scheme["dynamic"]:
        scale = input_scale.float().reshape(1, 1)
    elif scheme["strategy"] == "tensor":
        scale = rows.abs().amax().reshape(1, 1) / E4M3_MAX_INPUT
    elif scheme["strategy"] == "token":
        scale = rows.abs().amax(dim=1, keepdim=True) / E4M3_MAX_INPUT
    else:  # group: each token's consecutive group_size columns
        size = scheme["group_size"]
        groups = -(-rows.shape[1] // size)
        padded = torch.nn.functional.pad(rows.abs(), (0, groups * size - rows.shape[1]))
        amax = padded.reshape(rows.shape[0], groups, size).amax(dim=2)
        scale = amax.repeat_interleave(size, dim=1)[:, : rows.shape[1]] / E4M3_MAX_INPUT
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = (rows / scale).clamp(-E4M3_MAX_INPUT, E4M3_MAX_INPUT).to(torch.float8_e4m3fn)
    return (codes.double() * scale.double()).reshape(x.shape)


class ActivationRecorder:
    """The first input and output of each named module during the forward passes it is open for;
    and of each routed-experts module transformers packs into 3-D parameters (its hidden states,
    the experts each token is routed to and their weights)."""

    def __init__(self, model: torch.nn.Module, names):
        self.model, self.names, self.seen, self.experts, self.handles = model, set(names), {}, {}, []

    def __enter__(self):
        for name, module in self.model.named_modules():
            if name in self.names:
                self.handles.append(module.register_forward_hook(self.hook(name)))
            packed = getattr(module, "gate_up_proj", None)
            if PACKED_EXPERTS and isinstance(packed, torch.Tensor) and packed.dim() == 3:
                self.handles.append(module.register_forward_hook(self.hook_experts(name), with_kwargs=True))
        return self

    def hook(self, name):
        def record(module, inputs, output):
            if name not in self.seen and inputs and isinstance(output, torch.Tensor):
                self.seen[name] = (inputs[0].detach().clone(), output.detach().clone(), module)

        return record

    def hook_experts(self, name):
        def record(module, args, kwargs, output):
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            if name not in self.experts and len(tensors) == 3 and isinstance(output, torch.Tensor):
                self.experts[name] = ([t.detach().clone() for t in tensors], output.detach().clone())

        return record

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def linear_candidates(x, module, weight, scheme, scale):
    """(specified, weight-only) outputs of one Linear holding `weight` on input `x`."""
    bias = getattr(module, "bias", None)
    bias = bias.detach().double() if isinstance(bias, torch.Tensor) else 0.0
    specified = quantize_input(x, scheme, scale) @ weight.T + bias
    return specified, x.double() @ weight.T + bias


def expert_candidates(name, tensors, held, scheme, scale_of):
    """(specified, weight-only) outputs of a routed-experts module: every token's experts (SiLU-gated,
    as config.json's hidden_act says) from the per-expert weights held, each expert Linear's input
    quantized as specified in the first; None where the call is not (hidden states [T, H], expert
    indices [T, k], routing weights [T, k]) or the activation is another."""
    x, index, weights = tensors
    gate, up, down = PACKED_EXPERTS["parts"]
    if CONFIG.get("hidden_act") != "silu" or up is None or x.dim() != 2 or index.is_floating_point():
        return None
    base = f"{name.rpartition('.experts')[0].rpartition('.')[0]}.{PACKED_EXPERTS['block']}.experts"
    results = []
    for quantized in (True, False):
        total = torch.zeros(x.shape, dtype=torch.float64)
        for expert in index.unique().tolist():
            if f"{base}.{expert}.{gate}" not in held:
                continue  # a padding index past the experts
            tokens, slots = torch.where(index == expert)

            def linear(rows, part, expert=expert, quantized=quantized):
                weight = held[f"{base}.{expert}.{part}"].double()
                rows = quantize_input(rows, scheme, scale_of(f"{base}.{expert}.{part}")) if quantized else rows.double()
                return rows @ weight.T

            hidden = x[tokens].double()
            activated = torch.nn.functional.silu(linear(hidden, gate)) * linear(hidden, up)
            out = linear(activated, down) * weights[tokens, slots].double().unsqueeze(-1)
            total.index_add_(0, tokens, out)
        results.append(total)
    return tuple(results)


def relative_rows(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    got, want = got.reshape(-1, got.shape[-1]).double(), want.reshape(-1, want.shape[-1]).double()
    norms = want.norm(dim=1)
    return (got - want).norm(dim=1) / torch.where(norms > 0, norms, torch.ones_like(norms))


def activation_problems(recorder: ActivationRecorder, held: dict, directory) -> tuple[list[str], list[str]]:
    """(problems, notes): one problem per kind of deviation, naming its modules and the worst."""
    scheme = activation_scheme()
    if MODEL_DTYPE != torch.float32:
        raise RuntimeError(f"activations are judged in float32 only, this checkpoint is {MODEL_DTYPE}")
    if scheme is None:
        return [], ["the config specifies no FP8 input activations: not judged"]
    if not recorder.seen and not recorder.experts:
        raise RuntimeError("no quantized Linear's forward was seen: the activations cannot be judged")
    stored = {}
    for file in Path(directory).glob("*.safetensors"):
        stored |= {k: v for k, v in load_file(str(file)).items() if k.endswith(".input_scale")}
    candidates = {}  # module -> (output, specified, weight-only, input shape)
    for name, (x, output, module) in sorted(recorder.seen.items()):
        scale = stored.get(f"{rename(name)}.input_scale")
        if name in held and (scheme["dynamic"] or scale is not None):
            candidates[name] = (output, *linear_candidates(x, module, held[name].double(), scheme, scale), x.shape)
    for name, (tensors, output) in sorted(recorder.experts.items()):
        found = expert_candidates(name, tensors, held, scheme, lambda part: stored.get(f"{rename(part)}.input_scale"))
        if found is not None:
            candidates[name] = (output, *found, tensors[0].shape)
    verdicts = {}
    for name, (output, specified, weights_only, shape) in candidates.items():
        apart = relative_rows(specified, weights_only)
        if bool((apart < 1e-4).all()):
            continue  # quantizing this input changes nothing measurable
        off, plain = relative_rows(output, specified), relative_rows(output, weights_only)
        if bool((off <= apart / 4).all()):
            verdicts[name] = ("as specified", off, plain, apart, shape)
        else:
            kind = "not applied" if bool((plain <= apart / 4).all()) else "not as specified"
            verdicts[name] = (kind, off, plain, apart, shape)
    words = f"{scheme['strategy']} {'dynamic' if scheme['dynamic'] else 'static'} FP8 input activations"
    notes = [
        f"activations: {sum(v[0] == 'as specified' for v in verdicts.values())}/{len(verdicts)} "
        f"quantized Linear(s) and routed-experts module(s) as specified ({words}), of "
        f"{len(recorder.seen) + len(recorder.experts)} seen in the forward pass"
    ]
    problems = []
    for kind in ("not applied", "not as specified"):
        failed = {name: v for name, v in verdicts.items() if v[0] == kind}
        if not failed:
            continue
        name, (_, off, plain, apart, shape) = max(failed.items(), key=lambda item: float(item[1][1].max()))
        problems.append(
            f"activation quantization {kind} ({words}) at {len(failed)}/{len(verdicts)} module(s): "
            f"{', '.join(sorted(failed)[:6])}{' ...' if len(failed) > 6 else ''}; e.g. {name}, input "
            f"{list(shape)}: output {float(off.max()):.2g} from the specified one, {float(plain.max()):.2g} "
            f"from the weight-only one, the two {float(apart.min()):.2g} apart (relative norms, worst token)"
        )
    return problems, notes
