"""What each quantized Linear does to its input.

The config specifies how every quantized Linear's input is quantized before the matmul: FP8 e4m3
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
from harness.lanes.upstream.parts.parameters import CONFIG

# ---- reproduce.py ----

E4M3_MAX_INPUT = 448.0


def activation_scheme() -> dict | None:
    """The input activations the config specifies: {"strategy", "dynamic", "group_size"}, or None."""
    config = CONFIG["quantization_config"]
    if config.get("quant_method") == "fp8":  # FineGrainedFP8: dynamic 1 x block_cols groups
        if config.get("activation_scheme") != "dynamic":
            return None
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
    """The first input and output of each named module during the forward passes it is open for."""

    def __init__(self, model: torch.nn.Module, names):
        self.model, self.names, self.seen, self.handles = model, set(names), {}, []

    def __enter__(self):
        for name, module in self.model.named_modules():
            if name in self.names:
                self.handles.append(module.register_forward_hook(self.hook(name)))
        return self

    def hook(self, name):
        def record(module, inputs, output):
            if name not in self.seen and inputs and isinstance(output, torch.Tensor):
                self.seen[name] = (inputs[0].detach().clone(), output.detach().clone(), module)

        return record

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


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
    if not recorder.seen:
        raise RuntimeError("no quantized Linear's forward was seen: the activations cannot be judged")
    stored = {}
    for file in Path(directory).glob("*.safetensors"):
        stored |= {k: v for k, v in load_file(str(file)).items() if k.endswith(".input_scale")}
    verdicts = {}
    for name, (x, output, module) in sorted(recorder.seen.items()):
        if name not in held:
            continue
        weight = held[name].double()
        bias = getattr(module, "bias", None)
        bias = bias.detach().double() if isinstance(bias, torch.Tensor) else 0.0
        scale = stored.get(f"{rename(name)}.input_scale")
        if not scheme["dynamic"] and scale is None:
            continue
        specified = quantize_input(x, scheme, scale) @ weight.T + bias
        weights_only = x.double() @ weight.T + bias
        apart = relative_rows(specified, weights_only)
        if bool((apart < 1e-4).all()):
            continue  # quantizing this input changes nothing measurable
        off, plain = relative_rows(output, specified), relative_rows(output, weights_only)
        if bool((off <= apart / 4).all()):
            verdicts[name] = ("as specified", off, plain, apart, x.shape)
        else:
            kind = "not applied" if bool((plain <= apart / 4).all()) else "not as specified"
            verdicts[name] = (kind, off, plain, apart, x.shape)
    words = f"{scheme['strategy']} {'dynamic' if scheme['dynamic'] else 'static'} FP8 input activations"
    notes = [
        f"activations: {sum(v[0] == 'as specified' for v in verdicts.values())}/{len(verdicts)} "
        f"quantized Linear(s) as specified ({words}), of {len(recorder.seen)} seen in the forward pass"
    ]
    problems = []
    for kind in ("not applied", "not as specified"):
        failed = {name: v for name, v in verdicts.items() if v[0] == kind}
        if not failed:
            continue
        name, (_, off, plain, apart, shape) = max(failed.items(), key=lambda item: float(item[1][1].max()))
        problems.append(
            f"activation quantization {kind} ({words}) at {len(failed)}/{len(verdicts)} quantized Linear(s): "
            f"{', '.join(sorted(failed)[:6])}{' ...' if len(failed) > 6 else ''}; e.g. {name}, input "
            f"{list(shape)}: output {float(off.max()):.2g} from the specified one, {float(plain.max()):.2g} "
            f"from the weight-only one, the two {float(apart.min()):.2g} apart (relative norms, worst token)"
        )
    return problems, notes
