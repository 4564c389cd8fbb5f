"""Block manager and scheduler invariants under random admission, finishing and preemption (no model)."""

import random

import pytest

from harli_train.engine.block_manager import BlockManager
from harli_train.engine.engine_config import EngineConfig, EngineError
from harli_train.engine.sampling_params import SamplingParams
from harli_train.engine.scheduler import Scheduler
from harli_train.engine.sequence import Sequence, SequenceStatus

EOS = 7


def _holders(sched: Scheduler) -> list[Sequence]:
    return list(sched.running) + [s for s in sched.waiting if s.block_table]


@pytest.mark.parametrize("reserve", [0, 6])
@pytest.mark.parametrize("mixed", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scheduler_random_load_keeps_block_invariants(seed, mixed, reserve):
    rng = random.Random(seed)
    cfg = EngineConfig(
        block_size=4,
        num_kv_blocks=24,
        max_num_seqs=6,
        max_num_batched_tokens=20,
        max_model_len=64,
        mixed_prefill=mixed,
        prefill_chunk_tokens=7,
        decode_reserve_tokens=reserve,
    )
    bm = BlockManager(24, 4, cfg.max_num_seqs, cfg.max_blocks_per_seq)
    sched = Scheduler(cfg, bm, {EOS})
    seqs, finished, preemptions, next_id = [], [], 0, 0
    for step in range(600):
        if step < 400 and rng.random() < 0.3:
            n = rng.randint(1, 40)
            params = SamplingParams(max_tokens=rng.randint(1, 64 - n), ignore_eos=rng.random() < 0.5)
            seq = Sequence(next_id, [rng.randrange(100) for _ in range(n)], params, float(step))
            # The engine refuses requests that could never fit alone; this load only makes ones that fit.
            assert bm.blocks_for(n + params.max_tokens - 1) <= bm.num_blocks
            sched.add(seq)
            seqs.append(seq)
            next_id += 1
        preview = sched.peek()
        budget = rng.choice([None, 1, 3, 12]) if mixed else None
        batch = sched.schedule(budget)
        if batch is None:
            assert preview.kind == "idle" and (not sched.has_unfinished() or not sched.running)
            continue
        assert sum(batch.num_tokens) <= cfg.max_num_batched_tokens
        if not batch.preempted:  # peek does not foresee preemptions
            assert batch.kind == preview.kind or (budget is not None and not preview.decode_seqs)
            # Prefill-first: a prefill step leaves the decoding sequences waiting.
            assert batch.num_decode == (0 if preview.kind == "prefill" else preview.decode_seqs)
            if batch.num_decode:
                rows = zip(batch.seqs[: batch.num_decode], batch.num_tokens, strict=False)
                assert preview.decode_kv_tokens == sum(s.num_computed + n for s, n in rows)
            if preview.decode_seqs and mixed:  # the pieces are the preview's, cut at the step's budget
                taken = preview.take(cfg.prefill_chunk_tokens if budget is None else budget)
            else:
                taken = preview.take(None if budget is None else budget) if mixed else preview.pieces
            assert batch.num_tokens[batch.num_decode :] == [p.tokens for p in taken]
        preemptions += len(batch.preempted)
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            assert seq.status is SequenceStatus.RUNNING and 1 <= n <= seq.pending
            # Every token computed this step has a slot in a block the sequence owns.
            assert len(seq.block_table) * bm.block_size >= seq.num_computed + n
        if mixed:  # stall-free: a step with prefill work and nothing decoding is the only prefill step
            assert batch.kind != "prefill" or batch.num_decode == 0
        sampled = [rng.choice([EOS, 1, 2, 3]) if batch.samples(i) else None for i in range(len(batch.seqs))]
        done = sched.postprocess(batch, sampled, float(step))
        finished += done
        if not batch.preempted:
            # The decode step after this one: the sequences decoding now, counting those this step finished.
            decoding = [s for s in sched.running if s.pending == 1] + done
            used = (
                None
                if not mixed
                else (cfg.prefill_chunk_tokens if budget is None and batch.num_decode else budget)
            )
            assert preview.decode_after(used) == (len(decoding), sum(len(s) for s in decoding))
        bm.check(_holders(sched))
        assert len(sched.running) <= cfg.max_num_seqs
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch is not None, "requests left that can never be scheduled"
        sampled = [1 if batch.samples(i) else None for i in range(len(batch.seqs))]
        finished += sched.postprocess(batch, sampled, 0.0)
        bm.check(_holders(sched))
    assert preemptions > 0, "the load should have forced preemptions"
    assert sorted(s.seq_id for s in finished) == [s.seq_id for s in seqs]
    assert bm.num_free == bm.num_blocks and not bm.used_blocks, "blocks leaked"
    assert sorted(bm.free_rows) == list(range(cfg.max_num_seqs)), "table rows leaked"
    for s in finished:
        assert s.finish_reason in ("eos", "length")
        assert s.num_completion_tokens <= s.params.max_tokens
        if s.finish_reason == "eos":
            assert s.token_ids[-1] == EOS and not s.params.ignore_eos


def _run_two(reserve: int) -> tuple[int, list[str], list[Sequence]]:
    """A decoding sequence A (12-token prompt, 20 tokens to draw) and a 24-token prompt B arriving once A
    decodes, in 10 blocks of 4 tokens: (preemptions, the step kinds, the finished sequences)."""
    cfg = EngineConfig(
        block_size=4, num_kv_blocks=10, max_num_seqs=4, max_model_len=64, decode_reserve_tokens=reserve
    )
    bm = BlockManager(10, 4, cfg.max_num_seqs, cfg.max_blocks_per_seq)
    sched = Scheduler(cfg, bm, {EOS})
    a = Sequence(0, list(range(12)), SamplingParams(max_tokens=20, ignore_eos=True), 0.0)
    b = Sequence(1, list(range(24)), SamplingParams(max_tokens=4, ignore_eos=True), 1.0)
    sched.add(a)
    preemptions, kinds, finished = 0, [], []
    for step in range(200):
        if step == 1:
            sched.add(b)
        batch = sched.schedule()
        if batch is None:
            break
        preemptions += len(batch.preempted)
        kinds.append(batch.kind)
        finished += sched.postprocess(
            batch, [1 if batch.samples(i) else None for i in range(len(batch.seqs))], 0.0
        )
        bm.check(_holders(sched))
    return preemptions, kinds, finished


def test_a_decode_reserve_admits_a_prompt_only_when_the_running_sequences_keep_room_to_grow():
    preemptions, _, finished = _run_two(0)
    assert preemptions >= 1  # B took the blocks A then needed: A preempted B and recomputes it later
    preemptions, kinds, finished = _run_two(8)
    assert preemptions == 0  # B waited until A's next 8 tokens (capped at its last) stayed free beside it
    assert [s.seq_id for s in finished] == [0, 1] and all(s.finish_reason == "length" for s in finished)
    assert kinds.index("prefill", 1) > 1  # B's prefill came after some of A's decode steps
    with pytest.raises(EngineError, match="decode_reserve_tokens"):
        EngineConfig(decode_reserve_tokens=-1)


def test_block_manager_random_allocate_free():
    rng = random.Random(5)
    bm = BlockManager(32, 8, max_seqs=8, max_blocks_per_seq=16)
    live: list[Sequence] = []
    for i in range(2000):
        if live and rng.random() < 0.3:
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            grow = live and rng.random() < 0.5
            seq = live[rng.randrange(len(live))] if grow else Sequence(i, [0], SamplingParams(), 0)
            tokens = len(seq.block_table) * 8 + rng.randint(0, 20)
            if bm.blocks_for(tokens) <= 16 and bm.can_allocate(seq, tokens):
                bm.allocate(seq, tokens)
                if seq not in live:
                    live.append(seq)
        bm.check(live)
    for s in live:
        bm.free(s)
    bm.check([])
    assert bm.num_free == 32


def test_block_manager_grow_and_shrink():
    bm = BlockManager(4, 4, max_seqs=2, max_blocks_per_seq=8)
    seq = Sequence(0, [1] * 12, SamplingParams(), 0)
    bm.allocate(seq, 12)
    bm.grow(10)
    assert bm.num_free == 7 and bm.num_blocks == 10
    bm.check([seq])
    assert bm.shrink(6) and bm.num_blocks == 6 and bm.num_free == 3
    assert not bm.shrink(2), "blocks in use cannot be taken away"
    bm.check([seq])
