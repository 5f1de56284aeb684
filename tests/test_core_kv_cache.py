"""The block pool and the KV cache manager on their own (no model, no scheduler): a Hypothesis state machine
against a reference model of the pool, and targeted cases of allocation, prefix caching and sliding windows.

vLLM's ``tests/v1/core/test_prefix_caching.py`` is the model: fake requests, asserts on block ids, reference
counts and the free queue.
"""

from __future__ import annotations

import pytest
from core_sim import EOS, CoreSim, expected_block_key
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from backend.block_pool import BlockPool, sha256_block_hash
from backend.kv_cache_manager import NULL_BLOCK, KVCacheManager
from backend.request import Request
from backend.sampling_params import SamplingParams

CONTENTS = [((None, (t,), None), sha256_block_hash(None, (t,))) for t in range(6)]  # one-token blocks


class BlockPoolMachine(RuleBasedStateMachine):
    """Random allocate / free / touch / cache / uncache on a real pool, mirrored by a plain reference: a list
    of free blocks in LRU order, reference counts, and the content registered in each block."""

    @initialize(num_blocks=st.integers(1, 8))
    def start(self, num_blocks):
        self.pool = BlockPool(num_blocks)
        self.free = list(range(num_blocks))  # front: next to allocate (and evict)
        self.refs = [0] * num_blocks
        self.content: dict[int, int] = {}  # block -> index into CONTENTS

    @rule(count=st.integers(0, 8))
    def allocate(self, count):
        if count > len(self.free):
            with pytest.raises(RuntimeError, match="free"):
                self.pool.allocate(count)
            return
        taken, self.free = self.free[:count], self.free[count:]
        assert self.pool.allocate(count) == taken  # the least recently freed first
        for block in taken:
            self.refs[block] = 1
            self.content.pop(block, None)  # reused: its old content is evicted

    @precondition(lambda self: any(self.refs))
    @rule(data=st.data())
    def free_one(self, data):
        block = data.draw(st.sampled_from([b for b, r in enumerate(self.refs) if r]))
        self.pool.free([block])
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free.append(block)

    @rule(data=st.data())
    def double_free_raises(self, data):
        free = [b for b, r in enumerate(self.refs) if r == 0]
        if free:
            with pytest.raises(RuntimeError, match="freed twice"):
                self.pool.free([data.draw(st.sampled_from(free))])

    @precondition(lambda self: self.content)
    @rule(data=st.data())
    def prefix_hit(self, data):
        which = data.draw(st.sampled_from(sorted(set(self.content.values()))))
        key, block_hash = CONTENTS[which]
        block = self.pool.lookup(block_hash, key)
        assert block is not None and self.content[block] == which
        self.pool.touch([block])
        if self.refs[block] == 0:
            self.free.remove(block)
        self.refs[block] += 1

    @precondition(lambda self: any(self.refs))
    @rule(data=st.data(), which=st.integers(0, len(CONTENTS) - 1))
    def register(self, data, which):
        block = data.draw(st.sampled_from([b for b, r in enumerate(self.refs) if r]))
        key, block_hash = CONTENTS[which]
        self.pool.cache(block, block_hash, key)
        self.content.setdefault(block, which)  # a block keeps the first content registered in it

    @precondition(lambda self: self.content)
    @rule(data=st.data())
    def uncache(self, data):
        block = data.draw(st.sampled_from(sorted(self.content)))
        self.pool.uncache([block])
        del self.content[block]

    @invariant()
    def matches_reference(self):
        if not hasattr(self, "pool"):
            return
        assert self.pool.ref_counts == self.refs
        assert list(self.pool._free) == self.free
        assert self.pool.num_free_blocks + sum(1 for r in self.refs if r) == self.pool.num_blocks
        for which, (key, block_hash) in enumerate(CONTENTS):
            block = self.pool.lookup(block_hash, key)
            holders = {b for b, c in self.content.items() if c == which}
            assert (block in holders) if holders else block is None
        assert self.pool.cached_hashes() == {CONTENTS[c][1] for c in self.content.values()}


TestBlockPoolMachine = BlockPoolMachine.TestCase
TestBlockPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# -- block pool -------------------------------------------------------------------------------------------------
def test_pool_refuses_an_empty_pool():
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        BlockPool(0)


def test_freed_block_stays_findable_until_it_is_reused():
    pool = BlockPool(2)
    (key, block_hash) = CONTENTS[0]
    block, = pool.allocate(1)
    pool.cache(block, block_hash, key)
    pool.free([block])
    assert pool.lookup(block_hash, key) == block and pool.num_free_blocks == 2
    pool.allocate(1)  # the never-used block goes first
    assert pool.lookup(block_hash, key) == block
    pool.allocate(1)  # now the cached one is reused: evicted
    assert pool.lookup(block_hash, key) is None and pool.num_evictions == 1


def test_colliding_hash_never_returns_another_prompts_block():
    pool = BlockPool(4, hash_fn=lambda parent, tokens: b"same")
    first, second = pool.allocate(2)
    pool.cache(first, b"same", (None, (1, 2), None))
    pool.cache(second, b"same", (None, (3, 4), None))
    assert pool.lookup(b"same", (None, (1, 2), None)) == first
    assert pool.lookup(b"same", (None, (3, 4), None)) is None  # same hash, other tokens: a miss, never `first`
    pool.uncache([first])
    assert pool.lookup(b"same", (None, (1, 2), None)) is None


def test_two_blocks_of_one_content_keep_it_findable_after_the_first_is_evicted():
    pool = BlockPool(3)
    key, block_hash = CONTENTS[1]
    a, b = pool.allocate(2)
    pool.cache(a, block_hash, key)
    pool.cache(b, block_hash, key)  # two requests generated the same tokens
    pool.free([a, b])
    pool.allocate(2)  # the unused block, then `a`: evicted
    assert pool.lookup(block_hash, key) == b


# -- KV cache manager -------------------------------------------------------------------------------------------
def make_request(request_id: str, prompt: list[int], cache_salt: str | None = None, prompt_logprobs=None) -> Request:
    params = SamplingParams(max_tokens=4, prompt_logprobs=prompt_logprobs)
    return Request(request_id, prompt, params, (EOS,), 4, cache_salt=cache_salt)


def computed(manager: KVCacheManager, request: Request) -> list[int]:
    """Admits ``request`` as the scheduler does: hits first, then the rest of its prompt in one chunk."""
    hits = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - len(hits) * manager.block_size, hits)
    request.num_computed_tokens = request.num_tokens
    return hits


def test_prefix_hit_skips_full_blocks_but_not_the_last_token():
    manager = KVCacheManager(32, 4)
    first = make_request("a", list(range(1, 13)))  # exactly 3 full blocks
    computed(manager, first)
    same = make_request("b", list(range(1, 13)))
    hits = manager.get_computed_blocks(same)
    assert hits == manager.get_block_ids("a")[:2]  # the 3rd block holds the last token: its logits are needed
    longer = make_request("c", list(range(1, 14)))
    assert manager.get_computed_blocks(longer) == manager.get_block_ids("a")
    for i, block in enumerate(manager.get_block_ids("a")):
        assert manager.pool._keys[block] == expected_block_key(first, i, 4)


def test_hits_stop_at_the_first_block_that_differs():
    manager = KVCacheManager(32, 4)
    computed(manager, make_request("a", list(range(1, 17))))
    other = make_request("b", [1, 2, 3, 4, 5, 6, 7, 99, 9, 10, 11, 12, 13])  # block 1 differs, block 2 equal
    assert manager.get_computed_blocks(other) == manager.get_block_ids("a")[:1]


def test_cache_salt_separates_identical_prompts_and_works_with_caching_off():
    for caching in (True, False):
        manager = KVCacheManager(32, 4, enable_prefix_caching=caching)
        prompt = list(range(1, 11))
        computed(manager, make_request("a", prompt, cache_salt="tenant-1"))
        assert manager.get_computed_blocks(make_request("b", prompt, cache_salt="tenant-2")) == []
        assert manager.get_computed_blocks(make_request("c", prompt)) == []
        assert manager.get_computed_blocks(make_request("d", prompt, cache_salt="tenant-1")) == \
            manager.get_block_ids("a")[:2]


def test_caching_off_never_hits_and_counts_no_queries():
    manager = KVCacheManager(32, 4, enable_prefix_caching=False)
    computed(manager, make_request("a", list(range(1, 11))))
    assert manager.get_computed_blocks(make_request("b", list(range(1, 11)))) == []
    assert manager.usage().prefix_cache_queries == 0


def test_a_hit_on_a_freed_block_takes_it_off_the_free_queue():
    manager = KVCacheManager(8, 4)
    first = make_request("a", list(range(1, 10)))
    computed(manager, first)
    blocks = manager.get_block_ids("a")
    manager.free(first)
    assert manager.pool.num_free_blocks == 8
    again = make_request("b", list(range(1, 10)))
    assert computed(manager, again) == blocks[:2]
    assert manager.get_block_ids("b")[:2] == blocks[:2]
    assert [manager.pool.ref_counts[b] for b in blocks[:2]] == [1, 1] and manager.pool.num_free_blocks == 5


def test_allocation_that_does_not_fit_changes_nothing():
    manager = KVCacheManager(3, 4)
    request = make_request("a", list(range(1, 14)))  # 13 tokens: 4 blocks
    assert not manager.allocate_slots(request, 13)
    assert manager.get_block_ids("a") == [] and manager.pool.num_free_blocks == 3 and not manager.pool._keys


def test_freeing_returns_the_last_block_first_so_the_prompt_head_is_evicted_last():
    manager = KVCacheManager(3, 4)
    request = make_request("a", list(range(1, 13)))
    computed(manager, request)
    blocks = manager.get_block_ids("a")
    manager.free(request)
    assert list(manager.pool._free) == blocks[::-1]


def test_blocks_of_a_chunk_that_never_ran_leave_the_cache_when_the_request_is_freed():
    manager = KVCacheManager(8, 4)
    request = make_request("a", list(range(1, 14)))
    assert manager.allocate_slots(request, 4)
    request.num_computed_tokens = 4  # the first chunk ran
    assert manager.allocate_slots(request, 8)  # the second is allocated (blocks 1 and 2 registered) ...
    second_chunk = manager.get_block_ids("a")[1:]
    assert all(b in manager.pool._keys for b in second_chunk)
    manager.free(request)  # ... and the request preempted before it ran
    assert [b for b in second_chunk if b in manager.pool._keys] == []
    assert manager.get_computed_blocks(make_request("b", list(range(1, 14)))) == [manager.pool._cached[
        expected_block_key(request, 0, 4)[0]]]


def test_sliding_window_frees_blocks_behind_the_window():
    manager = KVCacheManager(16, 4, sliding_window=5)
    request = make_request("a", list(range(1, 21)))
    for _ in range(5):  # 4 tokens a step
        assert manager.allocate_slots(request, 4)
        request.num_computed_tokens += 4
    table = manager.get_block_ids("a")
    # Blocks go before each allocation: the last one's first query (position 16) sees 12..16, so blocks 0..2
    # (positions 0..11) are free and their entries null.
    assert table[:3] == [NULL_BLOCK] * 3 and NULL_BLOCK not in table[3:] and len(table) == 5
    assert manager.pool.num_free_blocks == 14
    assert manager.max_blocks_per_request(1000, 4) == 3
    manager.free(request)
    assert manager.pool.num_free_blocks == 16


def test_sliding_window_prefix_hits_behind_the_window_are_left_free():
    manager = KVCacheManager(16, 2, sliding_window=3)
    first = make_request("a", list(range(1, 11)))
    assert manager.allocate_slots(first, 10)  # one chunk: registers 5 full blocks
    first.num_computed_tokens = 10
    manager.free(first)
    again = make_request("b", list(range(1, 12)))
    hits = manager.get_computed_blocks(again)
    assert len(hits) == 5
    assert manager.allocate_slots(again, 1, hits)
    table = manager.get_block_ids("b")
    # The query at position 10 sees 8..10: hits 0..3 (positions 0..7) stay free, entries null.
    assert table[:4] == [NULL_BLOCK] * 4 and table[4] == hits[4] and len(table) == 6
    assert manager.pool.ref_counts[hits[4]] == 1 and all(manager.pool.ref_counts[b] == 0 for b in hits[:4])


def test_a_whole_run_under_a_tiny_pool_ends_with_every_block_free():
    sim = CoreSim(num_blocks=6, block_size=2, max_num_batched_tokens=4, max_num_seqs=3)
    for k in range(5):
        sim.add_prompt(f"r{k}", [5, 6, 7, 8, k + 1], max_tokens=6)
    sim.run()
    assert sim.scheduler.num_preemptions > 0 and sim.kv.usage().used_blocks == 0


def test_kv_pool_is_sized_from_available_memory_capped_by_the_containers_limit(tmp_path):
    from backend.host_memory import available_bytes

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       25000000 kB\nMemFree:        11000000 kB\nMemAvailable:   16000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert available_bytes(str(meminfo), str(cgroup)) == 16000000 * 1024  # no cgroup files: the host's
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("1000\n")
    assert available_bytes(str(meminfo), str(cgroup)) == 16000000 * 1024  # no limit
    (cgroup / "memory.max").write_text(f"{8 << 30}\n")
    (cgroup / "memory.current").write_text(f"{3 << 30}\n")
    assert available_bytes(str(meminfo), str(cgroup)) == 5 << 30  # the pod's limit less its usage
    (cgroup / "memory.current").write_text(f"{9 << 30}\n")
    assert available_bytes(str(meminfo), str(cgroup)) == 0
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{1 << 30}\n")
    assert available_bytes(str(meminfo), str(v1)) == 16000000 * 1024
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{4 << 30}\n")
    assert available_bytes(str(meminfo), str(v1)) == 3 << 30
