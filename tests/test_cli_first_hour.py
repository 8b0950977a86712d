"""The command line as a new user meets it: every subcommand's help is plain text with help on every flag, one
flag vocabulary (old spellings still accepted, hidden), ``sim`` writes only where asked and a run's folder holds
that run only, and bad input (an unreachable server, a broken profile, zero requests, a binary trace, an
unbounded plan) gets an error naming it instead of a traceback."""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from sarathi_lite.cli import build_parser, main
from sarathi_lite.costs.profiled import ProfiledCostModel, batch_terms
from sarathi_lite.sim.profiler import measured_range, profile_grid, warn_degenerate

PROFILE = Path(__file__).parents[1] / "benchmarks" / "results" / "sim_profile_smollm2_2026-12-06.json"
TINY_SIM = ["--lengths", "uniform:8-60:2-12", "--num-requests", "6", "--qps", "20"]


def _commands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_subcommand_help_is_plain_text_with_help_on_every_flag():
    parsers = {"sarathi-lite": build_parser(), **_commands()}
    for name, parser in parsers.items():
        text = parser.format_help()
        assert "``" not in text and "`" not in text, (name, text[text.find("`") - 80:text.find("`") + 80])
        no_help = [a.option_strings or a.dest for a in parser._actions
                   if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help]
        assert not no_help, (name, no_help)


def test_the_top_description_lists_every_subcommand_and_each_describes_only_itself():
    top = build_parser().description
    assert all(f"\n  {name} " in top for name in _commands()), top
    sim = _commands()["sim"].format_help()
    assert "profile: time" not in sim and "sweep: every" not in sim and "Simulate a workload" in sim
    plan = _commands()["plan"].format_help()
    assert "--profile benchmarks/results/sim_profile_smollm2.json \\\n" in plan  # the example's continuations


def test_one_flag_vocabulary_with_the_old_spellings_hidden_but_accepted(capsys):
    plan = _commands()["plan"]
    new = plan.parse_args(["--model", "m", "--gpu", "h100", "--gpus", "2", "--ttft-slo", "1", "--tbt-slo", "0.05",
                           "--prefill-chunk-size", "1024", "--decode-chunk-size", "256", "--conditional-threshold",
                           "64", "--num-requests", "20", "--prompt-scale", "0.5", "--output-scale", "0.25"])
    old = plan.parse_args(["--model", "m", "--gpu", "h100", "--gpus", "2", "--ttft", "1", "--tbt", "0.05",
                           "--prefill-chunk", "1024", "--decode-chunk", "256", "--threshold", "64", "--requests", "20",
                           "--length-scale", "0.5", "--output-scale", "0.25"])
    assert vars(new) == vars(old)
    assert "--length-scale is now --prompt-scale and --output-scale" in capsys.readouterr().err
    for name, flag in (("plan", "--tbt "), ("plan", "--threshold"), ("plan", "--length-scale"),
                       ("bench", "--served-model ")):
        assert flag not in _commands()[name].format_help(), (name, flag)
    # the same option has the same name in every command that has it
    for flag in ("--tbt-slo", "--num-requests", "--prompt-scale", "--output-scale"):
        assert all(flag in _commands()[c].format_help() for c in ("sim", "capacity", "plan")), flag
    assert "--conditional-threshold" in _commands()["serve"].format_help()
    assert "--served-model-name" in _commands()["bench"].format_help()


def test_sim_writes_nothing_unless_asked_and_a_run_folder_holds_that_run_only(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    roofline = ["sim", "--cost-model", "roofline:h100:llama3-8b", *TINY_SIM]
    assert main([*roofline, "--chunk-sizes", "64,128"]) == 0
    assert "sarathi/64" in capsys.readouterr().out and list(tmp_path.iterdir()) == []
    out = tmp_path / "run"
    assert main([*roofline, "--chunk-sizes", "64,128", "--policies", "sarathi", "--out", str(out)]) == 0
    first = {p.name for p in out.iterdir()}
    assert "sarathi_64.json" in first and "summary.csv" in first
    assert main([*roofline, "--chunk-sizes", "256", "--policies", "sarathi", "--out", str(out)]) == 0
    second = {p.name for p in out.iterdir()}
    assert "sarathi_256.json" in second and not {n for n in second if "_64" in n or "_128" in n}, second
    with open(out / "summary.csv") as f:
        assert len(f.read().strip().splitlines()) == 2  # the header and this run's one configuration
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    assert main([*roofline, "--out", str(mine)]) == 2
    assert "notes.txt" in capsys.readouterr().err and (mine / "notes.txt").read_text() == "keep"


def test_bench_against_an_unreachable_server_says_so(capsys):
    assert main(["bench", "--backend", "openai", "--base-url", "http://127.0.0.1:1", "--lengths", "fixed:8:2",
                 "--num-requests", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cannot reach the server at http://127.0.0.1:1" in err and "Traceback" not in err


def test_sim_cost_model_errors_name_the_file_and_what_is_wrong(tmp_path, capsys):
    sim = ["sim", *TINY_SIM, "--cost-model"]
    assert main([*sim, str(tmp_path / "profile.json")]) == 2
    assert f"cost model file '{tmp_path / 'profile.json'}' not found" in capsys.readouterr().err
    broken = json.loads(PROFILE.read_text())
    del broken["token_knots"]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    assert main([*sim, str(tmp_path / "broken.json")]) == 2
    err = capsys.readouterr().err
    assert "broken.json" in err and "'token_knots'" in err
    (tmp_path / "binary.json").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
    assert main([*sim, str(tmp_path / "binary.json")]) == 2
    assert "binary.json' is not JSON" in capsys.readouterr().err


def test_zero_requests_names_the_flag(capsys):
    assert main(["sim", "--cost-model", "roofline:h100", "--num-requests", "0"]) == 2
    assert "--num-requests 0" in capsys.readouterr().err


def test_plan_is_bounded_and_names_a_binary_trace(tmp_path, capsys):
    slo = ["--ttft-slo", "1", "--tbt-slo", "0.05", "--no-progress"]
    assert main(["plan", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "100000", *slo]) == 2
    assert "more than 1000 candidate deployments" in capsys.readouterr().err
    trace = tmp_path / "trace.csv"
    trace.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe")
    assert main(["plan", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "2", "--trace", str(trace), *slo]) == 2
    assert f"{trace}: not a trace CSV" in capsys.readouterr().err


def test_the_default_profile_measures_what_the_default_sim_asks(tmp_path, capsys):
    rng = np.random.default_rng(0)
    grid = measured_range([batch_terms(s.output(16, 8192, 1000, rng)) for s in profile_grid()])
    # a machine 4x slower than the one this profile was measured on (a busy one): steps take longer, more
    # prompts queue meanwhile, and the default workload's vllm steps reach about 2,900 tokens
    measured = ProfiledCostModel.load(PROFILE)
    profile = dataclasses.replace(measured, token_times=[4 * t for t in measured.token_times],
                                  coefficients={k: 4 * v for k, v in measured.coefficients.items()})
    profile.measured = grid  # what a profile made with the defaults measures
    path = tmp_path / "profile.json"
    profile.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["sim", "--cost-model", str(path)]) == 0  # sarathi and vllm on the default workload
    assert "vllm" in capsys.readouterr().out


def test_a_fit_that_prices_a_term_at_nothing_warns():
    with pytest.warns(UserWarning, match="gave prefill_chunks no cost"):
        assert warn_degenerate({"decode_tokens": 1e-5, "prefill_chunks": 0.0, "sampled": 1e-4,
                                "prefill_attention": 1e-7, "decode_attention": 1e-6}) == ["prefill_chunks"]


def test_the_capacity_table_explains_its_probe_column(capsys):
    assert main(["sim", "--cost-model", "roofline:h100:llama3-8b", *TINY_SIM, "--capacity", "--tbt-slo", "0.05",
                 "--qps-low", "1", "--qps-high", "100", "--probes", "3", "--policies", "sarathi"]) == 0
    out = capsys.readouterr().out
    assert "probes: each rate the search tried, in order, + if it met the SLO and x if not" in out
