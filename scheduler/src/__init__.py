"""sarathi_lite.scheduler: chunked-prefill scheduling over a paged KV block pool.

Pure Python (stdlib only, never torch), so a serving framework or a simulator can import it alone::

    from sarathi_lite.scheduler import Request, SchedulerConfig, make_scheduler
    sched = make_scheduler(SchedulerConfig(policy="sarathi", chunk_size=256, num_blocks=1024))
    sched.add(Request("r0", prompt_token_ids=[1, 2, 3], max_tokens=8))
    while sched.has_unfinished():
        out = sched.schedule()
        sampled = {s.request_id: 0 for s in out.scheduled if s.sample}   # run the model here
        sched.update(out, sampled)
"""

from .base import Scheduler, make_scheduler
from .block_manager import BlockManager, block_key
from .budget import StepTimePredictor, TokenBudget
from .config import LONG_PROMPT_CHUNKS, SchedulerConfig
from .decision import Policy, RequestView, StepDecision, decide_step, fill, make_policy
from .kv_cache_manager import KVCacheManager
from .kv_transfer import KVConnectorScheduler, KVLoad, KVSave
from .output import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput
from .registry import chunked_policy_names, policy_class, policy_names, register_policy
from .request import Request, RequestStatus

# The built-in policies of the Sarathi-Serve paper's comparison, from the registry (a policy registered later
# shows in policy_names(), not here). A policy that reproduces another engine's own rule (`reproduces`: vllm_v1)
# is registered too, for the simulator, but not listed here: it is checked against that engine, not held to the
# invariants the paper's policies share.
POLICIES = tuple(p for p in policy_names() if not policy_class(p).reproduces)
CHUNKED_POLICIES = tuple(p for p in chunked_policy_names() if p in POLICIES)

__all__ = [
    "BlockManager",
    "CHUNKED_POLICIES",
    "KVCacheManager",
    "KVConnectorScheduler",
    "KVLoad",
    "KVSave",
    "LONG_PROMPT_CHUNKS",
    "PLACEHOLDER_TOKEN",
    "POLICIES",
    "Policy",
    "Request",
    "RequestStatus",
    "RequestView",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "StepDecision",
    "StepTimePredictor",
    "TokenBudget",
    "block_key",
    "chunked_policy_names",
    "fill",
    "make_policy",
    "make_scheduler",
    "decide_step",
    "policy_class",
    "policy_names",
    "register_policy",
]
