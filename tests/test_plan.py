"""The deployment planner (``sarathi_lite.plan``, ``sarathi-lite plan``): its ranking is the one direct simulations
of the same deployments give, bad inputs are errors naming the bad value, and the commands it prints run."""

from __future__ import annotations

import json
import shlex

import pytest

from sarathi_lite.bench.workload import Workload
from sarathi_lite.cli import build_parser, main
from sarathi_lite.cli.common import engine_config
from sarathi_lite.engine.config import EngineConfig, parse_chunk_size
from sarathi_lite.engine.llm import replicas_layout
from sarathi_lite.plan import Setup, commands, plan, space, table
from sarathi_lite.plan.report import organization, ties
from sarathi_lite.plan.search import Entry, Plan, Probe
from sarathi_lite.plan.space import Candidate, deployment, hybrid_rule, launch, llm_text, start_rate
from sarathi_lite.scheduler.routing import HybridRule, Layout
from sarathi_lite.sim.disagg import rate_sweep
from sarathi_lite.sim.sweeps import run_tasks

TINY = 40  # requests per probe: every probe replays the same 40 requests, only their rate changes


@pytest.fixture(scope="module")
def tiny():
    setup = Setup("llama3-8b", "h100", 2, ttft=0.25, tbt=0.025, chunk_sizes=(512, 2048), max_degree=1)
    wl = Workload.from_trace("conversation", num_requests=TINY, qps=1.0, max_prompt=2000, max_output=64)
    return setup, wl, plan(setup, wl, min_requests=TINY, max_requests=TINY, fine_probes=2, backend="serial",
                           progress=False)


def test_space_holds_the_studys_organizations_and_the_degrees_that_fit():
    labels = [c.label for c in space(Setup("llama3-8b", "h100", 4, 1.0, 0.05)).candidates]
    for label in ("4C@256", "4C@1024", "4C@auto", "1P3D", "2P2D", "2P2D/cond512", "3P1D", "2C@512 tp2",
                  "1P1D tp2", "1C@512 tp4", "1C@512 pp4", "1C@512 tp2 pp2"):
        assert label in labels
    assert "3P1D/cond512" not in labels  # conditional only where prefill instances are not the majority
    assert not any("auto" in x and "pp" in x for x in labels)
    assert len(labels) == len(set(labels))
    big = space(Setup("llama3-70b", "h100", 8, 1.0, 0.05))
    assert all(c.tp * c.pp >= 2 for c in big.candidates)  # 70B in bf16 fills one H100 with no room for KV
    assert any(shape == "tp1 pp1" for shape, _ in big.skipped)


def test_ranking_is_that_of_direct_simulations_of_the_same_deployments(tiny):
    setup, wl, result = tiny
    assert {e.label for e in result.entries} == {"2C@512", "2C@2048", "1P1D", "1P1D/cond512",
                                                 "1PH1DH/short=512,ttft=5120,tbt=512"}
    direct = {}
    for e in result.entries:
        assert e.error is None and e.probes
        sweep = rate_sweep(deployment(setup, e.candidate), wl, [p.rate for p in e.probes])
        direct[e.label] = sweep.goodput(setup.ttft, setup.tbt, setup.attainment)
        assert e.goodput == pytest.approx(direct[e.label], rel=1e-12)
        assert [p.attainment for p in e.probes] == pytest.approx(sweep.attainment(setup.ttft, setup.tbt))
    assert [e.label for e in result.entries] == sorted(direct, key=lambda k: (-direct[k], k))
    best = result.best
    held, failing = best.bracket()
    assert held is not None and failing is not None and held < failing
    assert held / 2 <= best.goodput < failing / 2  # per GPU, inside the bracket
    assert best.refined and best.limiting in ("TTFT", "TBT", "both")


def test_the_coarse_grid_is_the_studys_for_its_setup():
    """The study (benchmarks/colocate_vs_disaggregate.py) sweeps Llama-3-8B from 2 requests/s per GPU by sqrt 2."""
    wl = Workload.from_trace("conversation", num_requests=1500, qps=1.0, max_prompt=7000, max_output=1000)
    assert start_rate(Setup("llama3-8b", "h100", 4, 1.0, 0.05), wl) == pytest.approx(2.0)


def test_entries_that_cannot_reach_the_best_are_not_refined(tiny):
    _, _, result = tiny
    floor = max((e.bracket()[0] or 0) / e.num_gpus for e in result.entries)
    for e in result.entries:
        failing = e.bracket()[1]
        if failing is not None and failing / e.num_gpus <= floor:
            assert not e.refined
    assert any(e.refined for e in result.entries)


@pytest.mark.parametrize("kwargs, named", [
    ({"model": "llama9"}, "llama9"),
    ({"gpu": "h900"}, "h900"),
    ({"ttft": 0.0}, "ttft=0.0"),
    ({"tbt": -0.05}, "tbt=-0.05"),
    ({"gpus": 0}, "gpus=0"),
    ({"attainment": 1.5}, "attainment=1.5"),
    ({"chunk_sizes": (512, 0)}, "0"),
    ({"link": "carrier-pigeon"}, "carrier-pigeon"),
])
def test_bad_inputs_are_errors_naming_the_value(kwargs, named):
    args = {"model": "llama3-8b", "gpu": "h100", "gpus": 2, "ttft": 1.0, "tbt": 0.05, **kwargs}
    with pytest.raises(ValueError, match=named):
        Setup(**args)


def test_gpus_that_fit_nothing_are_an_error_naming_model_and_gpus():
    with pytest.raises(ValueError, match=r"model='llama3-70b' fits no deployment on gpus=1 x gpu='h100'"):
        space(Setup("llama3-70b", "h100", 1, 1.0, 0.05))


def test_cli_errors_name_the_bad_value(capsys):
    base = ["plan", "--gpu", "h100", "--gpus", "2", "--ttft-slo", "1", "--tbt-slo", "0.05", "--no-progress"]
    assert main([*base, "--model", "llama9"]) == 2
    assert "llama9" in capsys.readouterr().err
    assert main(["plan", "--model", "llama3-70b", "--gpu", "h100", "--gpus", "1", "--ttft-slo", "1", "--tbt-slo",
                 "0.05", "--no-progress"]) == 2
    assert "gpus=1" in capsys.readouterr().err
    assert main(["plan", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "2", "--ttft-slo", "1", "--tbt-slo", "0",
                 "--no-progress"]) == 2
    assert "tbt=0.0" in capsys.readouterr().err


def _fake_llm(model, disaggregation=None, prefill_options=None, data_parallel_size=None, **options):
    """What ``LLM(...)`` builds from the planner's keywords, short of starting engines."""
    disaggregation = replicas_layout(data_parallel_size, disaggregation)
    config = EngineConfig.from_options(model, **options)
    layout = None if disaggregation is None else (disaggregation if isinstance(disaggregation, Layout)
                                                  else Layout.parse(disaggregation))
    return config, layout, config.replace(**(prefill_options or {}))


def test_printed_commands_parse_into_the_simulated_configuration():
    setup = Setup("llama3-8b", "h100", 4, 1.0, 0.05)
    for cand in space(setup).candidates:
        run = launch(setup, cand)
        args = build_parser().parse_args(run["serve"])
        served = engine_config(args, model=args.model_arg)
        config, layout, prefill = eval(llm_text(run["llm"]), {"LLM": _fake_llm, "Layout": Layout})
        assert served == config, cand.label
        assert served.chunk_size == cand.chunk_size and served.max_num_seqs == 512
        assert served.tensor_parallel_size == cand.tp and served.pipeline_parallel_size == cand.pp
        if cand.chunk_size == "auto":
            assert served.cost_model == f"roofline:{cand.tp}xh100:llama3-8b".replace("1xh100", "h100")
            assert served.tbt_slo == 0.05
        given = args.instances or (str(args.data_parallel_size) if args.data_parallel_size else None)
        if cand.instances == 1:
            assert given is None and layout is None
        else:
            assert Layout.parse(given, args.conditional_threshold) == layout
            assert layout.label == cand.label.split("@")[0].split(" ")[0]
        if not cand.colocated:
            assert prefill.chunk_size == cand.prefill_chunk  # LLM's prefill_options, and serve's own flag:
            assert parse_chunk_size(args.prefill_chunk_size) == cand.prefill_chunk
        assert ("tensor/pipeline degree 1" in run["note"]) == (cand.instances > 1 and cand.tp * cand.pp > 1)


def test_cli_prints_the_ranked_table_and_writes_plot_and_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "1", "--ttft-slo", "1", "--tbt-slo", "0.05",
            "--chunk-sizes", "512,2048", "--num-requests", "20", "--max-requests", "20", "--max-prompt", "2000",
            "--max-output", "32", "--fine-probes", "1", "--backend", "serial", "--no-progress",
            "--json", str(out), "--plot", str(tmp_path / "plan.png")]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "| 1 | 1C@" in text and "| 2 | 1C@" in text and "goodput req/s/GPU" in text
    saved = json.loads(out.read_text())
    assert [e["label"] for e in saved["entries"]][:1] == [text.split("| 1 | ")[1].split(" |")[0].strip()]
    assert (tmp_path / "plan.png").stat().st_size > 0
    serve = text.split("`sarathi-lite ")[1].split("`")[0]
    build_parser().parse_args(shlex.split(serve))  # the table's arguments parse


def test_table_and_commands_name_every_entry(tiny):
    _, _, result = tiny
    text = table(result)
    assert all(e.label in text for e in result.entries)
    assert "LLM('llama3-8b'" in commands(result, top=2)


def test_run_tasks_runs_any_function_on_the_process_pool():
    assert sorted(run_tasks(abs, [-3, -1, 2], backend="process", workers=2)) == [1, 2, 3]
    with pytest.raises(ValueError, match="backend='threads'"):
        list(run_tasks(abs, [1], backend="threads"))


def test_plan_slos_gives_each_pairs_plan_and_simulates_a_shared_rate_once(monkeypatch):
    from sarathi_lite.plan import plan_slos, search

    setup = Setup("llama3-8b", "h100", 2, ttft=0.25, tbt=0.025, chunk_sizes=(512, 2048), max_degree=1)
    wl = Workload.from_trace("conversation", num_requests=TINY, qps=1.0, max_prompt=2000, max_output=64)
    slos = [(0.25, 0.025), (1.0, 0.1), (0.5, 0.05)]
    calls = []
    real = search._simulate
    monkeypatch.setattr(search, "_simulate", lambda *a: calls.append(a) or real(*a))
    one_by_one = [plan(Setup(setup.model, setup.gpu, 2, t, b, chunk_sizes=(512, 2048), max_degree=1), wl,
                       min_requests=TINY, max_requests=TINY, fine_probes=2, backend="serial", progress=False)
                  for t, b in slos]
    alone = len(calls)
    calls.clear()
    together = plan_slos(setup, wl, slos, min_requests=TINY, max_requests=TINY, fine_probes=2, backend="serial",
                         progress=False)
    for a, b in zip(one_by_one, together):
        assert (b.setup.ttft, b.setup.tbt) == (a.setup.ttft, a.setup.tbt)
        assert [(e.label, e.goodput, e.probes) for e in b.entries] == [(e.label, e.goodput, e.probes)
                                                                        for e in a.entries]
    assert len(calls) < alone  # the pairs share the coarse grid's simulations
    with pytest.raises(ValueError, match="slos is empty"):
        plan_slos(setup, wl, [])


def test_cli_plan_judges_several_slo_pairs_in_one_search(capsys):
    args = ["plan", "--model", "llama3-8b", "--gpu", "h100", "--gpus", "2", "--chunk-sizes", "512,2048",
            "--max-degree", "1", "--num-requests", str(TINY), "--max-requests", str(TINY), "--backend", "serial",
            "--no-progress", "--top", "3"]
    assert main([*args, "--slo", "0.25,0.025", "--slo", "1,0.1"]) == 0
    out = capsys.readouterr().out
    assert "SLOs TTFT 0.25 s and P99 TBT 25 ms" in out and "SLOs TTFT 1 s and P99 TBT 100 ms" in out
    assert "Best per SLO pair:" in out and "| 0.25 s | 25 ms |" in out and "| 1 s | 100 ms |" in out
    with pytest.raises(SystemExit):
        main([*args, "--slo", "fast"])
    assert "--slo 'fast': expected TTFT,TBT" in capsys.readouterr().err
    assert main(args) == 2
    assert "give --ttft-slo and --tbt-slo, or one --slo" in capsys.readouterr().err


def test_the_planner_lists_and_simulates_hybrid_candidates(tiny):
    setup = Setup("llama3-8b", "h100", 4, 1.0, 0.05)
    assert hybrid_rule(setup) == HybridRule(short=512, ttft_tokens=10240, tbt_tokens=512)
    labels = [c.label for c in space(setup).candidates]
    for split in ("1PH3DH", "2PH2DH", "3PH1DH"):
        assert f"{split}/short=512,ttft=10240,tbt=512" in labels
    assert not any("PH" in x for x in (c.label for c in space(Setup("llama3-8b", "h100", 4, 1.0, 0.05,
                                                                      hybrid=False)).candidates))
    assert not any("PH" in x for x in (c.label for c in space(Setup("llama3-8b", "h100", 1, 1.0, 0.05)).candidates))
    setup, wl, result = tiny
    (entry,) = [e for e in result.entries if e.candidate.hybrid is not None]
    cand = entry.candidate
    assert entry.error is None and entry.probes and organization(cand) == "hybrid"
    d = deployment(setup, cand)
    assert d.layout == cand.spec and d.prefill.chunk_size == 2048 and d.decode.chunk_size == 512
    run = launch(setup, cand)
    assert run["llm"]["disaggregation"] == "'1PH1DH/short=512,ttft=5120,tbt=512'"
    assert run["llm"]["prefill_options"] == {"chunk_size": 2048} and run["llm"]["chunk_size"] == 512
    assert run["serve"][run["serve"].index("--instances") + 1] == "1PH1DH/short=512,ttft=5120,tbt=512"
    sim = rate_sweep(d, wl, [entry.probes[0].rate]).results[0]
    assert {len(r) for r in sim.routes.values()} <= {1, 2} and all(m.finished_time for m in sim.requests)


def test_serve_gives_prefill_instances_their_own_chunk_size(monkeypatch):
    from sarathi_lite.cli.serve import serve_engine
    from sarathi_lite.engine import instances

    built = {}
    monkeypatch.setattr(instances, "ProcessEngine", lambda **kw: built.update(kw) or "engine")
    args = build_parser().parse_args(["serve", "m", "--instances", "2PH2DH", "--prefill-chunk-size", "2048",
                                      "--chunk-size", "512"])
    assert serve_engine(args, config="cfg") == "engine"
    assert built["prefill_options"] == {"chunk_size": 2048} and built["instances"] == Layout.parse("2PH2DH")
    args = build_parser().parse_args(["serve", "m", "--instances", "1P1D", "--prefill-chunk-size", "auto"])
    serve_engine(args, config="cfg")
    assert built["prefill_options"] == {"chunk_size": "auto"}
    for bad in (["--prefill-chunk-size", "64"], ["--data-parallel-size", "2", "--prefill-chunk-size", "64"]):
        with pytest.raises(ValueError, match="--prefill-chunk-size 64 needs --instances xPyD"):
            serve_engine(build_parser().parse_args(["serve", "m", *bad]), config="cfg")
    with pytest.raises(ValueError, match="'big'"):
        serve_engine(build_parser().parse_args(["serve", "m", "--instances", "1P1D", "--prefill-chunk-size", "big"]),
                     config="cfg")


def _entry(cand_label: str, rates: list[tuple[float, float]]) -> Entry:
    chunk = int(cand_label.split("@")[1])
    probes = [Probe(rate, att, att, 1.0, 10) for rate, att in rates]
    return Entry(Candidate("2C", 1, 1, chunk), probes, 0.9)


def test_the_table_explains_brackets_and_names_ties():
    setup = Setup("llama3-8b", "h100", 2, 1.0, 0.05)
    entries = [_entry("2C@512", [(4.0, 1.0), (8.0, 0.5)]), _entry("2C@1024", [(4.0, 1.0), (5.66, 0.95), (8.0, 0.8)]),
               _entry("2C@2048", [(4.0, 1.0), (5.66, 0.92), (8.0, 0.85)]), _entry("2C@256", [(4.0, 0.5)])]
    result = Plan(setup, sorted(entries, key=lambda e: -e.goodput), "w")
    text = table(result)
    assert "bracket: the last probed rate that met the SLOs" in text and "refined: yes if" in text
    assert ties(result) == [(1, 2, "2.83-4.00")]  # 1024 and 2048 held at 5.66 and failed at 8: a tie
    assert "Ranks 1-2 share the bracket 2.83-4.00" in text


def test_printed_commands_keep_notes_outside_and_paths_absolute(monkeypatch, tmp_path):
    tp2 = launch(Setup("llama3-70b", "h100", 8, 1.0, 0.05), Candidate("2C", 4, 1, 512))
    assert tp2["note"] and "--data-parallel-size" in tp2["serve"]
    row = [line for line in table(Plan(Setup("llama3-70b", "h100", 8, 1.0, 0.05),
                                       [Entry(Candidate("2C", 4, 1, 512), [], 0.9)], "w")).splitlines()
           if line.startswith("| 1 |")][0]
    command = row.split("`")[1]
    assert "instances as processes" not in command and "(note: this engine runs" in row.split("`")[2]
    assert tp2["llm"]["data_parallel_size"] == 2 and "disaggregation" not in tp2["llm"]
    profile = tmp_path / "p.json"
    profile.write_text("{}")
    (tmp_path / "examples").mkdir()
    monkeypatch.chdir(tmp_path)
    cpu = launch(Setup("smollm2-135m", "cpu", 1, 5.0, 1.0, profile="p.json"), Candidate("1C", 1, 1, "auto"))
    assert cpu["llm"]["cost_model"] == "p.json"  # where plan ran, the printed command finds it as given
    monkeypatch.chdir(tmp_path / "examples")
    above = launch(Setup("smollm2-135m", "cpu", 1, 5.0, 1.0, profile="../p.json"), Candidate("1C", 1, 1, "auto"))
    assert above["llm"]["cost_model"] == str(profile)  # not ../p.json, which only this folder resolves


def test_a_stopped_search_keeps_what_it_found(monkeypatch):
    from sarathi_lite.plan import search

    real, calls = search._coarse, []

    def coarse(task):
        calls.append(task)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(task)

    monkeypatch.setattr(search, "_coarse", coarse)
    setup = Setup("llama3-8b", "h100", 2, ttft=0.25, tbt=0.025, chunk_sizes=(512, 1024, 2048), max_degree=1)
    wl = Workload.from_trace("conversation", num_requests=TINY, qps=1.0, max_prompt=2000, max_output=64)
    result = plan(setup, wl, min_requests=TINY, max_requests=TINY, backend="serial", progress=False)
    assert len(result.entries) == 2 and not any(e.refined for e in result.entries)
    assert result.stopped.startswith(f"2 of {len(space(setup).candidates)} candidates searched")
    assert result.to_dict()["stopped"] == result.stopped
