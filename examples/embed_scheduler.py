"""Your own engine loop with sarathi-lite's scheduling decision (docs/guides/embedding.md): the standard library
and ``sarathi_lite.scheduler`` only. The engine keeps its requests and a pool of KV blocks; each step it hands the
decision a view of every request, applies the plan (order, budget, cap, held) while blocks last, runs a stand-in
model and prints the step. A 600-token prompt arrives first; short ones arrive while it is being prefilled."""

from dataclasses import dataclass, field

from sarathi_lite.scheduler import SchedulerConfig
from sarathi_lite.scheduler.decision import RequestView, decide_step

BLOCK = 16  # tokens per KV block
config = SchedulerConfig(chunk_size=64, max_num_seqs=8, block_size=BLOCK, num_blocks=64)


@dataclass
class Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    arrival: int  # the step it arrives at
    output: list[int] = field(default_factory=list)
    computed: int = 0  # tokens whose K/V are in its blocks
    blocks: int = 0

    def view(self) -> RequestView:
        return RequestView(self.rid, self.computed, len(self.prompt) + len(self.output), len(self.prompt), self.arrival)


def model(batch: dict[str, tuple[Req, int]]) -> dict[str, int]:
    """Stand-in forward pass: a next token for each request whose chunk reaches its last known token."""
    return {rid: (sum(r.prompt) + 7 * len(r.output)) % 1000 for rid, (r, n) in batch.items()
            if r.computed + n == len(r.prompt) + len(r.output)}


arriving = [Req("long", [1] * 600, 4, 0)] + [Req(f"short{i}", [2 + i] * 24, 6, 2 + 3 * i) for i in range(3)]
running: list[Req] = []
waiting: list[Req] = []
free_blocks, held, step = config.num_blocks, [], 0
while arriving or running or waiting:
    waiting += [r for r in arriving if r.arrival == step]
    arriving = [r for r in arriving if r.arrival > step]
    plan = decide_step([r.view() for r in running], [r.view() for r in waiting], config, just_held=held)
    held, left, batch = plan.held, plan.token_budget, {}
    requests = {r.rid: r for r in running + waiting}
    for rid in plan.running + plan.waiting:  # apply: the plan's order, budget and cap, while blocks last
        r = requests[rid]
        n = min(r.view().num_remaining, plan.long_cap or left, left)
        if rid in held or n <= 0:
            continue
        need = max(0, -(-(r.computed + n) // BLOCK) - r.blocks)
        if need > free_blocks:
            if r in waiting:
                break  # admission stops where blocks run out (a running request would be preempted here)
            continue
        free_blocks, r.blocks, left = free_blocks - need, r.blocks + need, left - n
        if r in waiting:
            waiting.remove(r)
            running.append(r)
        batch[rid] = (r, n)
    for rid, token in model(batch).items():
        batch[rid][0].output.append(token)
    for r, n in batch.values():
        r.computed += n
    for r in [r for r in running if len(r.output) == r.max_tokens]:
        running.remove(r)
        free_blocks += r.blocks
    cells = " ".join(f"{rid}:{n}" for rid, (_, n) in batch.items())
    print(f"step {step:2d} budget {plan.token_budget} cap {plan.long_cap} held {held or '-'} | {cells}")
    step += 1
print(f"done in {step} steps; free blocks {free_blocks}/{config.num_blocks}")
