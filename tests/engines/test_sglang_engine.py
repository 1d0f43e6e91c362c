"""The sglang engine: SGLang's own loader and processing in SGLang's interpreter, judged on its weights.

Without an SGLang environment (CI has none) the engine is unavailable with one line and the
harness's exit status for an engine that cannot run; its layout decoding runs anywhere. With one
($HARNESS_SGLANG_PYTHON, .venv-sglang or `tox -e sglang`; the opt-in lane) a clean checkpoint is
judged clean, its experts' w13 order and a requantized fused Linear included, and a known SGLang
bug is found and attributed to its entry (the entries' own strict reproductions are in
tests/differential/test_known_issues.py).
"""

from __future__ import annotations

import pytest
import torch

from harness.checkpoints.recipe import Recipe
from harness.checkpoints.writer import generate
from harness.engines import ENGINE_NAMES, ENGINES
from harness.engines.sglang.applied import TILE_COLUMNS, TILE_ROWS, held_as_placed, unswizzled
from harness.engines.sglang.environment import find_sglang_python, sglang_unavailable_reason
from tests.cli import run_cli as cli

SGLANG_PYTHON = find_sglang_python()
needs_sglang = pytest.mark.skipif(
    SGLANG_PYTHON is None,
    reason="no SGLang interpreter: set HARNESS_SGLANG_PYTHON, or build .venv-sglang or `tox -e sglang`",
)
without_sglang = pytest.mark.skipif(SGLANG_PYTHON is not None, reason="SGLang is installed here")
#: fused parts of whole 128-row blocks (SGLang refuses others for block FP8: a known issue of its own)
ALIGNED = {"hidden_size": 256, "head_dim": 64, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_sglang_is_registered_but_not_in_a_full_run():
    """Named when wanted (`--engines reference,sglang`): a full run's engines stay the four that run
    a forward somewhere CI runs."""
    assert ENGINES["sglang"].package == "sglang" and "sglang" not in ENGINE_NAMES


@without_sglang
def test_without_sglang_compare_stops_with_one_line_exit_2(tmp_path):
    """Like any engine that cannot run: one line naming the variable and the places looked in, exit
    2; named in --optional-engines, compare goes on and says it was unavailable."""
    reason = sglang_unavailable_reason()
    assert reason is not None and "\n" not in reason and "HARNESS_SGLANG_PYTHON" in reason
    directory = tmp_path / "ckpt"
    generate(Recipe(format="ct-fp8-tensor", arch="llama", seed=0, config={"num_hidden_layers": 1}), directory)
    result = cli("compare", directory, "--engines", "reference,sglang")
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "engine sglang cannot run" in lines[0] and reason in lines[0], result.stderr
    optional = cli("compare", directory, "--engines", "reference,sglang", "--optional-engines", "sglang")
    assert optional.returncode == 0 and "unavailable" in optional.stdout, optional.stdout + optional.stderr


def swizzle_blockscale(scale: torch.Tensor) -> torch.Tensor:
    """SGLang's swizzle_blockscale (sglang/srt/layers/quantization/utils.py, 0.5.23), as it defines it:
    pad to 128 rows x 4 columns, view as tiles, swap two of their axes."""
    rows, columns = scale.shape
    padded = torch.zeros(-(-rows // 128) * 128, -(-columns // 4) * 4, dtype=scale.dtype)
    padded[:rows, :columns] = scale
    tiles = padded.reshape(1, padded.shape[0] // 128, 4, 32, padded.shape[1] // 4, 4)
    return tiles.permute(0, 1, 4, 3, 2, 5).contiguous().reshape(padded.shape)


@pytest.mark.parametrize("shape", [(128, 8), (160, 12), (32, 3)])
def test_swizzled_group_scales_are_read_back(shape):
    """NVFP4 group scales SGLang swizzled are read in the layout they were placed in, whatever their
    padding; a transposed FP8 weight is turned back, an untouched one read as held."""
    rows, columns = shape
    placed = (torch.arange(rows * columns, dtype=torch.float32).reshape(rows, columns) % 448).to(torch.float8_e4m3fn)
    swizzled = swizzle_blockscale(placed)
    assert swizzled.shape == (-(-rows // TILE_ROWS) * TILE_ROWS, -(-columns // TILE_COLUMNS) * TILE_COLUMNS)
    assert torch.equal(unswizzled(swizzled, rows, columns).view(torch.uint8), placed.view(torch.uint8))
    weight = torch.randn(rows, 2 * columns).to(torch.float8_e4m3fn)
    held = held_as_placed({"weight_scale": swizzled, "weight": weight}, {"weight_scale": placed, "weight": weight})
    assert torch.equal(held["weight_scale"].view(torch.uint8), placed.view(torch.uint8))
    assert torch.equal(held["weight"].view(torch.uint8), weight.view(torch.uint8))
    for square in (weight, weight[:columns, :columns].contiguous()):  # `Parameter(weight.t())`, square or not
        back = held_as_placed({"weight": square.t()}, {"weight": square})["weight"]
        assert torch.equal(back.view(torch.uint8), square.view(torch.uint8))


@pytest.fixture(scope="module")
def sglang_session(tmp_path_factory):
    from harness.differential.session import EngineSession

    session = EngineSession(["reference", "sglang"], tmp_path_factory.mktemp("sglang-engines"))
    yield session
    session.close()


def judged(session, recipe: Recipe, directory):
    from harness.differential.known_issues import KnownIssues
    from harness.differential.runner import evaluate

    generate(recipe, directory)
    return evaluate(directory, session, KnownIssues.load())


CLEAN = {
    "ct-fp8-channel qwen3_moe (FusedMoE w13 is [gate; up])": Recipe(
        format="ct-fp8-channel", arch="qwen3_moe", seed=0, config={"num_hidden_layers": 1}
    ),
    "fp8-block mixtral (block-scaled experts)": Recipe(
        format="fp8-block", arch="mixtral", seed=0, config={**ALIGNED, "intermediate_size": 256, "num_hidden_layers": 1}
    ),
    "ct-fp8-tensor llama (q/k/v requantized under the max scale)": Recipe(
        format="ct-fp8-tensor", arch="llama", seed=0, config={"num_hidden_layers": 1}
    ),
    "ct-nvfp4 llama, fused global scales": Recipe(
        format="ct-nvfp4", arch="llama", seed=0, config={"num_hidden_layers": 1}, layout={"fused_scales": "shared"}
    ),
}


@needs_sglang
@pytest.mark.parametrize("case", CLEAN, ids=list(CLEAN))
def test_a_clean_checkpoint_is_judged_clean(case, sglang_session, tmp_path):
    """Every weight SGLang placed (and, where its processing changes what a Linear applies, every
    weight it then applies) equals the reference's; the forward is unsupported in SGLang's words."""
    result = judged(sglang_session, CLEAN[case], tmp_path / "ckpt")
    outcome = result.outcomes["sglang"]
    assert outcome.status == "loaded", (outcome.status, outcome.detail)
    assert "partly unsupported" in outcome.detail and "SGLang" in outcome.detail
    assert [f for f in result.findings if f.engine == "sglang"] == []


@needs_sglang
def test_a_quantized_head_is_found_loaded_as_its_codes(sglang_session, tmp_path):
    """SGLang's ParallelLMHead holds the E4M3 codes cast to bfloat16 and drops the head's scale: the
    harness finds it, and attributes every finding to that known issue (no other)."""
    recipe = Recipe(
        format="ct-fp8-tensor", arch="llama", seed=0, config={"num_hidden_layers": 1}, layout={"quantize_lm_head": True}
    )
    result = judged(sglang_session, recipe, tmp_path / "ckpt")
    found = [f for f in result.findings if f.engine == "sglang"]
    assert {f.kind for f in found} == {"weight-mismatch", "dropped-scale"}, [f.message for f in found]
    assert all(f.known_issue == "sglang-quantized-lm-head-loaded-as-codes" for f in found)
    mismatch = next(f for f in found if f.kind == "weight-mismatch")
    assert mismatch.module == "lm_head.weight" and "max |err| 448" in mismatch.message


@needs_sglang
def test_an_nvfp4_head_is_found_never_written(sglang_session, tmp_path):
    """NVFP4's quantized head has no `lm_head.weight` for SGLang's bfloat16 parameter: loaded into
    NaN-filled parameters (the sentinel relation) it stays NaN, and the relation finding is the
    known issue's."""
    from harness.differential.known_issues import KnownIssues
    from harness.differential.runner import evaluate

    recipe = Recipe(
        format="ct-nvfp4",
        arch="llama",
        seed=0,
        config={"num_hidden_layers": 1},
        layout={"fused_scales": "shared", "quantize_lm_head": True},
    )
    generate(recipe, tmp_path / "ckpt")
    result = evaluate(tmp_path / "ckpt", sglang_session, KnownIssues.load(), relations=("sentinel",))
    assert result.outcomes["sglang"].relations["sentinel"] == "does not hold"
    relation = [f for f in result.findings if f.engine == "sglang" and f.kind == "relation"]
    assert len(relation) == 1 and "lm_head.weight left unwritten" in relation[0].message
    assert all(
        f.known_issue == "sglang-quantized-lm-head-loaded-as-codes" for f in result.findings if f.engine == "sglang"
    )
