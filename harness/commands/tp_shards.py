"""`tp-shards DIR --tp-sizes 2,4 [--ep-sizes 2,4] [--ep-placement round_robin] [--report OUT]`: shard one decoder layer in vLLM
as if tensor parallel size were each size, for every rank, and judge each rank's weights and scales
against the reference's slice; a layer's routed experts are also placed at each expert-parallel
size (docs/tensor-parallel.md).

Exit 0: every rank of every size exact or refused by vLLM with a reason; 1: some rank holds
other values than its slice; 2: unusable input, or no vLLM to run (one line)."""

from __future__ import annotations

import json
from pathlib import Path

from harness.commands.common import EXIT_FINDING, EXIT_OK
from harness.core.errors import HarnessError


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "tp-shards",
        help="judge vLLM's tensor-parallel shards of a checkpoint's weights and scales, rank by rank, on one CPU",
        description="Build one decoder layer's parallel Linears in vLLM under a mocked tensor-parallel rank, "
        "load the checkpoint through their own weight_loaders, and compare what each rank holds and computes "
        "with the reference's slice (docs/tensor-parallel.md). Exit 0 exact (or refused by vLLM), "
        "1 a rank holds wrong values, 2 unusable input or no vLLM.",
    )
    parser.add_argument(
        "directory",
        help="checkpoint directory (llama, qwen2, mixtral, qwen2_moe, qwen3_moe, llama4, deepseek_v3 or gpt_oss)",
    )
    parser.add_argument("--tp-sizes", default="2,4", help="comma-separated tensor-parallel sizes (default 2,4)")
    parser.add_argument(
        "--ep-sizes",
        default="2,4",
        help="comma-separated expert-parallel sizes a layer with routed experts is also placed at "
        "(vLLM's enable_expert_parallel; default 2,4; 'none' for none)",
    )
    parser.add_argument(
        "--ep-placement",
        choices=("linear", "round_robin"),
        default="linear",
        help="vLLM's expert_placement_strategy at the expert-parallel sizes (default linear; round_robin "
        "applies where the model routes by expert groups, n_group > 1, and vLLM falls back to linear elsewhere)",
    )
    parser.add_argument("--layer", type=int, default=0, help="decoder layer to shard (default 0)")
    parser.add_argument("--report", metavar="OUT", help="write OUT/tp-shards.json and OUT/tp-shards.md here")
    parser.set_defaults(run=command_tp_shards)


def command_tp_shards(args) -> int:
    from harness.engines.vllm.tensor_parallel import FINDING, check_tensor_parallel, parse_tp_sizes

    sizes = parse_tp_sizes(args.tp_sizes)
    ep_sizes = [] if args.ep_sizes.strip().lower() == "none" else parse_tp_sizes(args.ep_sizes, "--ep-sizes")
    directory = Path(args.directory)
    if not directory.is_dir():
        raise HarnessError(f"{directory}: not a directory")
    report = Path(args.report) if args.report else None
    if report:
        report.mkdir(parents=True, exist_ok=True)
    result = check_tensor_parallel(directory, sizes, args.layer, report, ep_sizes=ep_sizes, placement=args.ep_placement)
    print(f"{directory}: vLLM {result.vllm}, decoder layer {args.layer}")
    for outcome in result.outcomes:
        print(outcome.line())
        for reason in outcome.reasons:
            print(f"  refused: {reason}")
        for finding in outcome.findings:
            print(f"  {finding}")
    if report:
        path = report / "tp-shards.json"
        path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
        path.with_suffix(".md").write_text(markdown(result))
        print(f"report: {path} and {path.with_suffix('.md')}")
    if result.findings:
        wrong = {
            parallel: ",".join(str(o.tp) for o in result.outcomes if o.status == FINDING and o.parallel == parallel)
            for parallel in ("tp", "ep")
        }
        print(
            f"reproduce: python -m harness tp-shards {directory} --tp-sizes {wrong['tp'] or 1} "
            f"--ep-sizes {wrong['ep'] or 'none'} --layer {args.layer}"
            + (f" --ep-placement {args.ep_placement}" if args.ep_placement != "linear" else "")
        )
        return EXIT_FINDING
    return EXIT_OK


def markdown(result) -> str:
    lines = [
        f"# tp-shards: {result.directory}",
        "",
        f"vLLM {result.vllm}.",
        "",
        "| split | rank | Linear | status | details |",
    ]
    lines.append("|---|---|---|---|---|")
    for verdict in result.verdicts:
        details = "; ".join(verdict.details).replace("|", "\\|")
        rank = verdict.rank if verdict.rank >= 0 else "all"
        lines.append(f"| {verdict.parallel} {verdict.tp} | {rank} | {verdict.module} | {verdict.status} | {details} |")
    lines += ["", *[f"- {note}" for note in result.kernel_notes]]
    return "\n".join(lines) + "\n"
