"""The failure matrix of issue 3 on 2 gloo ranks (one torchrun launch for every case): plain torch
DDP fails with each case's settings, and the framework trains the same model correctly."""

import pytest

from tests.workers.failure_matrix import CASES, CORRECT, ITERATIONS, SILENT

pytestmark = pytest.mark.dist

WORKER = "tests/workers/failure_matrix.py"
WORKER_TIMEOUT = 150  # seconds, for the conftest two_ranks fixture
TOL = 1e-5  # framework gradients against the single-process reference (fp32)
OFF = 1e-3  # a silent failure: gradients at least this far off the reference or across ranks
FRAMEWORK_CASES = sorted(name for name, case in CASES.items() if case.framework is not None)


def part(results, name, which):
    """Rank 0's result; every rank computed the same cross-rank comparison, so they must agree."""
    outs = [results[rank]["cases"][name][which] for rank in (0, 1)]
    for out in outs:
        assert "harness_error" not in out, out.get("traceback")
    strip = lambda out: {k: v for k, v in out.items() if k != "seconds"}  # noqa: E731
    assert strip(outs[0]) == strip(outs[1])
    return outs[0]


def outcome(out) -> str:
    """The error message if any rank raised, else SILENT (gradients off) or CORRECT."""
    errors = [e for e in out["errors"] if e is not None]
    if errors:
        return errors[0]["full"]
    if out["max_ref_diff"] > OFF or out["max_rank_diff"] > OFF:
        return SILENT
    if out["iterations_done"] == ITERATIONS and out["max_ref_diff"] <= TOL and out["max_rank_diff"] <= TOL:
        return CORRECT
    return f"inconclusive: {out}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_plain_torch_reproduces_the_failure(two_ranks, name):
    case, out = CASES[name], part(two_ranks, name, "plain")
    got = outcome(out)
    assert any(got == expected if expected in (SILENT, CORRECT) else expected in got
               for expected in case.expect), (got, out)
    if any(e is not None for e in out["errors"]):
        # Symmetric failure: every rank raised, in the same iteration.
        assert all(e is not None for e in out["errors"]), out["errors"]
        assert len({e["iteration"] for e in out["errors"]}) == 1, out["errors"]
        if case.error_iteration is not None:
            assert out["errors"][0]["iteration"] == case.error_iteration, out["errors"]
        # Iterations before the error, if any, were complete.
        assert out["iterations_done"] == out["errors"][0]["iteration"]


@pytest.mark.parametrize("name", FRAMEWORK_CASES)
def test_framework_gradients_match_single_process(two_ranks, name):
    out = part(two_ranks, name, "framework")
    assert out["errors"] == [None, None], out["errors"]
    assert out["iterations_done"] == ITERATIONS
    assert out["max_ref_diff"] <= TOL, out["iterations"]
    assert out["max_rank_diff"] == 0.0, out["iterations"]  # all-reduced: identical on both ranks


@pytest.mark.parametrize("name", FRAMEWORK_CASES)
def test_framework_decision(two_ranks, name):
    decision = part(two_ranks, name, "framework")["decision"]
    assert (decision["static_graph"], decision["find_unused_parameters"]) == CASES[name].decision, decision
    assert decision["safe"], decision
    assert decision["reasons"], decision


def test_static_graph_hides_the_naive_tiled_mlp_while_the_chunk_count_is_fixed(two_ranks):
    out = part(two_ranks, "8_naive_tiled_static_chunks_change", "plain")
    assert out["iterations_done"] == 2  # chunk counts 2, 2: correct; then 4: "graph has changed"
    assert out["max_ref_diff"] <= TOL and out["max_rank_diff"] <= TOL, out["iterations"]
