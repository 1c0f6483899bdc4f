from tailrace.engine.block_manager import BlockManager
from tailrace.engine.scheduler import Scheduler
from tailrace.engine.sequence import Sequence, Status
from tailrace.sampling_params import SamplingParams


def make_seq(seq_id: int, prompt_len: int) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(range(1, prompt_len + 1)), SamplingParams(), max_tokens=64)


def run_step(scheduler: Scheduler) -> list[tuple[int, int]]:
    """Schedule one step and pretend the model ran it; sampling seqs gain token 7."""
    out = scheduler.schedule()
    for item in out.scheduled:
        samples = item.samples
        item.seq.num_computed_tokens += item.num_new_tokens
        scheduler.blocks.register_full_blocks(item.seq)
        if samples:
            item.seq.output_token_ids.append(7)
    return [(item.seq.seq_id, item.num_new_tokens) for item in out.scheduled]


def test_prefill_is_chunked_under_the_token_budget():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    scheduler.add(make_seq(0, 25))
    assert run_step(scheduler) == [(0, 10)]
    assert run_step(scheduler) == [(0, 10)]
    assert run_step(scheduler) == [(0, 5)]
    assert run_step(scheduler) == [(0, 1)]


def test_running_decodes_come_before_new_prefills():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    scheduler.add(make_seq(0, 4))
    run_step(scheduler)
    scheduler.add(make_seq(1, 20))
    assert run_step(scheduler) == [(0, 1), (1, 7)]


def test_requests_join_and_leave_every_step():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64)
    first = make_seq(0, 3)
    scheduler.add(first)
    run_step(scheduler)
    scheduler.add(make_seq(1, 3))
    assert run_step(scheduler) == [(0, 1), (1, 3)]
    scheduler.finish(first)
    assert run_step(scheduler) == [(1, 1)]


def test_max_num_seqs_caps_the_batch():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        scheduler.add(make_seq(i, 2))
    assert [s for s, _ in run_step(scheduler)] == [0, 1]
    assert len(scheduler.waiting) == 1


def test_newest_request_is_preempted_when_blocks_run_out():
    bm = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    old, new = make_seq(0, 8), make_seq(1, 7)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)  # both prefilled: 2 blocks each, all 4 used
    run_step(scheduler)  # old needs a third block -> new is preempted
    assert new.status is Status.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    assert old.status is Status.RUNNING
    assert scheduler.num_preemptions == 1
    assert scheduler.waiting[0] is new


def test_preempted_sequence_recomputes_prompt_and_output():
    bm = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    old, new = make_seq(0, 8), make_seq(1, 7)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)
    run_step(scheduler)
    scheduler.finish(old)
    # 7 prompt tokens + the one it had generated; its first full block is still cached.
    assert run_step(scheduler) == [(1, 4)]
    assert new.num_cached_tokens == 4 and new.num_computed_tokens == 8


def test_finish_frees_memory_at_once():
    bm = BlockManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    seq = make_seq(0, 10)
    scheduler.add(seq)
    run_step(scheduler)
    scheduler.finish(seq)
    assert bm.num_free_blocks == 8 and not scheduler.has_work()


def test_sibling_waits_for_the_shared_prompt_then_reuses_it():
    bm = BlockManager(num_blocks=16, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    first, second = make_seq(0, 10), make_seq(1, 10)
    second.waits_for = first
    scheduler.add(first)
    scheduler.add(second)
    assert run_step(scheduler) == [(0, 10)]
    assert run_step(scheduler) == [(0, 1), (1, 2)]
    assert second.num_cached_tokens == 8
