"""The block manager driven by random admit / grow / compute / preempt / finish / share-prefix sequences, checked
after every step against a simple model: each block's reference count is the number of sequences holding it, the
free and parked lists are exactly the unreferenced blocks, no sequence writes a block another one holds, and a
cached prefix hands out blocks that hold exactly the tokens asked for."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv.block_manager import BlockManager

SIZE = 2
NUM_BLOCKS = 8
MAX_LEN = 16


@dataclass
class Seq:
    tokens: list[int]
    salt: str | None
    reads: bool
    computed: int = 0  # positions written to its blocks; 0 while it holds no cache
    holds: bool = False


@dataclass
class Model:
    manager: BlockManager
    seqs: dict[int, Seq] = field(default_factory=dict)
    content: dict[int, list[int]] = field(default_factory=dict)  # block -> the tokens written into it
    next_id: int = 0
    peeked: int = -1  # the sequence last looked up: admitting it later reuses that lookup if still valid

    def check(self) -> None:
        pool, manager = self.manager.pool, self.manager
        refs = [0] * NUM_BLOCKS
        for seq_id, seq in self.seqs.items():
            assert manager.holds(seq_id) == seq.holds
            blocks = list(manager.blocks(seq_id))
            assert len(set(blocks)) == len(blocks)
            if seq.holds:
                assert seq.computed <= len(blocks) * SIZE and len(blocks) <= -(-MAX_LEN // SIZE)
            for block in blocks:
                refs[block] += 1
        assert pool._refs == refs  # the pool's own state, read: the property under test
        unreferenced = {b for b in range(NUM_BLOCKS) if refs[b] == 0}
        plain, parked = set(pool._free), set(pool._parked)
        assert len(plain) == len(pool._free) and not plain & parked
        assert plain | parked == unreferenced
        assert parked <= set(pool._cached)  # a parked block still holds a cached prefix
        assert not plain & set(pool._cached)
        assert pool.num_free == len(unreferenced) and pool.num_used == NUM_BLOCKS - len(unreferenced)

    def admit(self, seq_id: int, total: int) -> None:
        seq = self.seqs[seq_id]
        manager = self.manager
        fits = manager.can_admit(seq_id, seq.tokens, seq.salt, seq.reads, total)
        fresh = manager.match(seq.tokens, seq.salt, seq.reads)
        free_before = manager.pool.num_free
        match = manager.admit(seq_id, seq.tokens, seq.salt, seq.reads, total)
        assert fits == (match is not None)
        if match is None:
            assert manager.pool.num_free == free_before
            return
        assert match == fresh  # the remembered lookup is the one a fresh lookup finds
        for index, block in enumerate(match.blocks):  # exact: the block holds the tokens asked for
            assert self.content[block] == seq.tokens[index * SIZE : (index + 1) * SIZE]
        assert len(match.blocks) * SIZE < len(seq.tokens) or not match.blocks  # the last token is computed
        seq.computed, seq.holds = len(match.blocks) * SIZE, manager.num_blocks(seq_id) > 0

    def compute(self, seq_id: int) -> None:
        """Write the known tokens the reserved blocks hold, then register the full blocks."""
        seq, manager = self.seqs[seq_id], self.manager
        blocks = list(manager.blocks(seq_id))
        end = min(len(seq.tokens), len(blocks) * SIZE)
        others = {b for other, s in self.seqs.items() if other != seq_id for b in manager.blocks(other)}
        for position in range(seq.computed, end):
            block = blocks[position // SIZE]
            assert block not in others  # never a block another sequence reads
            written = self.content.setdefault(block, [])
            del written[position % SIZE :]
            written.append(seq.tokens[position])
        seq.computed = end
        first = manager.registered(seq_id)
        manager.register(seq_id, seq.tokens[first * SIZE : (end // SIZE) * SIZE], end // SIZE)


def new_tokens(data: st.DataObject, model: Model) -> list[int]:
    """A prompt: often a prefix of another sequence's tokens (shared), then a tail from a small alphabet."""
    prefix: list[int] = []
    if model.seqs and data.draw(st.booleans()):
        source = data.draw(st.sampled_from(sorted(model.seqs)))
        tokens = model.seqs[source].tokens
        prefix = tokens[: data.draw(st.integers(0, len(tokens)))]
    tail = data.draw(st.lists(st.integers(1, 3), min_size=0 if prefix else 1, max_size=6))
    return (prefix + tail)[:MAX_LEN] or [1]


@settings(max_examples=150, deadline=None)
@given(st.data(), st.booleans())
def test_random_admit_grow_preempt_finish_share_keep_refcounts_and_free_lists(
    data: st.DataObject, caching: bool
) -> None:
    model = Model(BlockManager(NUM_BLOCKS, SIZE, caching, MAX_LEN))
    for _ in range(data.draw(st.integers(1, 60))):
        op = data.draw(st.sampled_from(["new", "admit", "grow", "compute", "preempt", "finish", "peek"]))
        held = sorted(s for s, seq in model.seqs.items() if seq.holds)
        waiting = sorted(s for s, seq in model.seqs.items() if not seq.holds)
        if op == "new" or (op == "admit" and not waiting):
            seq_id = model.next_id
            model.next_id += 1
            salt = data.draw(st.sampled_from([None, None, "a"]))
            model.seqs[seq_id] = Seq(new_tokens(data, model), salt, data.draw(st.integers(0, 4)) > 0)
        elif op == "admit":
            peeked = model.peeked in waiting and data.draw(st.booleans())
            seq_id = model.peeked if peeked else data.draw(st.sampled_from(waiting))
            known = len(model.seqs[seq_id].tokens)
            model.admit(seq_id, known + data.draw(st.integers(0, 4)))
        elif op == "peek" and waiting:  # the scheduler asks what a waiting sequence would find
            seq_id = model.peeked = data.draw(st.sampled_from(waiting))
            seq = model.seqs[seq_id]
            assert model.manager.lookup(seq_id, seq.tokens, seq.salt, seq.reads) == model.manager.match(
                seq.tokens, seq.salt, seq.reads
            )
        elif op == "grow" and held:
            seq_id = data.draw(st.sampled_from(held))
            seq = model.seqs[seq_id]
            if len(seq.tokens) < MAX_LEN and seq.computed == len(seq.tokens):  # it sampled a token
                seq.tokens.append(data.draw(st.integers(1, 3)))
            free_before, blocks_before = model.manager.pool.num_free, model.manager.num_blocks(seq_id)
            if model.manager.grow(seq_id, len(seq.tokens) + data.draw(st.integers(0, 3))) is None:
                assert model.manager.pool.num_free == free_before
                assert model.manager.num_blocks(seq_id) == blocks_before
        elif op == "compute" and held:
            model.compute(data.draw(st.sampled_from(held)))
        elif op == "preempt" and held:  # its tokens are kept: it is admitted again under the same id
            seq_id = data.draw(st.sampled_from(held))
            model.manager.free(seq_id)
            model.seqs[seq_id].computed, model.seqs[seq_id].holds = 0, False
        elif op == "finish" and model.seqs:
            seq_id = data.draw(st.sampled_from(sorted(model.seqs)))
            model.manager.free(seq_id)
            del model.seqs[seq_id]
        model.check()
    for seq_id in list(model.seqs):
        model.manager.free(seq_id)
    assert model.manager.pool.num_free == NUM_BLOCKS and model.manager.usage == 0.0


def test_a_remembered_lookup_is_dropped_when_its_blocks_are_evicted() -> None:
    manager = BlockManager(4, SIZE, True, MAX_LEN)
    assert manager.admit(0, (), None, False, 4) is not None
    manager.register(0, [1, 2, 3, 4], 2)
    manager.free(0)  # parked: still findable
    prompt = [1, 2, 3, 4, 9]
    assert len(manager.lookup(7, prompt, None, True).blocks) == 2
    assert manager.can_admit(7, prompt, None, True, 6)
    taken = manager.pool.allocate(4)  # every block: the two never-used ones, then the parked prefix
    assert taken is not None and not manager.can_admit(7, prompt, None, True, 6)
    manager.pool.free(taken)
    match = manager.admit(7, prompt, None, True, 6)
    assert match is not None and match.blocks == ()  # what a fresh lookup finds, not the remembered one
    assert manager.hits == 0 and manager.queries == len(prompt)


def test_can_admit_counts_the_parked_blocks_a_match_takes_out_of_the_free_pool() -> None:
    manager = BlockManager(4, SIZE, True, MAX_LEN)
    assert manager.admit(0, (), None, False, 4) is not None
    manager.register(0, [1, 2, 3, 4], 2)
    manager.free(0)
    assert manager.pool.num_free == 4
    # Two cached blocks plus three new ones: five, though four are free and two of those are the match's.
    assert not manager.can_admit(1, [1, 2, 3, 4, 9], None, True, 10)
    assert manager.admit(1, [1, 2, 3, 4, 9], None, True, 10) is None and manager.pool.num_free == 4
    assert manager.can_admit(1, [1, 2, 3, 4, 9], None, True, 8)
    assert manager.admit(1, [1, 2, 3, 4, 9], None, True, 8) is not None and manager.pool.num_free == 0
