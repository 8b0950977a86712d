"""Each policy's characteristic batches, preemption, admission limits, aborts, and every input the scheduler
rejects (with a message that names the bad value)."""

from __future__ import annotations

import pytest

from sarathi_lite.scheduler import (
    POLICIES,
    BlockManager,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    make_scheduler,
)

TOKEN = 7  # what the fake model always samples


def make(policy: str = "sarathi", **kwargs: object) -> Scheduler:
    kwargs.setdefault("watermark", 0.0)
    kwargs.setdefault("enable_prefix_caching", False)  # prompts here share prefixes; the cache: its own tests
    kwargs.setdefault("hol_protection", False)  # the paper's policy mechanics; protection: test_scheduler_hol.py
    return make_scheduler(SchedulerConfig(policy=policy, **kwargs))


def req(request_id: str, prompt_len: int, max_tokens: int = 8, **kwargs: object) -> Request:
    return Request(request_id, list(range(100, 100 + prompt_len)), max_tokens, **kwargs)


def step(sched: Scheduler) -> SchedulerOutput:
    out = sched.schedule()
    sched.update(out, {s.request_id: TOKEN for s in out.scheduled if s.sample})
    return out


def batch(out: SchedulerOutput) -> dict[str, tuple[str, int]]:
    """request id -> ("prefill" or "decode", tokens this step)."""
    return {s.request_id: ("prefill" if s.is_prefill else "decode", s.num_new_tokens) for s in out.scheduled}


def run_to_completion(sched: Scheduler, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        assert len(outs) < max_steps
        outs.append(step(sched))
    return outs


P, D = "prefill", "decode"


# ---------------------------------------------------------------------------------------------- policies


def test_sarathi_decodes_never_stall_while_prompt_is_chunked() -> None:
    sched = make("sarathi", chunk_size=8)
    sched.add(req("a", 3, max_tokens=20))
    sched.add(req("b", 3, max_tokens=20))
    assert batch(step(sched)) == {"a": (P, 3), "b": (P, 3)}
    sched.add(req("long", 40))
    chunks = []
    while sched.requests["long"].is_prefill:
        out = step(sched)
        assert batch(out)["a"] == (D, 1) and batch(out)["b"] == (D, 1), "a decode stalled behind the prompt"
        chunks.append(batch(out)["long"])
    assert chunks == [(P, 6)] * 6 + [(P, 4)], "the prompt takes what the two decodes leave of the 8-token budget"


def test_sarathi_several_prompts_share_a_batch() -> None:
    sched = make("sarathi", chunk_size=16)
    for rid, n in (("a", 5), ("b", 5), ("c", 10)):
        sched.add(req(rid, n))
    first = step(sched)
    assert batch(first) == {"a": (P, 5), "b": (P, 5), "c": (P, 6)}
    assert [s.sample for s in first.scheduled] == [True, True, False]
    assert batch(step(sched)) == {"a": (D, 1), "b": (D, 1), "c": (P, 4)}


def test_sarathi_continues_started_prompts_before_admitting_new_ones() -> None:
    sched = make("sarathi", chunk_size=8)
    sched.add(req("first", 12))
    assert batch(step(sched)) == {"first": (P, 8)}
    sched.add(req("second", 12))
    assert batch(step(sched)) == {"first": (P, 4), "second": (P, 4)}


def test_sarathi_gives_the_budget_to_decodes_first() -> None:
    sched = make("sarathi", chunk_size=4)
    for i in range(6):
        sched.add(req(f"r{i}", 1, max_tokens=3))
    assert batch(step(sched)) == {f"r{i}": (P, 1) for i in range(4)}
    assert batch(step(sched)) == {f"r{i}": (D, 1) for i in range(4)}, "four decodes fill the budget: no admission"
    assert batch(step(sched)) == {f"r{i}": (D, 1) for i in range(4)}
    assert batch(step(sched)) == {"r4": (P, 1), "r5": (P, 1)}


def test_vllm_never_mixes_prefill_and_decode() -> None:
    sched = make("vllm", chunk_size=4)
    sched.add(req("a", 10, max_tokens=4))
    assert batch(step(sched)) == {"a": (P, 10)}, "vllm does not chunk"
    assert batch(step(sched)) == {"a": (D, 1)}
    sched.add(req("b", 6, max_tokens=4))
    assert batch(step(sched)) == {"b": (P, 6)}, "a's decode should wait behind b's whole prompt"
    assert batch(step(sched)) == {"a": (D, 1), "b": (D, 1)}


def test_vllm_admits_every_prompt_that_fits_before_any_decode() -> None:
    sched = make("vllm", max_model_len=16, max_num_batched_tokens=16)
    sched.add(req("a", 2))
    step(sched)
    for rid in ("b", "c", "d"):
        sched.add(req(rid, 6))
    assert batch(step(sched)) == {"b": (P, 6), "c": (P, 6)}, "d does not fit in what is left of 16 tokens"
    assert batch(step(sched)) == {"d": (P, 6)}
    assert set(batch(step(sched))) == {"a", "b", "c", "d"}


def test_request_level_never_admits_while_running() -> None:
    sched = make("request_level")
    sched.add(req("short", 4, max_tokens=2))
    sched.add(req("long", 4, max_tokens=6))
    assert batch(step(sched)) == {"short": (P, 4), "long": (P, 4)}
    sched.add(req("next", 4, max_tokens=2))
    outs = run_to_completion(sched)
    first_next = next(i for i, out in enumerate(outs) if "next" in batch(out))
    assert all(set(batch(out)) <= {"short", "long"} for out in outs[:first_next])
    assert batch(outs[first_next]) == {"next": (P, 4)}
    assert first_next == 5, "next is admitted only once long has produced all its 6 tokens"


def test_orca_mixes_whole_prompts_with_decodes() -> None:
    sched = make("orca", chunk_size=8)
    sched.add(req("a", 3, max_tokens=10))
    step(sched)
    sched.add(req("b", 100))
    out = step(sched)
    assert batch(out) == {"a": (D, 1), "b": (P, 100)}, "orca puts the whole prompt beside the decode"


def test_orca_holds_a_prompt_that_does_not_fit_beside_the_decodes() -> None:
    sched = make("orca", max_model_len=64, max_num_batched_tokens=64)
    sched.add(req("a", 3, max_tokens=3))
    step(sched)
    sched.add(req("b", 64, max_tokens=1))
    assert batch(step(sched)) == {"a": (D, 1)}, "63 tokens of budget left: the 64-token prompt waits whole"
    assert batch(step(sched)) == {"a": (D, 1)}
    assert batch(step(sched)) == {"b": (P, 64)}


def test_simple_chunking_alternates_prefill_and_decode_iterations() -> None:
    sched = make("simple_chunking", chunk_size=8)
    sched.add(req("a", 3, max_tokens=20))
    step(sched)
    sched.add(req("long", 20))
    kinds = [batch(step(sched)) for _ in range(7)]
    assert kinds == [
        {"a": (D, 1)}, {"long": (P, 8)},  # a's prompt was a prefill iteration: a decode iteration comes next
        {"a": (D, 1)}, {"long": (P, 8)},
        {"a": (D, 1)}, {"long": (P, 4)},
        {"a": (D, 1), "long": (D, 1)},
    ]


def test_simple_chunking_runs_a_prompt_chunk_when_every_decode_is_preempted() -> None:
    # Regression: a decode-only iteration whose only decode had to preempt itself used to return an empty batch
    # although a prompt mid-prefill could run.
    sched = make("simple_chunking", chunk_size=3, block_size=1, max_model_len=21, num_blocks=22,
                 long_prefill_token_threshold=2)
    sched.add(req("long", 21, max_tokens=1))
    sched.add(req("short", 1, max_tokens=3))
    assert batch(step(sched)) == {"long": (P, 2), "short": (P, 1)}
    assert sched.block_manager.num_free_blocks == 0
    out = step(sched)
    assert out.preempted_ids == ["short"]
    assert batch(out) == {"long": (P, 2)}
    run_to_completion(sched)


# ---------------------------------------------------------------------------------------------- preemption


@pytest.mark.parametrize("policy", POLICIES)
def test_preemption_victim_is_most_recent_arrival_and_returns_to_front(policy: str) -> None:
    # Three two-token prompts fill three of four two-token blocks; each first decode needs a new block, and d
    # (two blocks) cannot be admitted.
    sched = make(policy, block_size=2, num_blocks=4, max_model_len=16, max_num_batched_tokens=16)
    for rid in ("a", "b", "c"):
        sched.add(req(rid, 2, max_tokens=3))
    assert set(batch(step(sched))) == {"a", "b", "c"}
    sched.add(req("d", 3, max_tokens=3))
    out = step(sched)
    assert out.preempted_ids == ["c"]
    assert batch(out) == {"a": (D, 1), "b": (D, 1)}
    assert [r.request_id for r in sched.waiting] == ["c", "d"], "the victim goes back ahead of later arrivals"
    c = sched.requests["c"]
    assert (c.status, c.block_ids, c.num_computed_tokens, c.num_preemptions) == (RequestStatus.WAITING, [], 0, 1)
    assert c.num_prefill_tokens == 3 and c.output_token_ids == [TOKEN]

    outs = run_to_completion(sched)
    first = {rid: next(i for i, o in enumerate(outs) if rid in batch(o)) for rid in ("c", "d")}
    assert first["c"] <= first["d"]
    recompute = next(s for s in outs[first["c"]].scheduled if s.request_id == "c")
    assert (recompute.num_computed_tokens, recompute.token_ids, recompute.is_prefill) == (0, [100, 101, TOKEN], True)


def test_preemption_victim_is_the_last_request_of_the_steps_fill_order() -> None:
    # The victim is the last request of the plan's fill order, as in vLLM's loop: decodes come before prompts
    # mid-prefill, so x (a prompt mid-prefill that arrived first) makes room for d's decode, and returns to wait
    sched = make("sarathi", chunk_size=6, block_size=2, num_blocks=16, max_model_len=32,
                 long_prefill_token_threshold=4)
    sched.add(req("x", 30, max_tokens=2))
    sched.add(req("d", 2, max_tokens=4))
    assert batch(step(sched)) == {"x": (P, 4), "d": (P, 2)} and sched.block_manager.num_free_blocks == 0
    out = step(sched)
    assert sched.last_decision.running == ["d", "x"]
    assert out.preempted_ids == ["x"] and batch(out) == {"d": (D, 1)}
    assert [r.request_id for r in sched.waiting] == ["x"] and sched.requests["x"].num_computed_tokens == 0


# ---------------------------------------------------------------------------------------------- admission limits


def test_long_prefill_threshold_caps_every_chunk_without_protection_and_orders_short_first_with_it() -> None:
    def first_batch(**options: object) -> dict[str, tuple[str, int]]:
        sched = make("sarathi", chunk_size=16, **options)
        for rid, n in (("long1", 40), ("long2", 40), ("short", 4)):
            sched.add(req(rid, n))
        return batch(step(sched))

    assert first_batch() == {"long1": (P, 16)}, "without a threshold the short prompt waits behind the long one"
    # vLLM's rule: no request takes more than the threshold in a step
    assert first_batch(long_prefill_token_threshold=8) == {"long1": (P, 8), "long2": (P, 8)}
    # head-of-line protection: above the threshold a prompt is long, and short prompts go first
    assert first_batch(long_prefill_token_threshold=8, hol_protection=True) == {"short": (P, 4), "long1": (P, 12)}


@pytest.mark.parametrize("policy", POLICIES)
def test_max_num_seqs_caps_running_requests(policy: str) -> None:
    sched = make(policy, max_num_seqs=2)
    for rid in ("a", "b", "c"):
        sched.add(req(rid, 2, max_tokens=3))
    assert set(batch(step(sched))) == {"a", "b"}
    while "c" not in batch(out := step(sched)):
        assert len(sched.running) <= 2
    assert not {"a", "b"} & set(sched.requests), "c starts only after a and b have finished"
    assert batch(out)["c"] == (P, 2)


def test_watermark_keeps_blocks_free_when_admitting_beside_running_requests() -> None:
    def admitted_beside_a(watermark: float) -> bool:
        sched = make("sarathi", block_size=4, num_blocks=10, watermark=watermark)
        sched.add(req("a", 7, max_tokens=4))  # 2 blocks, with room for its first decodes
        step(sched)
        sched.add(req("b", 28, max_tokens=4))  # 7 blocks: leaves 1 of the 8 free
        return "b" in batch(step(sched))

    assert admitted_beside_a(0.0)
    assert admitted_beside_a(0.1)  # keeps int(0.1 * 10) = 1 block
    assert not admitted_beside_a(0.2)  # keeps 2 blocks


def test_watermark_does_not_hold_back_a_request_when_nothing_runs() -> None:
    sched = make("sarathi", block_size=4, num_blocks=10, watermark=0.5)
    sched.add(req("whole_pool", 40, max_tokens=1))
    assert batch(step(sched)) == {"whole_pool": (P, 40)}


def test_blocks_for_the_whole_prompt_are_taken_at_admission() -> None:
    sched = make("sarathi", chunk_size=4, block_size=4, num_blocks=16)
    sched.add(req("a", 30))
    out = step(sched)
    assert out.scheduled[0].block_table == sched.requests["a"].block_ids[:1]
    assert len(sched.requests["a"].block_ids) == 8 and sched.block_manager.num_free_blocks == 8


# ---------------------------------------------------------------------------------------------- aborts and finishing


@pytest.mark.parametrize("policy", POLICIES)
def test_abort_in_every_state_frees_blocks(policy: str) -> None:
    sched = make(policy, chunk_size=4, block_size=2, num_blocks=12, max_model_len=16, max_num_batched_tokens=16)
    pool = sched.block_manager

    def abort(rid: str) -> None:
        r = sched.abort(rid)
        assert (r.status, r.finish_reason, r.block_ids) == (RequestStatus.FINISHED, "abort", [])
        assert rid not in sched.requests and r not in sched.running and r not in sched.waiting

    sched.add(req("waiting", 2))
    abort("waiting")
    assert pool.num_free_blocks == 12

    sched.add(req("prefilling", 8))
    step(sched)
    if policy in ("sarathi", "simple_chunking"):
        assert sched.requests["prefilling"].is_prefill, "4 of its 8 prompt tokens are cached"
    abort("prefilling")
    assert pool.num_free_blocks == 12

    sched.add(req("decoding", 4))
    sched.add(req("other", 2))
    while not (sched.requests["decoding"].output_token_ids[1:] and sched.requests["other"].output_token_ids[1:]):
        step(sched)
    abort("decoding")
    assert pool.num_free_blocks == 12 - len(sched.requests["other"].block_ids)
    abort("other")
    assert pool.num_free_blocks == 12

    sched.add(req("between", 3))
    out = sched.schedule()
    abort("between")
    assert sched.update(out, {}) == [], "update skips a request aborted since schedule(), token or not"
    assert pool.num_free_blocks == 12 and not sched.has_unfinished()

    sched.add(req("between", 3))  # the id is free again
    run_to_completion(sched)
    assert pool.num_free_blocks == 12


def test_abort_of_a_preempted_request_frees_nothing_more_and_keeps_the_pool_whole() -> None:
    sched = make("sarathi", block_size=2, num_blocks=4, max_model_len=16)
    for rid in ("a", "b", "c"):
        sched.add(req(rid, 2, max_tokens=3))
    step(sched)
    assert step(sched).preempted_ids == ["c"]
    free = sched.block_manager.num_free_blocks
    sched.abort("c")
    assert sched.block_manager.num_free_blocks == free
    run_to_completion(sched)
    assert sched.block_manager.num_free_blocks == 4


def test_finish_reasons_stop_length_and_max_model_len() -> None:
    sched = make("sarathi", max_model_len=10)
    sched.add(req("stop", 2, max_tokens=5, stop_token_ids=frozenset({TOKEN})))
    sched.add(req("length", 2, max_tokens=3))
    sched.add(req("model_len", 6, max_tokens=50))
    sched.add(req("full_prompt", 10, max_tokens=50))
    finished = {}
    while sched.has_unfinished():
        out = sched.schedule()
        for r in sched.update(out, {s.request_id: TOKEN for s in out.scheduled if s.sample}):
            finished[r.request_id] = (r.finish_reason, len(r.output_token_ids))
    assert finished == {"stop": ("stop", 1), "length": ("length", 3), "model_len": ("length", 4),
                        "full_prompt": ("length", 1)}


def test_request_id_can_be_reused_once_finished() -> None:
    sched = make()
    sched.add(req("a", 2, max_tokens=1))
    run_to_completion(sched)
    sched.add(req("a", 2, max_tokens=1))
    assert sched.has_unfinished()


# ---------------------------------------------------------------------------------------------- rejected input


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"policy": "fcfs"}, r"policy='fcfs' is not one of sarathi, vllm"),
    ({"chunk_size": 0}, r"chunk_size=0 must be a positive integer"),
    ({"chunk_size": -3}, r"chunk_size=-3 "),
    ({"chunk_size": 8.0}, r"chunk_size=8\.0 "),
    ({"chunk_size": True}, r"chunk_size=True "),
    ({"max_num_seqs": 0}, r"max_num_seqs=0 "),
    ({"max_model_len": "4096"}, r"max_model_len='4096' "),
    ({"block_size": 0}, r"block_size=0 "),
    ({"max_num_batched_tokens": 0}, r"max_num_batched_tokens=0 "),
    ({"num_blocks": 0}, r"num_blocks=0 "),
    ({"long_prefill_token_threshold": 0}, r"long_prefill_token_threshold=0 "),
    ({"watermark": 1.0}, r"watermark=1\.0 must be in \[0, 1\)"),
    ({"watermark": -0.01}, r"watermark=-0\.01 "),
    ({"watermark": float("nan")}, r"watermark=nan "),
    ({"policy": "vllm", "max_model_len": 4096, "max_num_batched_tokens": 1024},
     r"max_num_batched_tokens=1024 is smaller than max_model_len=4096: policy 'vllm'"),
    ({"policy": "orca", "max_model_len": 100, "max_num_batched_tokens": 99}, r"max_num_batched_tokens=99 "),
    ({"policy": "request_level", "max_model_len": 100, "max_num_batched_tokens": 99}, r"max_num_batched_tokens=99 "),
])
def test_config_rejects_bad_values_naming_them(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SchedulerConfig(**kwargs)


def test_config_defaults_follow_vllm() -> None:
    cfg = SchedulerConfig(policy="vllm", max_model_len=1000, max_num_seqs=4, block_size=16)
    assert cfg.max_num_batched_tokens == 2048 and cfg.num_blocks == 4 * 63
    assert SchedulerConfig(max_model_len=8192).max_num_batched_tokens == 8192
    assert SchedulerConfig(policy="sarathi", chunk_size=256, max_num_batched_tokens=8).token_budget == 256


@pytest.mark.parametrize(("request_", "match"), [
    (Request("e", [], 4), r"request 'e' has an empty prompt"),
    (Request("m", [1], 0), r"request 'm': max_tokens=0 must be >= 1"),
    (Request("m", [1], True), r"max_tokens=True "),
    (Request("m", [1], 2.5), r"max_tokens=2\.5 "),
    (Request("long", list(range(17)), 1), r"request 'long': prompt of 17 tokens is longer than max_model_len=16"),
    (Request("big", list(range(10)), 7),
     r"request 'big': 10 prompt tokens \+ max_tokens=7 need 4 KV blocks of 4 tokens, more than the whole pool "
     r"\(num_blocks=3\)"),
])
def test_add_rejects_requests_that_could_never_be_served(request_: Request, match: str) -> None:
    sched = make(max_model_len=16, block_size=4, num_blocks=3)
    with pytest.raises(ValueError, match=match):
        sched.add(request_)
    assert not sched.has_unfinished() and not sched.waiting


def test_add_accepts_a_request_that_needs_exactly_the_whole_pool() -> None:
    sched = make(max_model_len=16, block_size=4, num_blocks=3)
    sched.add(Request("fits", list(range(10)), 3))  # holds at most 12 tokens of K/V: the last is never cached
    run_to_completion(sched)


def test_add_rejects_an_id_in_use_naming_it() -> None:
    sched = make()
    sched.add(req("dup", 2))
    with pytest.raises(ValueError, match=r"request_id='dup' is already in use"):
        sched.add(req("dup", 3))
    assert len(sched.waiting) == 1


def test_abort_rejects_an_unknown_id_naming_it() -> None:
    sched = make()
    sched.add(req("a", 2, max_tokens=1))
    run_to_completion(sched)
    for rid in ("nope", "a"):
        with pytest.raises(ValueError, match=rf"request_id='{rid}' is unknown or already finished"):
            sched.abort(rid)


def test_update_rejects_a_missing_sampled_token_naming_the_request_and_changes_nothing() -> None:
    sched = make(chunk_size=16)
    sched.add(req("a", 4))
    sched.add(req("b", 4))
    out = sched.schedule()
    with pytest.raises(ValueError, match=r"no sampled token given for request 'b'"):
        sched.update(out, {"a": TOKEN})
    # Regression: the rows before the missing one used to be applied already, leaving the state half-updated.
    assert [(r.num_computed_tokens, r.output_token_ids) for r in sched.running] == [(0, []), (0, [])]
    sched.update(out, {"a": TOKEN, "b": TOKEN})
    assert [(r.num_computed_tokens, r.output_token_ids) for r in sched.running] == [(4, [TOKEN]), (4, [TOKEN])]


def test_block_manager_rejects_an_empty_pool_and_over_allocation() -> None:
    with pytest.raises(ValueError, match=r"num_blocks=0 and block_size=16"):
        BlockManager(0, 16)
    pool = BlockManager(2, 4)
    with pytest.raises(RuntimeError, match=r"asked for 3 blocks with 2 free"):
        pool.allocate(3)


@pytest.mark.parametrize("policy, budget", [("simple_chunking", {"chunk_size": 4}),
                                            ("vllm", {"max_num_batched_tokens": 4, "max_model_len": 4})])
def test_running_requests_are_capped_by_the_token_budget_so_decode_steps_fit_it(policy: str, budget: dict) -> None:
    # max_num_seqs=8 but a budget of 4 tokens: a decode-only iteration of 8 requests would overrun it.
    sched = make_scheduler(SchedulerConfig(**{"policy": policy, "max_model_len": 64, "max_num_seqs": 8,
                                              "num_blocks": 256, "block_size": 4, **budget}))
    assert sched.config.max_running == 4
    for i in range(8):
        sched.add(req(f"r{i}", 1, max_tokens=3))
    while sched.has_unfinished():
        out = step(sched)
        assert out.num_batched_tokens <= 4 and len(sched.running) <= 4
