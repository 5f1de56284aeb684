"""The engine core's scheduling half driven without a model: Scheduler + KVCacheManager + BlockPool around a
fake runner that simulates the KV cache's content, with every invariant checked after each step.

vLLM tests its v1 core the same way (``tests/v1/core/test_scheduler.py``, ``test_prefix_caching.py``): fake
requests, a fake model output, and asserts on the block pool and the queues.

The fake runner is a model in miniature: it writes, for each token a step computes, a value standing for that
token's K/V (a hash of the sequence up to and including it, which is what real K/V depend on) into the slot the
block table maps it to, and then reads back every slot the step's queries attend to (all earlier positions, or
the last ``sliding_window`` ones) and checks each holds the value of the reading request's own sequence. So a
prefix-cache hit on the wrong block, a block reused while another request still reads it, or a block table
that misses a position all fail at the step they happen. The token it samples is a deterministic function of
the request (:func:`fake_token`), so every completion's output is known in advance
(:func:`expected_output`) whatever the batching, chunking, preemption and speculation.

Speculative decoding: with ``num_speculative_tokens`` k the scheduler's proposer is :class:`FakeProposer`, which
proposes k drafts of which a varying number are right (the fake model's own continuation), the rest wrong. The
runner writes the drafts' K/V like any token's (a value chained from the drafts) and verifies them as the real
sampler does (``accept_greedy``), so rejected drafts leave stale values in the cache that later steps must
overwrite before reading, and a block registered in the prefix cache while holding one would be caught.
"""

from __future__ import annotations

import queue
from collections import Counter, defaultdict

from backend.block_pool import sha256_block_hash
from backend.config import EngineConfig
from backend.kv_cache_manager import NULL_BLOCK, KVCacheManager
from backend.parallel_sampling import ParentRequest
from backend.request import Request, RequestStatus
from backend.sampler import accept_greedy
from backend.sampling_params import SamplingParams
from backend.scheduler import Scheduler
from backend.scheduler_output import SchedulerOutput
from backend.utils import cdiv

VOCAB = 64  # token ids 0..63
EOS = 0  # about one fake token in 64 is EOS, so some completions stop early


def fake_token(request: Request) -> int:
    """The token sampled after the request's current tokens: a function of its last token, its length and its
    completion index (so the ``n`` completions of one prompt diverge)."""
    return fake_next(request.token_ids[-1], request.num_tokens, request.index)


def fake_next(last_token: int, num_tokens: int, index: int) -> int:
    """:func:`fake_token` after a sequence of ``num_tokens`` tokens ending in ``last_token``."""
    return (last_token * 31 + num_tokens * 7 + index * 13 + 5) % VOCAB


def fake_targets(request: Request, drafts) -> list[int]:
    """What the fake model samples after the request's tokens and after each draft (``len(drafts) + 1``)."""
    targets, last = [], request.token_ids[-1]
    for j in range(len(drafts) + 1):
        targets.append(fake_next(last, request.num_tokens + j, request.index))
        if j < len(drafts):
            last = drafts[j]
    return targets


class FakeProposer:
    """Stands in for the n-gram proposer: of the ``k`` drafts for a request, the first ``m`` are what the fake
    model will sample (``m`` cycles through 0..k from call to call, so runs of every length are accepted), the
    rest are wrong."""

    def __init__(self, k: int, requests: dict[str, Request]) -> None:
        self.k = k
        self.requests = requests  # to find the request whose tokens are proposed for (fake_next needs its index)
        self.num_calls = 0

    def propose(self, token_ids: list[int], max_drafts: int | None = None) -> list[int]:
        request = next(r for r in self.requests.values() if r.token_ids is token_ids)
        limit = self.k if max_drafts is None else min(self.k, max_drafts)
        right = self.num_calls % (self.k + 1)
        self.num_calls += 1
        drafts: list[int] = []
        for j in range(limit):
            token = fake_targets(request, drafts)[-1]
            drafts.append(token if j < right else (token + 1) % VOCAB)
        return drafts


def fake_step_seconds(out: SchedulerOutput) -> float:
    """A step's time as a line in its work (tokens + requests): 2 ms, plus 1 ms per unit."""
    return 0.002 + 0.001 * (out.total_num_scheduled_tokens + len(out.scheduled))


def expected_output(prompt: list[int], max_tokens: int, index: int = 0) -> tuple[list[int], RequestStatus]:
    """What a completion run alone produces with :func:`fake_token`: its output tokens and how it ends
    (EOS: stop; ``max_tokens``: length)."""
    probe = Request("probe", prompt, SamplingParams(max_tokens=max_tokens), (EOS,), max_tokens, index)
    while True:
        token = fake_token(probe)
        probe.token_ids.append(token)
        if token == EOS:
            return probe.output_token_ids, RequestStatus.FINISHED_STOPPED
        if probe.num_output_tokens >= max_tokens:
            return probe.output_token_ids, RequestStatus.FINISHED_LENGTH


def expected_block_key(request: Request, index: int, block_size: int) -> tuple[bytes, tuple]:
    """The prefix-cache hash and key of the request's ``index``-th full block, computed here from the rule
    the pool documents (the parent's hash chains the prefix; a cache salt seeds the first block)."""
    parent = None
    for i in range(index + 1):
        tokens = tuple(request.token_ids[i * block_size:(i + 1) * block_size])
        salt = request.cache_salt if i == 0 and request.cache_salt else None
        seed = parent if parent is not None else (salt.encode() if salt else None)
        block_hash, key = sha256_block_hash(seed, tokens), (parent, tokens, salt)
        parent = block_hash
    return block_hash, key


class FakeRunner:
    """Writes and reads the simulated KV cache as a forward pass would; samples :func:`fake_token`.

    Raises AssertionError on a write that changes a position another request has already computed in a shared
    block, on two different writes to one slot in one step, and on a read of a slot that does not hold the
    reading request's own value.
    """

    def __init__(self, num_blocks: int, block_size: int, sliding_window: int | None) -> None:
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self._values: dict[str, list[int]] = {}  # request id -> value of each position (memo; tokens only grow)
        self.num_tokens_computed = 0

    def value(self, request: Request, position: int, drafts=()) -> int:
        """Stands for the K/V of ``position``: a hash of the tokens up to and including it (``drafts``: the
        tokens that follow the request's own in this step, for positions past them)."""
        if position >= request.num_tokens:  # a draft: chained from the request's last token, never memoized
            value = self.value(request, request.num_tokens - 1)
            for token in drafts[:position - request.num_tokens + 1]:
                value = hash((value, token))
            return value
        values = self._values.setdefault(request.request_id, [])
        while len(values) <= position:
            values.append(hash((values[-1] if values else -1, request.token_ids[len(values)])))
        return values[position]

    def execute(self, sched: SchedulerOutput, holders: dict[int, list[tuple[Request, int]]],
                ) -> tuple[dict[str, int], dict[str, list[int]]]:
        """``holders``: block id -> (request, index in its block table) for every table holding it.

        Returns:
            (request id -> sampled token, request id -> a speculative decode's verified tokens)."""
        bs = self.block_size
        writes: dict[int, int] = {}
        for s in sched.scheduled:
            request = s.request
            for p in range(s.num_computed_tokens, s.seq_len):
                block = s.block_ids[p // bs]
                assert block != NULL_BLOCK, f"{request.request_id} computes position {p} into a null block"
                value = self.value(request, p, s.draft_token_ids)
                slot = block * bs + p % bs
                assert writes.setdefault(slot, value) == value, f"two different writes to slot {slot} in one step"
                for other, j in holders[block]:
                    pos = j * bs + p % bs
                    if other is not request and pos < other.num_computed_tokens:
                        assert self.value(other, pos) == value, (
                            f"{request.request_id} overwrites position {pos} of {other.request_id} in shared "
                            f"block {block}")
            self.num_tokens_computed += s.num_scheduled_tokens
        for slot, value in writes.items():
            self.slots[slot] = value
        sampled, verified = {}, {}
        for s in sched.scheduled:
            request = s.request
            first = s.num_computed_tokens  # the chunk's first query attends from first - W + 1 on
            low = 0 if self.sliding_window is None else max(0, first - self.sliding_window + 1)
            for p in range(low, s.seq_len):
                block = s.block_ids[p // bs]
                assert block != NULL_BLOCK, f"{request.request_id} attends to position {p} in a null block"
                assert self.slots[block * bs + p % bs] == self.value(request, p, s.draft_token_ids), (
                    f"{request.request_id} reads wrong K/V at position {p} (block {block})")
            if s.draft_token_ids:
                verified[request.request_id] = accept_greedy(s.draft_token_ids,
                                                             fake_targets(request, s.draft_token_ids))
            elif s.samples:
                sampled[request.request_id] = fake_token(request)
        return sampled, verified


class CoreSim:
    """Scheduler + KVCacheManager + BlockPool + :class:`FakeRunner`, with :meth:`check` after every step."""

    def __init__(self, *, num_blocks: int, block_size: int, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, max_model_len: int = 4096,
                 num_speculative_tokens: int = 0, max_step_ms: float = 0.0) -> None:
        self.config = EngineConfig(block_size=block_size, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   enable_prefix_caching=enable_prefix_caching,
                                   num_speculative_tokens=num_speculative_tokens, max_step_ms=max_step_ms)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching, sliding_window=sliding_window)
        self.pool = self.kv.pool
        self.scheduler = Scheduler(self.config, self.kv, max_model_len)
        self.requests: dict[str, Request] = {}  # every request ever added, by id
        if num_speculative_tokens:
            self.scheduler.proposer = FakeProposer(num_speculative_tokens, self.requests)
        self.runner = FakeRunner(num_blocks, block_size, sliding_window)
        self.num_steps = 0

    # -- driving -------------------------------------------------------------------------------------
    def add(self, request: Request) -> Request:
        self.scheduler.check_fits(request.num_prompt_tokens, request.max_tokens)
        assert request.request_id not in self.requests
        self.requests[request.request_id] = request
        self.scheduler.add_request(request)
        return request

    def add_prompt(self, request_id: str, prompt: list[int], max_tokens: int, *, n: int = 1, priority: int = 0,
                   prompt_logprobs: int | None = None, cache_salt: str | None = None,
                   greedy: bool = False, fairness_key: str | None = None) -> list[Request]:
        """A caller's request: ``n`` completions (``ParentRequest.make_requests``), or one with ``cache_salt``.
        ``greedy``: temperature 0, so the request may speculate (the fake tokens are the same either way)."""
        params = SamplingParams(n=n, max_tokens=max_tokens, prompt_logprobs=prompt_logprobs,
                                temperature=0.0 if greedy else 1.0)
        if cache_salt is not None:
            assert n == 1
            children = [Request(request_id, prompt, params, (EOS,), max_tokens, cache_salt=cache_salt,
                                priority=priority, fairness_key=fairness_key)]
        else:
            parent = ParentRequest(request_id, params, queue.Queue())
            children = parent.make_requests(prompt, (EOS,), max_tokens, [], self.config.enable_prefix_caching,
                                            priority=priority, fairness_key=fairness_key)
        return [self.add(child) for child in children]

    def abort(self, request: Request) -> None:
        self.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
        self.check()

    def step(self) -> SchedulerOutput:
        """One schedule -> fake forward -> update, checked before and after the forward pass."""
        waiting_before = {r.request_id for r in self.scheduler.waiting}
        out = self.scheduler.schedule()
        self.check_schedule(out, waiting_before)
        sampled, verified = self.runner.execute(out, self._holders())
        self.scheduler.update_from_output(out, sampled, verified)
        self.scheduler.observe_step(out, fake_step_seconds(out))
        self.num_steps += 1
        self.check()
        return out

    def fail_step(self) -> SchedulerOutput:
        """A step whose forward pass fails: its requests end with ``FINISHED_ERROR`` (as ``EngineCore.step``
        ends them), their blocks freed and dropped from the prefix cache; nothing is written."""
        waiting_before = {r.request_id for r in self.scheduler.waiting}
        out = self.scheduler.schedule()
        self.check_schedule(out, waiting_before)
        for request in out.requests:
            self.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR, "forward pass failed")
        self.num_steps += 1
        self.check()
        return out

    def run(self, max_steps: int = 10_000) -> None:
        """Steps until nothing is left, failing on a step that schedules nothing while work remains."""
        while self.scheduler.running or self.scheduler.waiting:
            assert self.num_steps < max_steps, "requests left unfinished"
            out = self.step()
            assert not out.is_empty, f"nothing scheduled with {self.scheduler.waiting} waiting"
        self.check_drained()

    # -- invariants ----------------------------------------------------------------------------------
    def _holders(self) -> dict[int, list[tuple[Request, int]]]:
        holders: dict[int, list[tuple[Request, int]]] = defaultdict(list)
        for request_id, table in self.kv.block_tables.items():
            for j, block in enumerate(table):
                if block != NULL_BLOCK:
                    holders[block].append((self.requests[request_id], j))
        return holders

    def check_schedule(self, out: SchedulerOutput, waiting_before: set[str]) -> None:
        """The step's budgets, block tables and prefix-cache hits (before the forward pass)."""
        sched = self.scheduler
        bs = self.kv.block_size
        ids = [s.request_id for s in out.scheduled]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        assert len(ids) <= sched.max_num_seqs and len(sched.running) <= sched.max_num_seqs
        assert out.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        sizes = out.num_scheduled_tokens
        decodes = [s.is_decode for s in out.scheduled]
        assert decodes == sorted(decodes, reverse=True), "decodes not first"
        assert all(n == 1 for n, decode in zip(sizes, decodes) if decode), "a decode of more than one token"
        assert out.num_decodes == sum(decodes)
        running = {id(r) for r in sched.running}
        assert out.num_draft_tokens == sum(len(s.draft_token_ids) for s in out.scheduled)
        for s in out.scheduled:
            request = s.request
            assert id(request) in running and request.status == RequestStatus.RUNNING
            num_drafts = len(s.draft_token_ids)
            assert s.num_scheduled_tokens >= 1 and s.seq_len - num_drafts <= request.num_tokens
            if num_drafts:  # a decode with drafts: only for requests allowed to, never past max_tokens
                assert request.params.greedy and s.num_computed_tokens == request.num_tokens - 1
                assert s.num_scheduled_tokens == 1 + num_drafts
                assert 0 < num_drafts <= self.config.num_speculative_tokens
                assert request.num_output_tokens + num_drafts < request.max_tokens
            assert s.num_computed_tokens == request.num_computed_tokens
            assert len(s.block_ids) == cdiv(s.seq_len, bs), "block table does not match the step's tokens"
            assert s.block_ids == self.kv.get_block_ids(request.request_id)
            if request.request_id in waiting_before:  # admitted this step: its head are prefix-cache hits
                num_hits = s.num_computed_tokens // bs
                assert s.num_computed_tokens % bs == 0
                if request.wants_prompt_logprobs or not self.kv._caches(request):
                    assert num_hits == 0, f"{request.request_id} took prefix-cache hits it may not take"
                for i, block in enumerate(s.block_ids[:num_hits]):
                    if block == NULL_BLOCK:  # a hit behind the sliding window, left free
                        continue
                    assert self.pool._keys.get(block) == expected_block_key(request, i, bs), (
                        f"prefix-cache hit on block {block} whose content is not block {i} of {request}")

    def check(self) -> None:
        """Every invariant of the pool, the manager's tables and the scheduler's queues."""
        kv, pool, sched = self.kv, self.pool, self.scheduler
        bs = kv.block_size
        # Every block is free or owned, never both; reference counts = number of tables holding the block.
        free = set(pool._free)
        assert len(free) == pool.num_free_blocks
        holders = self._holders()
        for block in range(pool.num_blocks):
            refs = pool.ref_counts[block]
            assert refs >= 0
            assert (refs == 0) == (block in free), f"block {block}: {refs} references, free={block in free}"
            assert refs == len(holders.get(block, ())), (
                f"block {block}: {refs} references but held by {len(holders.get(block, ()))} tables")
        assert pool.num_free_blocks + sum(1 for r in pool.ref_counts if r) == pool.num_blocks
        for table in kv.block_tables.values():
            owned = [b for b in table if b != NULL_BLOCK]
            assert len(owned) == len(set(owned)), "a block twice in one table"
        # Blocks are shared only between requests of the same cache salt (none without prefix caching).
        for block, holding in holders.items():
            if len(holding) > 1:
                salts = {r.cache_salt for r, _ in holding}
                assert len(salts) == 1, f"block {block} shared across cache salts {salts}"
                assert kv.enable_prefix_caching or salts != {None}, f"block {block} shared with caching off"
        # Queues: no request both running and waiting; statuses and ordering.
        running_ids = [r.request_id for r in sched.running]
        waiting_ids = [r.request_id for r in sched.waiting]
        assert len(set(running_ids)) == len(running_ids) and len(set(waiting_ids)) == len(waiting_ids)
        assert not set(running_ids) & set(waiting_ids), "a request both running and waiting"
        assert len(running_ids) <= sched.max_num_seqs
        order = [(r.priority, r.fair_start) for r in sched.waiting]
        assert order == sorted(order), "waiting queue out of (priority, start tag) order"
        # Fair queuing remembers the keys that have waiting requests, and no others.
        assert sched._num_waiting_by_key == dict(Counter(r.fairness_key for r in sched.waiting))
        assert set(sched._next_tag) <= set(sched._num_waiting_by_key)
        assert sched.num_waiting_tokens == sum(r.num_tokens for r in sched.waiting)
        # Only running requests hold blocks; each table covers exactly the computed tokens.
        assert set(kv.block_tables) == set(running_ids), "block tables are not those of the running requests"
        for request in sched.running:
            assert request.status == RequestStatus.RUNNING
            assert 0 < request.num_computed_tokens < request.num_tokens
            table = kv.block_tables[request.request_id]
            assert len(table) == cdiv(request.num_computed_tokens, bs), (
                f"{request}: {len(table)} blocks for {request.num_computed_tokens} computed tokens")
            for i, block in enumerate(table):  # a findable block holds the request's own tokens, never a draft
                if block != NULL_BLOCK and block in pool._keys:
                    assert pool._keys[block][1][1] == tuple(request.token_ids[i * bs:(i + 1) * bs]), (
                        f"{request}: block {i} is registered with tokens that are not the request's")
            window = kv.sliding_window
            needed_from = 0 if window is None else max(0, request.num_computed_tokens - window + 1) // bs
            assert NULL_BLOCK not in table[needed_from:], f"{request} lost a block its next token attends to"
            if window is not None:
                held = sum(1 for b in table if b != NULL_BLOCK)
                assert held <= cdiv(window - 1 + sched.max_num_batched_tokens, bs) + 1, f"{request} holds {held}"
        for request in sched.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.num_computed_tokens == 0
        live = set(running_ids) | set(waiting_ids)
        assert set(kv._block_hashes) <= live and set(kv._num_cached_blocks) <= set(kv.block_tables)
        # Finished requests hold nothing.
        for request in self.requests.values():
            if request.is_finished:
                assert request.request_id not in live and request.request_id not in kv.block_tables
                assert request.request_id not in kv._block_hashes
            else:
                assert request.request_id in live, f"{request} neither finished nor queued"
        # The prefix cache: each findable hash names a block registered under it, with a key that hashes to it.
        for block_hash, block in pool._cached.items():
            assert pool._keys[block][0] == block_hash
        for block_hash, copies in pool._copies.items():
            assert copies and all(pool._keys[c][0] == block_hash and pool._cached[block_hash] != c for c in copies)
        for block, (block_hash, (parent, tokens, salt)) in pool._keys.items():
            assert len(tokens) == bs
            seed = parent if parent is not None else (salt.encode() if salt else None)
            assert pool.hash_fn(seed, tokens) == block_hash
            assert pool._cached[block_hash] == block or block in pool._copies[block_hash]

    def check_drained(self) -> None:
        """Everything finished: every block free, no table, nothing left in the manager's per-request state."""
        self.check()
        assert all(r.is_finished for r in self.requests.values())
        assert self.pool.num_free_blocks == self.pool.num_blocks and not any(self.pool.ref_counts)
        assert not self.kv.block_tables and not self.kv._block_hashes and not self.kv._num_cached_blocks
        assert not self.scheduler.running and not self.scheduler.waiting and self.scheduler.num_waiting_tokens == 0
