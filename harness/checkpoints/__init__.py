"""Checkpoints on disk: the reader, the streaming writer, the generator's writer, manifests, recipes, architectures, the tokenizer."""
