"""The values a reproduce.py is generated with (these are an example: the generator writes each
script's own, from a known issue's reproducer recipe or a report's finding, in their place)."""

ISSUE = "transformers-fp8-block-grid-inferred-from-shape"
ENGINE = "transformers"
#: the options the engine is loaded with (harness.engines.options): `dtype`, a model dtype other
#: than the checkpoint's
ENGINE_OPTIONS = {}
FORMAT = "fp8-block"
SEED = 0
#: config.json as written, quantization_config included
CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 260,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head"],
    },
}
#: every tensor of the float model, name -> [shape, role] (linear: quantized; lm_head: quantized
#: where LAYOUT says so; router, plain, embedding: stored as they are; bias, norm, router_bias)
TENSORS = {
    "model.embed_tokens.weight": [[260, 64], "embedding"],
    "model.layers.0.input_layernorm.weight": [[64], "norm"],
    "model.layers.0.post_attention_layernorm.weight": [[64], "norm"],
    "model.layers.0.self_attn.q_proj.weight": [[128, 64], "linear"],
    "model.layers.0.self_attn.q_proj.bias": [[128], "bias"],
    "model.layers.0.self_attn.k_proj.weight": [[64, 64], "linear"],
    "model.layers.0.self_attn.k_proj.bias": [[64], "bias"],
    "model.layers.0.self_attn.v_proj.weight": [[64, 64], "linear"],
    "model.layers.0.self_attn.v_proj.bias": [[64], "bias"],
    "model.layers.0.self_attn.o_proj.weight": [[64, 128], "linear"],
    "model.layers.0.mlp.gate_proj.weight": [[160, 64], "linear"],
    "model.layers.0.mlp.up_proj.weight": [[160, 64], "linear"],
    "model.layers.0.mlp.down_proj.weight": [[64, 160], "linear"],
    "model.norm.weight": [[64], "norm"],
    "lm_head.weight": [[260, 64], "lm_head"],
}
#: how transformers holds a sparse layer's experts packed in 3-D parameters ({"block": the
#: checkpoint's block name, "parts": an expert's gate, up (None: fused with gate, gpt-oss) and
#: down, "transposed": held [E, K, N]}), or None
PACKED_EXPERTS = None
#: the format's knobs: block size, scale dtype, storage perturbations
KNOBS = {
    "block_rows": 128,
    "block_cols": 128,
    "block_size_style": "list",
    "scale_dtype": "float32",
    "scale_layout": "normal",
}
LAYOUT = {
    "dtype": "bfloat16",
    "key_prefix": "model.",
    "shards": 1,
    "split_scale": False,
    "activation_amax": 4.0,
    "quantize_lm_head": False,
    "quantize_embeddings": False,
    "kv_scales": "none",
    "config_spelling": "producer",
    "producer_config": "native",
}
PERTURB = {
    "zero_block": False,
    "subnormal_block": False,
    "extreme_amax": "none",
    "nonfinite_scale": "none",
    "disagreement": "none",
}
#: the module whose tensors disagree with the config (PERTURB["disagreement"]) and its main scale, or None
DISAGREEMENT = None
#: what a correct loader does: "exact" (load the weights the format defines), "refuse", "exact-or-refuse"
EXPECTATION = "exact"
EXPECTED = "loads the checkpoint and holds every quantized weight as the format defines it"
#: the error the harness saw (a regex), or None
REPORTED_ERROR = None
#: a weight differs when |held - want| > rel * |want| + abs (want: the definition cast to the model dtype)
WEIGHT_TOLERANCE = {"rel": 0.0078125, "abs": 0.0}
#: the engine's words for "no kernel for this on this machine": exit 2, not a verdict
CANNOT_RUN_HERE = None
#: whether the script also judges what each quantized Linear does to its input (an activations issue)
JUDGE_ACTIVATIONS = False
#: whether the script judges the FP8 KV cache vLLM's CPU attention writes (no model is built)
JUDGE_KV_CACHE = False
#: the second load path held to the first bit for bit (round-trip, dequantize, offload), or vLLM's
#: tensor-parallel shards (tensor-parallel), or None
RELATION = None
#: vLLM's tensor-parallel relation: the sizes (and expert-parallel sizes), and the first decoder
#: layer's parallel Linears as vLLM builds them (prefix, kind, parts [module, shard id, rows], input
#: size, bias, attention [heads, kv heads, head dim], expert), whether its model splits the layer
#: itself (through_model: gpt-oss) and permutes q/k rows first (rotary: Llama-4), or None
TENSOR_PARALLEL = None
