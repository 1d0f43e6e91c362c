"""Exit codes, the engine's log records, the weight comparison."""

from __future__ import annotations

import logging
import traceback

import torch

from harness.lanes.upstream.parts.parameters import ENGINE_OPTIONS, LAYOUT, WEIGHT_TOLERANCE

# ---- reproduce.py ----

EXIT_FIXED, EXIT_BUG, EXIT_CANNOT_RUN = 0, 1, 2
MODEL_DTYPE = getattr(torch, LAYOUT["dtype"])  # the checkpoint's
#: the dtype the engine computes in and is judged in: the checkpoint's, or the one its options name
ENGINE_DTYPE = getattr(torch, ENGINE_OPTIONS.get("dtype", LAYOUT["dtype"]))
PROMPT = [1, 3, 4, 5]
#: the Linears whose weight was read through their kernel on basis inputs (modules.applied_weight),
#: with the bias its outputs carried (or None): module -> bias
PROBED: dict = {}


def describe_error(error: BaseException, limit: int = 500) -> str:
    """`Type: message`; for an error raised without a message (a bare `assert`), the function and
    source line that raised it (as the harness's worker says it: harness/engines/worker.py)."""
    message = str(error)[:limit]
    frames = traceback.extract_tb(error.__traceback__)
    if message.strip() or not frames:
        return f"{type(error).__name__}: {message}"
    last = frames[-1]
    where = f"{last.filename.rpartition('site-packages/')[2]}:{last.lineno}"
    return f"{type(error).__name__}: raised without a message in {last.name} ({where}): {last.line}"


class CapturedLogs(logging.Handler):
    """The WARNING and ERROR records of the engine's loggers: some engines log the cause of a
    load failure and raise a generic error."""

    def __init__(self, names):
        super().__init__(logging.WARNING)
        self.names, self.lines = names, []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        for name in self.names:
            logging.getLogger(name).addHandler(self)
        return self

    def __exit__(self, *exc):
        for name in self.names:
            logging.getLogger(name).removeHandler(self)


def ranges(indices) -> str:
    """[0, 1, 2, 7] -> '0..2, 7'."""
    spans = []
    for index in sorted(indices):
        if spans and index == spans[-1][1] + 1:
            spans[-1][1] = index
        else:
            spans.append([index, index])
    text = ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in spans[:6])
    return text + (f", ... ({len(spans)} spans)" if len(spans) > 6 else "")


def ulp(values: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of |values| in the engine's dtype (float64)."""
    held = values.abs().to(ENGINE_DTYPE)
    return torch.nextafter(held, torch.full_like(held, float("inf"))).to(torch.float64) - held.to(torch.float64)


def kernel_slack(want: torch.Tensor, bias, block) -> torch.Tensor:
    """What a kernel's arithmetic may add to a weight read through it (common.PROBED): its output
    W[:, j] + bias rounded to the model dtype, and an integer kernel's zero point folded into a
    float offset, two terms each up to a group's range (at most twice its largest |W|) rounded to the
    model dtype (CPU int4 kernels compute (q - 8) s + (8 - z) s). A zero point or scale read wrong
    moves a weight by a whole quantization step (a group's range / (2**bits - 1)), far beyond."""
    rows, cols = want.shape
    width = min(block[1], cols)
    groups = -(-cols // width)
    padded = torch.zeros(rows, groups * width, dtype=torch.float64)
    padded[:, :cols] = want.abs()
    span = 2 * padded.reshape(rows, groups, width).amax(dim=-1).repeat_interleave(width, dim=1)[:, :cols]
    output = want.abs() + (0 if bias is None else bias.abs().unsqueeze(1))
    return ulp(output) + 2 * ulp(span) + 2.0**-125


def weight_problems(held, expected, scale_block) -> list[str]:
    """One line per module whose held weight is not the definition's value, rounded once to the
    model dtype, within WEIGHT_TOLERANCE (and, for a weight read through its kernel, the kernel's
    arithmetic: kernel_slack). A held value that is a string says why the engine holds none."""
    problems = []
    for module, definition in expected.items():
        got = held.get(module)
        if got is None or isinstance(got, str):
            problems.append(f"{module}: {got or 'the engine holds no weight for it'}")
            continue
        if tuple(got.shape) != tuple(definition.shape):
            problems.append(
                f"{module}: held with shape {list(got.shape)}, the checkpoint's is {list(definition.shape)}"
            )
            continue
        want = definition.to(ENGINE_DTYPE).to(torch.float64)
        value = got.detach().to("cpu").to(torch.float64)
        error = (value - want).abs()
        bound = WEIGHT_TOLERANCE["rel"] * want.abs() + WEIGHT_TOLERANCE["abs"]
        if module in PROBED:
            bound = bound + kernel_slack(want, PROBED[module], scale_block(tuple(want.shape)))
        bad = ~(error <= bound)
        if bad.any():
            how = "applied by its kernel (basis inputs)" if module in PROBED else f"held as {str(got.dtype)[6:]}"
            problems.append(describe_mismatch(module, how, value, want, error, bad, scale_block(tuple(want.shape))))
    return problems


def describe_mismatch(module, how, value, want, error, bad, block) -> str:
    """Where a held weight differs: how many elements, which rows, columns and scale blocks, the
    largest error and one example."""
    rows, cols = bad.any(dim=1).nonzero().flatten().tolist(), bad.any(dim=0).nonzero().flatten().tolist()
    positions = bad.nonzero().tolist()
    blocks = sorted({(r // block[0], c // block[1]) for r, c in positions})
    finite = torch.where(bad & torch.isfinite(error), error, torch.zeros_like(error))
    r, c = divmod(int(finite.flatten().argmax()), want.shape[1]) if finite.any() else positions[0]
    relative = float(error[r, c] / want[r, c].abs()) if want[r, c] != 0 else float("inf")
    shown = ", ".join(f"({a}, {b})" for a, b in blocks[:8]) + (
        f", ... ({len(blocks)} blocks)" if len(blocks) > 8 else ""
    )
    return (
        f"{module} {list(want.shape)}, {how}: {len(positions)} of "
        f"{want.numel()} elements differ; rows {ranges(rows)}; columns {ranges(cols)}; scale blocks "
        f"[{block[0]} x {block[1]}] (row, col): {shown}; largest at [{r}, {c}]: expected "
        f"{float(want[r, c]):.6g}, held {float(value[r, c]):.6g} (relative error {relative:.3g})"
    )
