"""Differential correctness harness for loading quantized LLM checkpoints.

Importing this package imports no engine (transformers, vLLM, compressed-tensors):
engines are loaded lazily, by name, when a run asks for them.
"""

__version__ = "0.1.0"
