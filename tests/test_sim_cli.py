"""``sarathi-lite profile`` and ``sarathi-lite sim`` end to end: profile a tiny model, simulate with the saved
profile (the bench table, JSON/CSV, plot), search capacity, and simulate a GPU with the roofline model.
No timing assertions."""

from __future__ import annotations

import json

import pytest

from sarathi_lite.bench.results import BenchResult
from sarathi_lite.cli import main
from sarathi_lite.costs.profiled import TERMS, ProfiledCostModel

WORKLOAD = ["--lengths", "uniform:8-60:2-12", "--num-requests", "12", "--qps", "20"]


def test_profile_fits_and_saves_a_cost_model_the_simulator_uses(tiny_checkpoints, tmp_path, capsys):
    path = tmp_path / "profile.json"
    assert main(["profile", "--model", str(tiny_checkpoints["llama"]), "--quick", "--repeats", "1",
                 "--max-tokens", "64", "--max-context", "64", "--max-decodes", "8", "--block-size", "4",
                 "--num-kv-blocks", "256", "--device", "cpu", "--no-progress", "--out", str(path)]) == 0
    text = capsys.readouterr().out
    assert "fit on held_out" in text and "decode_attention" in text
    cost = ProfiledCostModel.load(path)
    assert set(cost.coefficients) == set(TERMS) and min(cost.coefficients.values()) >= 0
    # the chunked grid's knots up to --max-tokens, then its steps of whole prompts up to 4x that
    assert cost.token_knots == (1, 2, 3, 4, 6, 8, 16, 24, 32, 48, 64, 128, 256)
    assert cost.measured == {"tokens": 256, "prefill_chunks": 8, "prefill_attention": 128 * 128 * 2}
    assert len(cost.jitter) == 21 and cost.jitter[0] < 1 < cost.jitter[-1]  # the spread of single runs
    assert cost.meta["model"] == "llama" and cost.meta["grid"]["quick"] and cost.meta["fit"]["held_out"]["n"] > 0
    assert cost.kv_cache_memory == 256 * 4 * cost.kv_bytes_per_token and cost.max_position_embeddings == 1024
    samples = cost.meta["samples"]
    assert len(samples) == cost.meta["grid"]["shapes"] and all(len(s["runs"]) == 1 for s in samples)
    # decode-only, chunk-only and hybrid shapes are all in the grid
    kinds = {(s["terms"]["decode_tokens"] > 0, s["terms"]["prefill_chunks"] > 0) for s in samples}
    assert kinds == {(True, False), (False, True), (True, True)}

    out = tmp_path / "sim"
    assert main(["sim", "--cost-model", str(path), *WORKLOAD, "--policies", "sarathi,vllm", "--chunk-sizes",
                 "16,32", "--block-size", "4", "--out", str(out), "--plot"]) == 0
    text = capsys.readouterr().out
    assert all(label in text for label in ("sarathi/16", "sarathi/32", "vllm", "TBT p50 ms", "simulated 3"))
    assert {"sarathi_16.json", "sarathi_32.json", "vllm.json", "summary.csv", "sim.png"} <= {
        p.name for p in out.iterdir()}
    result = BenchResult.from_json(out / "sarathi_16.json")
    assert result.meta["replay"] == "simulated" and result.meta["cost_model"]["file"] == str(path)
    assert result.config["num_kv_blocks"] == 256 and result.config["model"] == "llama"


def test_sim_capacity_search_with_the_roofline_model(tmp_path, capsys):
    assert main(["sim", "--cost-model", "roofline:h100:llama3-8b", *WORKLOAD, "--capacity", "--tbt-slo", "0.05",
                 "--qps-low", "1", "--qps-high", "400", "--probes", "6", "--policies", "sarathi,vllm",
                 "--chunk-size", "256", "--out", str(tmp_path), "--plot"]) == 0
    text = capsys.readouterr().out
    assert "capacity req/s" in text and "sarathi/256" in text
    found = json.loads((tmp_path / "capacity.json").read_text())
    assert [c["label"] for c in found] == ["sarathi/256", "vllm"]
    assert all(len(c["probes"]) <= 6 for c in found) and (tmp_path / "capacity.png").is_file()


def test_sim_auto_chunk_size_sweeps_and_searches_capacity_beside_fixed_ones(tmp_path, capsys):
    roofline = ["sim", "--cost-model", "roofline:h100:llama3-8b", *WORKLOAD, "--policies", "sarathi"]
    assert main([*roofline, "--chunk-sizes", "64,auto", "--tbt-slo", "0.02", "--out", str(tmp_path / "sweep")]) == 0
    assert "sarathi/64" in capsys.readouterr().out
    result = BenchResult.from_json(tmp_path / "sweep" / "sarathi_auto.json")
    assert result.config["chunk_size"] == "auto" and result.config["tbt_slo"] == 0.02
    assert max(it.step_time for it in result.stats.iterations) <= 0.02 * 0.9  # the roofline predicts exactly
    assert main([*roofline, "--capacity", "--chunk-size", "auto", "--tbt-slo", "0.02", "--qps-low", "1",
                 "--qps-high", "400", "--probes", "4", "--out", str(tmp_path / "capacity")]) == 0
    assert "sarathi/auto" in capsys.readouterr().out
    assert main([*roofline, "--chunk-size", "auto", "--out", str(tmp_path)]) == 2
    assert "tbt_slo=None" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*roofline, "--chunk-size", "big", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "--chunk-size" in err and "'big'" in err


def test_sim_errors_are_reported_not_raised(tmp_path, capsys):
    assert main(["sim", "--cost-model", str(tmp_path / "none.json"), *WORKLOAD, "--out", str(tmp_path)]) == 2
    assert "none.json' not found" in capsys.readouterr().err
    assert main(["sim", "--cost-model", "roofline:h100", *WORKLOAD, "--capacity", "--out", str(tmp_path)]) == 2
    assert "--tbt-slo" in capsys.readouterr().err


def test_sim_protects_short_requests_on_long_context_traffic_by_default(tmp_path, capsys):
    """Two 30k-token prompts among short ones on a simulated H100: the default run (protection on) starts the
    short requests sooner than --no-hol-protection (the paper's FCFS), and each result records which it ran."""
    workload = ["--lengths", "uniform:100-600:20-60", "--num-requests", "80", "--qps", "10", "--long-prompts",
                "2:30000", "--max-prompt", "30000"]
    ttft = {}
    for flag in ([], ["--no-hol-protection"]):
        out = tmp_path / ("paper" if flag else "protected")
        assert main(["sim", "--cost-model", "roofline:h100:llama3.1-8b", *workload, "--chunk-size", "2048",
                     "--policies", "sarathi", *flag, "--out", str(out)]) == 0
        result = BenchResult.from_json(out / "sarathi_2048.json")
        assert result.config["hol_protection"] is not bool(flag)
        assert result.config["max_model_len"] == 131072
        short = sorted(r.ttft for r in result.stats.requests if r.num_prompt_tokens <= 600)
        assert len(short) == 78
        ttft[bool(flag)] = short[int(0.9 * len(short))]
    capsys.readouterr()
    assert ttft[False] < ttft[True] / 2, ttft


def test_quick_profile_grid_covers_long_context_chunks_and_many_decode_hybrids():
    from sarathi_lite.sim.profiler import profile_grid

    grid = profile_grid(quick=True, max_tokens=256, max_context=512, max_decodes=32)
    assert len(grid) < len(profile_grid(max_tokens=256, max_context=512, max_decodes=32))
    long_chunks = {s.chunks[0][1] for s in grid if not s.decode_contexts and s.chunks[0][0] == 512}
    assert long_chunks == {16, 32, 64, 128, 256}  # every power of two, after max_context cached tokens
    hybrids = [s for s in grid if s.decode_contexts and s.chunks]
    assert hybrids and all(len(s.decode_contexts) == min(32, (len(s.decode_contexts) + s.chunks[0][1]) // 2)
                           for s in hybrids)
    assert max(len(s.decode_contexts) for s in hybrids) == 32 and all(s.chunks[0][0] == 512 for s in hybrids)
    assert max(max(s.decode_contexts) for s in grid if s.decode_contexts) > 256  # long decode contexts too


@pytest.mark.parametrize("quick", [True, False])
def test_profile_grid_pins_every_cost_term(quick):
    """The fit's design matrix over the grid (the token curve at its knots plus every term) has full column
    rank: no term can trade exactly against another."""
    import numpy as np

    from sarathi_lite.costs.profiled import batch_terms
    from sarathi_lite.sim.cost_model import design_matrix
    from sarathi_lite.sim.profiler import grid_knots, profile_grid

    rng = np.random.default_rng(0)
    rows = [batch_terms(s.output(16, 4096, 1000, rng)) for s in profile_grid(quick=quick)]
    a = design_matrix(rows, grid_knots(rows, max(r[0] for r in rows)))
    a /= np.linalg.norm(a, axis=0)
    assert np.linalg.matrix_rank(a) == a.shape[1]

