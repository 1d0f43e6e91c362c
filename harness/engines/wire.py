"""How tensors travel between an engine worker and the harness: the dtype a held tensor is sent in
and the names in the files a worker writes. Both sides import it (harness.engines.worker writes,
harness.engines.process reads), so neither imports the other."""

from __future__ import annotations


def sequence_key(index: int) -> str:
    """The tensor name of sequence `index`'s log-probabilities in the file a worker writes."""
    return f"seq{index}"


def on_the_wire(tensor):
    """A held tensor as it travels to the harness: float32 if it is floating point (exact for the
    float8, 16 and 32-bit dtypes engines hold), float64 if it is an integer (exact to 2**53: packed
    int32 words in float32 would lose their low bits, e.g. int4 nibbles)."""
    import torch

    dtype = torch.float32 if tensor.is_floating_point() else torch.float64
    return tensor.detach().to("cpu", dtype, copy=True).contiguous()
