"""reproduce.py, generated: one standalone file per reproducer, joined from the pieces in `parts/`
(one per format family, one per engine, shared checkpoint writing and judging) and the reproducer's
own parameters (the recipe's config.json, knobs, layout and perturbations, what a correct loader
does, the weight tolerance)."""

from __future__ import annotations

import ast
import json
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

from harness.checkpoints.writer import generate
from harness.core.errors import HarnessError
from harness.core.tolerances import load_tolerances
from harness.differential.relations import RELATIONS
from harness.engines import ENGINES
from harness.engines.vllm.capability import MISSING_KERNEL
from harness.lanes.upstream.source import Reproducer

PARTS = Path(__file__).resolve().parent / "parts"
MARKER = "# ---- reproduce.py ----"
#: the piece that holds each format's quantizer and definition
FORMAT_PIECES = {
    "fp8-block": "fp8",
    "ct-fp8-tensor": "fp8",
    "ct-fp8-channel": "fp8",
    "ct-fp8-block": "fp8",
    "modelopt-fp8": "fp8",
    "autofp8": "fp8",
    "ct-nvfp4": "nvfp4",
    "ct-nvfp4a16": "nvfp4",
    "modelopt-nvfp4": "nvfp4",
    "ct-mxfp4": "mxfp4",
    "mxfp4": "mxfp4",
    "ct-int4": "integer",
    "ct-int8": "integer",
    "ct-w8a8": "integer",
    "gptq": "gptq_awq",
    "awq": "gptq_awq",
}
ENGINE_PIECES = {
    "transformers": ("modules", "engine_transformers"),
    "compressed-tensors": ("modules", "engine_ct"),
    "vllm": ("engine_vllm",),
}
#: how each engine is asked, for the reader
ENGINE_APIS = {
    "transformers": "`AutoModelForCausalLM.from_pretrained`",
    "compressed-tensors": "`apply_quantization_config` and `ModelCompressor.compress_model` / `decompress_model`",
    "vllm": "`vllm.LLM` (eager, small KV cache, no tokenizer)",
}
#: what the script compares, for the reader
CHECKS = {
    "transformers": "compares the weights it holds with the format's definition, computed in plain torch",
    "compressed-tensors": "compares the weights it holds with the format's definition, computed in plain torch",
    "vllm": "checks its layers' sizes against config.json and runs a forward pass (vLLM repacks its weights)",
}
THIRD_PARTY = ("torch", "safetensors")


@dataclass
class Script:
    text: str
    expectation: str  # exact, refuse, exact-or-refuse
    expected: str  # what a correct loader does, in words
    definition: str  # the format's definition, in words
    format: str
    package: str  # the engine's importable package


def pieces(
    format_name: str, engine: str, relation: str | None = None, activations: bool = False, kv_cache: bool = False
) -> list[str]:
    if format_name not in FORMAT_PIECES:
        raise HarnessError(f"no standalone reproducer for format '{format_name}' (known: {', '.join(FORMAT_PIECES)})")
    checked = [f"relation_{engine.replace('-', '_')}"] if relation else []
    checked += ["activations"] if activations else []
    checked += ["kv_cache_vllm"] if kv_cache else []
    return ["common", FORMAT_PIECES[format_name], "checkpoint", *ENGINE_PIECES[engine], *checked, "main"]


@dataclass
class Piece:
    header: ast.Module  # what stands above the marker, parsed: its docstring and imports
    body: str  # what follows the marker: copied into the script

    @property
    def docstring(self) -> list[str]:
        return (ast.get_docstring(self.header) or "").splitlines()

    def section(self, definition: str | None) -> str:
        """The piece as a section of the script: its docstring as comments (the format piece's
        definitions narrowed to the script's format), then its code."""
        title, *rest = self.docstring or ["(untitled)"]
        prose = [line for line in rest if line and not line.startswith("  ") and line != "Definitions:"]
        comments = [f"# {line}" for line in prose] + ([f"# Definition: {definition}"] if definition else [])
        return "\n".join([f"# ---- {title.rstrip('.')} ----", *comments, "", self.body])


def read_piece(name: str) -> Piece:
    text = (PARTS / f"{name}.py").read_text()
    head, marker, body = text.partition(MARKER)
    if not marker:
        raise HarnessError(f"{PARTS / name}.py has no `{MARKER}` line")
    return Piece(ast.parse(head), body.strip("\n"))


def definition_of(format_name: str, knobs: dict) -> str:
    """The format's definition, as its piece's docstring states it (`  NAME: W = ...`)."""
    for line in read_piece(FORMAT_PIECES[format_name]).docstring:
        name, colon, text = line.strip().partition(": ")
        if colon and name == format_name:
            return text.format(**knobs)
    raise HarnessError(f"parts/{FORMAT_PIECES[format_name]}.py states no definition for {format_name}")


def literal(value, indent: int = 0) -> str:
    """A Python literal of JSON-like data, one item a line where it does not fit on one."""
    if isinstance(value, str):  # json's string literal is a valid Python one
        chunks = textwrap.wrap(value, 84, drop_whitespace=False, break_on_hyphens=False)
        if indent or len(chunks) < 2 or "".join(chunks) != value:
            return json.dumps(value)
        return "(\n" + "".join(f"    {json.dumps(chunk)}\n" for chunk in chunks) + ")"
    if isinstance(value, float) and value != value or value in (float("inf"), float("-inf")):
        return f"float({str(value)!r})"
    if not isinstance(value, (dict, list, tuple)) or not value:
        return repr(value)
    pairs = value.items() if isinstance(value, dict) else None
    items = [f"{literal(k)}: {literal(v, indent + 1)}" for k, v in pairs] if pairs is not None else None
    items = items if items is not None else [literal(v, indent + 1) for v in value]
    opening, closing = ("{", "}") if isinstance(value, dict) else ("[", "]")
    flat = opening + ", ".join(items) + closing
    if len(flat) + 4 * indent <= 88 and "\n" not in flat:
        return flat
    pad = "    " * (indent + 1)
    return opening + "\n" + "".join(f"{pad}{item},\n" for item in items) + "    " * indent + closing


def imports_of(headers: list[ast.Module]) -> tuple[list[str], list[str]]:
    """(standard library import lines, third-party ones) the pieces need; never this project's."""
    names: dict[str, set[str]] = {}
    for header in headers:
        for node in header.body:
            if isinstance(node, ast.Import):
                names.update({alias.name: names.get(alias.name, set()) for alias in node.names})
            elif isinstance(node, ast.ImportFrom) and node.module not in ("__future__", None):
                names.setdefault(node.module, set()).update(alias.name for alias in node.names)
    names.setdefault("sys", set())
    stdlib, third = [], []
    ordered = sorted((bool(names[m]), m) for m in names if not m.startswith("harness"))  # `import x` first
    for _, module in ordered:
        line = f"from {module} import {', '.join(sorted(names[module]))}" if names[module] else f"import {module}"
        (stdlib if module.partition(".")[0] in sys.stdlib_module_names else third).append(line)
        if module.partition(".")[0] not in (*THIRD_PARTY, *sys.stdlib_module_names):
            raise HarnessError(f"a script piece imports {module} at module level: only torch and safetensors may be")
    return stdlib, third


def parameter_comments() -> dict[str, list[str]]:
    """The `#:` comment lines above each parameter in parts/parameters.py, by name."""
    lines = (PARTS / "parameters.py").read_text().splitlines()
    comments: dict[str, list[str]] = {}
    for node in ast.parse("\n".join(lines)).body:
        if isinstance(node, ast.Assign):
            above, row = [], node.lineno - 2
            while row >= 0 and lines[row].startswith("#:"):
                above.insert(0, "# " + lines[row][2:].strip())
                row -= 1
            comments[node.targets[0].id] = above
    return comments


def render_parameters(values: dict) -> str:
    comments = parameter_comments()
    if set(values) != set(comments):
        raise HarnessError(f"script parameters {sorted(values)} are not parts/parameters.py's {sorted(comments)}")
    out = []
    for name in comments:
        out += comments[name]
        out.append(f"{name} = {literal(values[name])}")
    return "\n".join(out)


def docstring(reproducer: Reproducer, values: dict, package: str) -> str:
    lines = [
        f"Reproducer: {reproducer.id} ({reproducer.engine}, {values['FORMAT']} {values['CONFIG']['model_type']}).",
        "",
        *textwrap.wrap(reproducer.mechanism, 96),
        "",
        *textwrap.wrap(f"Expected: a correct loader {values['EXPECTED']}.", 96),
        "",
        *textwrap.wrap(
            "Builds the checkpoint (config.json and quantized safetensors, computed here with torch) in a "
            f"temporary directory, {how_judged(reproducer)}. Needs only torch, safetensors and {package}. "
            "Run: python reproduce.py",
            96,
        ),
        "Exit 1 while the bug is present, 0 once it is fixed, 2 when it cannot run here.",
        f"Generated by quant-load-harness from {reproducer.source} (python -m harness upstream).",
    ]
    return "\n".join(lines).replace("\\", "\\\\").replace('"""', '\\"\\"\\"')


def how_judged(reproducer: Reproducer) -> str:
    if judges_vllm_kv_cache(reproducer):
        return (
            "calls vLLM's CPU attention op that writes its FP8 KV cache (cpu_attn_reshape_and_cache) on random "
            "keys and values with the checkpoint's first-layer k/v scales, and compares the cache with the "
            "definition"
        )
    if reproducer.relation == "tensor-parallel":
        return (
            "builds the first decoder layer's parallel Linears with vLLM under a mocked tensor-parallel rank, "
            "feeds them the checkpoint through their own weight_loaders, and compares what each rank holds "
            "with its slice of the format's definition"
        )
    second = f", then loads it a second way ({reproducer.relation}) and compares" if reproducer.relation else ""
    options = ", ".join(f"{key}={value}" for key, value in sorted(reproducer.engine_options.items()))
    api = ENGINE_APIS[reproducer.engine] + (f" ({options})" if options else "")
    return f"loads it with {api}, and {CHECKS[reproducer.engine]}{second}"


def checkpoint_facts(reproducer: Reproducer) -> tuple[dict, dict]:
    """(config.json, harness_manifest.json) of the recipe's checkpoint as the harness generates it:
    the same config, and the harness's own words for what a correct loader must do."""
    with tempfile.TemporaryDirectory(prefix="harness-upstream-") as scratch:
        directory = Path(scratch) / "checkpoint"
        manifest = generate(reproducer.recipe, directory)
        return json.loads((directory / "config.json").read_text()), manifest


def tensor_table(reproducer: Reproducer) -> dict[str, list]:
    """The float model's tensors as the harness's writer lays them out: name -> [shape, role]."""
    resolved = reproducer.recipe.resolved()
    layout = resolved.arch.tensor_layout(resolved.settings)
    return {name: [list(shape), role] for name, (shape, role) in layout.items()}


def packed_experts(recipe) -> dict | None:
    """How transformers holds the architecture's routed experts packed, for the script to split
    (the experts' part names as the recipe writes them)."""
    moe = recipe.resolved().arch.moe
    if moe is None:
        return None
    if moe.fused_gate_up:  # gpt-oss: each expert's gate_up_proj is one Linear, held [E, K, N]
        return {"block": moe.block, "parts": ["gate_up_proj", None, "down_proj"], "transposed": True}
    return {"block": moe.block, "parts": list(moe.parts), "transposed": moe.held_transposed}


def tensor_parallel_linears(config: dict) -> dict:
    """The tensor-parallel relation's sizes and the first decoder layer's parallel Linears, as the
    harness's lane builds them (harness.engines.vllm.tensor_parallel.layout), as data for the script."""
    from harness.differential.relations import EP_SIZES, TP_SIZES
    from harness.engines.vllm.tensor_parallel.layout import INTERLEAVED, ROTARY_PERMUTED, decoder_linears

    linears = []
    for linear in decoder_linears(config, 0):
        attention = linear.attention
        linears.append(
            {
                "prefix": linear.module(0),
                "kind": linear.kind,
                "parts": [[linear.part_module(0, part), part.shard_id, part.rows] for part in linear.parts],
                "input_size": linear.input_size,
                "bias": linear.bias,
                "attention": [attention.heads, attention.kv_heads, attention.head_dim] if attention else None,
                "expert": linear.expert,
            }
        )
    architecture = (config.get("architectures") or ["?"])[0]
    through_model = architecture in INTERLEAVED  # gpt-oss: its model splits
    experts = any(linear["expert"] is not None for linear in linears)
    return {
        "sizes": list(TP_SIZES),
        "ep_sizes": list(EP_SIZES) if experts else [],
        "linears": linears,
        "through_model": through_model,
        "rotary": architecture in ROTARY_PERMUTED,  # Llama-4: q/k rows permuted before the loaders
    }


def disagreement_target(resolved, table: dict[str, list]) -> dict | None:
    """The module the recipe's disagreement is applied to, and its main scale, as the harness's
    writer picks them (from `tensor_table`'s quantized Linears)."""
    from harness.checkpoints import disagreements
    from harness.formats import get_format

    if resolved.perturb["disagreement"] == "none":
        return None
    module = disagreements.target_module(
        [n.removesuffix(".weight") for n, (_, role) in table.items() if role == "linear"]
    )
    fmt = get_format(resolved.recipe.format)
    if resolved.perturb["disagreement"] == "missing-input-scale":
        return {"module": module, "scale": disagreements.input_scale(list(fmt.suffixes))}
    return {"module": module, "scale": disagreements.main_scale(list(fmt.suffixes), fmt.marker)}


def expected_words(engine: str, expectation: str, definition: str, notes: list[str], tolerance: str) -> str:
    held = (
        "sizes every layer as config.json says and runs a forward pass with finite log-probabilities"
        if engine == "vllm"
        else f"holds every quantized weight as the format defines it ({definition}; within {tolerance}) "
        "and runs a forward pass"
    )
    why = f" ({'; '.join(notes)})" if notes else ""
    if expectation == "refuse":
        return f"refuses the checkpoint when loading it{why}"
    if expectation == "exact-or-refuse":
        return f"refuses the checkpoint, or loads it and {held}{why}"
    return f"loads the checkpoint and {held}"


def perturbation_notes(manifest: dict) -> list[str]:
    """What the generator did to the checkpoint, once each (the first module's notes, the checkpoint's)."""
    notes = [*manifest.get("notes", [])]
    for info in manifest["modules"].values():
        notes += [n for n in info.get("notes", []) if n not in notes]
        if info.get("notes"):
            break
    return notes


#: the engines that read routed experts back per expert (transformers' packed 3-D experts, split by
#: PACKED_EXPERTS); the compressed-tensors piece builds Linears, vLLM's experts are not read
SCRIPT_EXPERT_ENGINES = ("transformers",)
SCRIPT_LAYOUT = (
    "dtype",
    "key_prefix",
    "shards",
    "split_scale",
    "activation_amax",
    "quantize_lm_head",
    "quantize_embeddings",
    "kv_scales",
    "expert_naming",  # the tensor table and the packed experts' part names carry it
    "config_style",  # CONFIG is the generated config.json, as written
    "config_spelling",  # the same
    "producer_config",  # the same, and the parts store the row scales as that producer does
)
#: finding kinds a script judges from whether the engine loads at all (no weight read back)
LOAD_ONLY_KINDS = {"accepted-invalid"}
#: the relations a script holds an engine to (parts/relation_transformers.py), by engine
SCRIPT_RELATIONS = {"transformers": ("round-trip", "dequantize", "offload"), "vllm": ("tensor-parallel",)}
#: the engines whose model is a torch module tree the script can record each Linear's input in
ACTIVATION_ENGINES = ("transformers", "compressed-tensors")
#: how a report's activation finding from the per-Linear probe begins (harness.differential.probe)
PROBE_FINDING = "activation probe:"


def unscriptable(reproducer: Reproducer) -> str | None:
    """Why no standalone script can reproduce this, or None when one can: its checkpoint
    (`unexpressible`), a finding kind the scripts do not judge, a relation they do not check."""
    why = unexpressible(reproducer.recipe)
    if why:
        return why
    reads_weights = not set(reproducer.kinds) <= LOAD_ONLY_KINDS
    if reproducer.relation == "tensor-parallel":
        reads_weights = False  # the script reads vLLM's shards of the first decoder layer, judged below
    if reproducer.engine == "vllm" and reproducer.recipe.layout.get("quantize_embeddings"):
        reads_weights = False  # vLLM's script reads the embedding alone (parts/engine_vllm.py), never an expert
    if set(reproducer.kinds) <= {"load-error", "refused-valid"}:
        reads_weights = False  # the script judges whether the engine loads; a load that fails reads nothing
    if reproducer.engine == "vllm" and reproducer.recipe.perturb.get("disagreement") == "index-stale-duplicate":
        # vLLM's script judges layer sizes and a finite forward pass: a stale scale passes both
        return "a stale duplicate's values in vLLM (its script reads no values of a repacked weight)"
    experts = any(".experts." in name for name in tensor_table(reproducer))
    if reads_weights and experts and reproducer.engine not in SCRIPT_EXPERT_ENGINES:
        return f"routed experts ({reproducer.recipe.arch}) with {reproducer.engine}"
    if "activations" in reproducer.kinds and not judges_vllm_kv_cache(reproducer):
        if reproducer.engine not in ACTIVATION_ENGINES:
            return f"activation quantization in {reproducer.engine} (the scripts record a torch model's Linears)"
        if reproducer.recipe.resolved().layout["dtype"] != "float32":
            return "activation quantization in a reduced-precision model (the scripts judge it in float32)"
        if reproducer.finding and not reproducer.finding_pattern.startswith(PROBE_FINDING):
            return "an activations finding from the logits (the scripts judge each Linear and routed-experts module)"
    if reproducer.engine == "vllm" and set(reproducer.kinds) <= {"post-load"}:
        # vLLM's script judges layer sizes and a finite forward pass: a part applying a scaled weight passes both
        return "vLLM's processing after loading (its script reads no weights a kernel applies)"
    if "relation" in reproducer.kinds and reproducer.relation not in SCRIPT_RELATIONS.get(reproducer.engine, ()):
        return f"relation {reproducer.relation or '(unnamed)'} with {reproducer.engine}"
    if reproducer.relation == "tensor-parallel" and any(".experts." in name for name in tensor_table(reproducer)):
        from harness.checkpoints.architectures import ARCHITECTURES
        from harness.engines.vllm.tensor_parallel.layout import INTERLEAVED

        if ARCHITECTURES[reproducer.recipe.arch].class_name not in INTERLEAVED:  # gpt-oss's: parts/relation_vllm.py
            return "tensor-parallel relation on routed experts (the script builds vLLM's dense parallel Linears)"
    return None


def judges_vllm_kv_cache(reproducer: Reproducer) -> bool:
    """An activations issue of vLLM on a checkpoint that declares an FP8 KV cache: the script judges
    the cache vLLM's own op writes (parts/kv_cache_vllm.py)."""
    kv_scales = reproducer.recipe.layout.get("kv_scales", "none")
    return reproducer.engine == "vllm" and "activations" in reproducer.kinds and kv_scales != "none"


def unexpressible(recipe) -> str | None:
    """Why a standalone script cannot write this reproducer's checkpoint, or None when it can."""
    from harness.checkpoints.recipe import LAYOUT_DEFAULTS

    if recipe.format not in FORMAT_PIECES:
        return f"format '{recipe.format}'"
    layout = [k for k, v in recipe.layout.items() if k not in SCRIPT_LAYOUT and v != LAYOUT_DEFAULTS.get(k)]
    if layout:
        return f"layout setting(s) {', '.join(layout)}"
    return None


def render_script(reproducer: Reproducer) -> Script:
    why = unscriptable(reproducer)
    if why:
        raise HarnessError(
            f"{reproducer.id}: no standalone reproducer for its {why} yet; "
            f"reproduce it with `python -m harness check {reproducer.id}`"
        )
    resolved = reproducer.recipe.resolved()
    config, manifest = checkpoint_facts(reproducer)
    format_name = reproducer.recipe.format
    dtype = reproducer.engine_options.get("dtype", resolved.layout["dtype"])  # the dtype the engine computes in
    table = tensor_table(reproducer)  # every architecture's tensors, as the harness writes them
    judge_kv_cache = judges_vllm_kv_cache(reproducer)
    judge_activations = "activations" in reproducer.kinds and not judge_kv_cache
    names = pieces(format_name, reproducer.engine, reproducer.relation, judge_activations, judge_kv_cache)
    parsed = {name: read_piece(name) for name in names}
    tolerance = load_tolerances(format_name, dtype)
    definition = definition_of(format_name, resolved.knobs)
    expected = expected_of(reproducer, resolved, manifest, definition, tolerance, judge_kv_cache, dtype)
    values = {
        "ISSUE": reproducer.id,
        "ENGINE": reproducer.engine,
        "ENGINE_OPTIONS": reproducer.engine_options,
        "FORMAT": format_name,
        "SEED": reproducer.recipe.seed,
        "CONFIG": config,
        "TENSORS": table,
        "PACKED_EXPERTS": packed_experts(reproducer.recipe),
        "KNOBS": resolved.knobs,
        "LAYOUT": script_layout(reproducer.recipe.layout, resolved.layout),
        "PERTURB": resolved.perturb,
        "DISAGREEMENT": disagreement_target(resolved, table),
        "EXPECTATION": manifest["expectation"],
        "EXPECTED": expected,
        "REPORTED_ERROR": reproducer.reported_error,
        "WEIGHT_TOLERANCE": {"rel": tolerance.weight_rel, "abs": tolerance.weight_abs},
        "CANNOT_RUN_HERE": MISSING_KERNEL.pattern if reproducer.engine == "vllm" else None,
        "JUDGE_ACTIVATIONS": judge_activations,
        "JUDGE_KV_CACHE": judge_kv_cache,
        "RELATION": reproducer.relation,
        "TENSOR_PARALLEL": tensor_parallel_linears(config) if reproducer.relation == "tensor-parallel" else None,
    }
    package = ENGINES[reproducer.engine].package
    text = assemble(reproducer, values, parsed, definition, FORMAT_PIECES[format_name], package)
    return Script(text, manifest["expectation"], expected, definition, format_name, package)


def expected_of(
    reproducer: Reproducer, resolved, manifest: dict, definition: str, tolerance, judge_kv_cache: bool, dtype: str
) -> str:
    """What a correct engine does with the checkpoint, in words (the script's EXPECTED); `dtype`:
    the one it computes in."""
    expected = expected_words(
        reproducer.engine,
        manifest["expectation"],
        definition,
        perturbation_notes(manifest) if manifest["expectation"] != "exact" else [],
        f"|held - W| <= {tolerance.weight_rel:g} |W| + {tolerance.weight_abs:.3g}, W rounded once to {dtype}",
    )
    if reproducer.relation == "tensor-parallel":  # no model is loaded: only the shards are judged
        return RELATIONS[reproducer.relation].holds
    if judge_kv_cache:  # no model is loaded: only the cache vLLM's op writes is judged
        return (
            "writes its FP8 KV cache as the checkpoint's kv_cache_scheme defines it: e4m3(x / scale), "
            "rounded to nearest even and saturated at 448, for keys and values"
        )
    if reproducer.relation:
        return expected + f"; and {RELATIONS[reproducer.relation].holds}"
    if reproducer.engine == "vllm" and resolved.layout["kv_scales"] != "none":  # parts/engine_vllm.py
        return expected + "; its FP8 KV cache quantized with the stored k/v scales, none made up"
    return expected


def script_layout(layout: dict, resolved: dict) -> dict:
    """The script's LAYOUT: the resolved layout fields its pieces read (`layout`: the recipe's own)."""
    return {
        "dtype": resolved["dtype"],
        "key_prefix": resolved["key_prefix"],
        "shards": layout.get("shards", 1),  # one file unless the recipe asks for shards
        "split_scale": layout.get("split_scale", False),
        "activation_amax": resolved["activation_amax"],
        "quantize_lm_head": resolved["quantize_lm_head"],
        "quantize_embeddings": resolved["quantize_embeddings"],
        "kv_scales": resolved["kv_scales"],
        # the tensor table and PACKED_EXPERTS already carry the experts' names; said for the reader
        "expert_naming": resolved["expert_naming"],
        "config_style": resolved["config_style"],
        "config_spelling": resolved["config_spelling"],  # said for the reader: CONFIG is as written
        "producer_config": resolved["producer_config"],
    }


def assemble(
    reproducer: Reproducer, values: dict, parsed: dict[str, Piece], definition: str, format_piece: str, package: str
) -> str:
    """The script's text: docstring, guarded imports, the parameters, then each piece's code (the
    format's piece given the definition); compiled once to prove it parses."""
    stdlib, third = imports_of([piece.header for piece in parsed.values()])
    guarded = "\n".join(f"    {line}" for line in third)
    sections = [
        "#!/usr/bin/env python3",
        f'"""{docstring(reproducer, values, package)}\n"""',
        "\n".join(["from __future__ import annotations", "", *stdlib]),
        f"try:\n{guarded}\nexcept ImportError as missing:\n"
        '    print(f"cannot run: {missing} (needs torch and safetensors)")\n    sys.exit(2)',
        f"# ---- what to reproduce ({reproducer.source}) ----\n\n{render_parameters(values)}",
    ]
    code = [piece.section(definition if name == format_piece else None) for name, piece in parsed.items()]
    text = "\n\n".join(sections) + "\n\n\n" + "\n\n\n".join(code) + "\n"
    compile(text, "reproduce.py", "exec")
    return text
