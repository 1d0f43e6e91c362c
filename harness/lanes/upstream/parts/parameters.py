"""The values a reproduce.py is generated with (these are an example: the generator writes each
script's own, from a known issue's reproducer recipe or a report's finding, in their place)."""

ISSUE = "transformers-fp8-block-grid-inferred-from-shape"
ENGINE = "transformers"
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
    "kv_scales": "none",
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
#: the second load path held to the first bit for bit (round-trip, dequantize, offload), or None
RELATION = None
