"""``benchmarks.step_budget``: each budget runs the whole closed loop in turn with the engine built for it."""

import json

import pytest

from benchmarks.config import BenchConfig
from benchmarks.engine_system import engine_config


def test_the_benchmark_config_carries_the_step_budget_to_the_engine():
    assert engine_config(BenchConfig(max_step_ms=50)).max_step_ms == 50
    assert engine_config(BenchConfig()).max_step_ms == 0  # the library default, as the matrix measures
    with pytest.raises(ValueError, match="max_step_ms"):
        BenchConfig(max_step_ms=-1)


@pytest.mark.parametrize("budgets", ["50,50", "-5", "fast", ""])
def test_budgets_that_cannot_be_run_are_refused_before_anything_loads(budgets, capsys):
    from benchmarks.step_budget import main

    with pytest.raises(SystemExit):
        main(["--budgets", budgets])
    assert "--budgets" in capsys.readouterr().err or budgets == ""


@pytest.mark.slow  # four engine builds and closed loops: the fast suite keeps its minutes for the engine itself
def test_budgets_take_turns_and_each_row_is_the_median_of_its_rounds(tiny_model_dir, tmp_path, capsys):
    from benchmarks.step_budget import FIGURES, main

    assert main(["--model", str(tiny_model_dir), "--budgets", "0,5", "--concurrency", "3", "--num-requests", "5",
                 "--rounds", "2", "--threads", "1", "--output-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert [(r["round"], r["max_step_ms"]) for r in report["runs"]] == [(0, 0.0), (0, 5.0), (1, 0.0), (1, 5.0)]
    assert [row["max_step_ms"] for row in report["budgets"]] == [0.0, 5.0]
    for row in report["budgets"]:
        mine = [r for r in report["runs"] if r["max_step_ms"] == row["max_step_ms"]]
        for name in FIGURES:
            values = sorted(r[name] for r in mine)
            assert row[name] == pytest.approx((values[0] + values[1]) / 2)
            assert row[f"{name}_range"] == values
    for run in report["runs"]:
        assert run["output_tokens_per_s"] > 0 and run["steps"] > 0
        # every request's first token comes after its arrival, the burst's among them
        assert 0 < run["ttft_mean_s"] <= run["ttft_p99_s"] * 1.0001 and run["burst_ttft_mean_s"] > 0
    assert report["workload"]["num_requests"] == 5 and "requests" not in report["workload"]
    assert "| 5 |" in capsys.readouterr().out
    assert report["config"]["model"] == str(tiny_model_dir) and report["config"]["shape"] is None
