"""The engine's parts without a model: the scheduler's admission (FIFO within the prefill budget, a long prompt
chunked alone, a bounded queue, slots reused lowest first) and the output processor's delivery (stop strings cut
across token boundaries, streamed deltas that add up to the non-streamed text, EOS, max_tokens)."""

from __future__ import annotations

import pytest
import torch
from shardstack.model.tokenizer import ByteTokenizer
from shardstack.serve.metrics import EngineMetrics
from shardstack.serve.output import OutputProcessor
from shardstack.serve.request import Output, Sequence
from shardstack.serve.sampling import SamplingParams
from shardstack.serve.scheduler import QueueFull, Scheduler

GREEDY = SamplingParams(temperature=0.0)
BYTES = ByteTokenizer()


def _seq(n: int, max_tokens: int = 4, stop: list[str] | None = None, *, stream: bool = True,
         into: list[Output] | None = None) -> Sequence:
    out = into if into is not None else []
    return Sequence(list(range(n)), max_tokens, GREEDY, stop or [], out.append, stream=stream)


def test_admission_is_first_in_first_out_within_the_padded_prefill_budget() -> None:
    sched = Scheduler(max_batch=4, max_queue=4, max_prefill_tokens=10)
    a, b, c, d = _seq(4), _seq(4), _seq(4), _seq(2)
    for s in (a, b, c, d):
        sched.submit(s)
    step = sched.schedule(0)
    # Two 4-token prompts pad to 8; a third would make 12. d fits but waits its turn behind c.
    assert step is not None and step.admitted == [a, b] and step.chunk is None and step.batch == [a, b]
    assert (a.slot, b.slot) == (0, 1) and sched.counts() == (2, 2)
    step = sched.schedule(0)
    assert step is not None and step.admitted == [c, d] and [s.slot for s in step.batch] == [0, 1, 2, 3]


def test_a_prompt_over_the_budget_is_chunked_alone_and_later_ones_wait_for_room() -> None:
    sched = Scheduler(max_batch=4, max_queue=4, max_prefill_tokens=10)
    long_, short = _seq(25), _seq(3)
    sched.submit(long_)
    sched.submit(short)
    step = sched.schedule(0)
    assert step is not None and step.chunk is long_ and step.admitted == []
    assert sched.chunk(long_) == 10
    long_.pos = 10  # its first chunk is in: the next one takes the whole budget, so the short one waits
    step = sched.schedule(0)
    assert step is not None and step.chunk is long_ and step.admitted == []
    long_.pos = 20  # 5 tokens left: room for 3 more this step
    assert sched.chunk(long_) == 5
    step = sched.schedule(0)
    assert step is not None and step.chunk is long_ and step.admitted == [short]
    long_.pos = 26  # last chunk in and one token decoded: it is no longer chunking
    step = sched.schedule(0)
    assert step is not None and step.chunk is None


def test_the_queue_is_bounded_and_finished_or_cancelled_requests_free_their_slots() -> None:
    depths: list[tuple[int, int]] = []

    class Depth(EngineMetrics):
        def queue_depth(self, running: int, waiting: int) -> None:
            depths.append((running, waiting))

    sched = Scheduler(max_batch=2, max_queue=1, metrics=Depth())
    seqs = [_seq(2) for _ in range(3)]
    for s in seqs:
        sched.submit(s)
    with pytest.raises(QueueFull):
        sched.submit(_seq(2))
    assert depths[-1] == (0, 3)
    step = sched.schedule(0)
    assert step is not None and step.admitted == seqs[:2] and depths[-1] == (2, 1)
    seqs[1].finished = True
    sched.cancel(seqs[0])
    sched.retire()
    assert sched.counts() == (0, 1) and depths[-1] == (0, 1)
    step = sched.schedule(0)
    assert step is not None and step.admitted == [seqs[2]] and seqs[2].slot == 0  # lowest free slot first


def test_an_idle_or_closed_scheduler_schedules_nothing() -> None:
    sched = Scheduler(max_batch=1, max_queue=1)
    assert sched.schedule(0.01) is None and not sched.closed
    cancelled = _seq(2)
    sched.submit(cancelled)
    sched.cancel(cancelled)
    assert sched.schedule(0.01) is None and sched.counts() == (0, 0)  # dropped, never admitted
    sched.submit(_seq(2))
    sched.close()
    assert sched.schedule(0.01) is None and sched.closed
    assert sched.cancel_all() != []


def _run(proc: OutputProcessor, seq: Sequence, tokens: list[int]) -> None:
    """Feed `tokens` through the processor as the sampled ones (greedy over one-hot logits)."""
    proc.open(seq)
    for t in tokens:
        if seq.finished:
            break
        logits = torch.zeros(1, 256)
        logits[0, t] = 1.0
        proc.process([seq], logits)


@pytest.mark.parametrize("stream", [True, False])
def test_a_stop_string_split_across_tokens_is_never_released(stream: bool) -> None:
    proc = OutputProcessor(BYTES, frozenset(), EngineMetrics())
    outputs: list[Output] = []
    seq = _seq(1, max_tokens=32, stop=["STOP"], stream=stream, into=outputs)
    _run(proc, seq, list(b"one ST two STO three STOP four"))
    assert "".join(o.data for o in outputs) == "one ST two STO three "
    assert [o.finish_reason for o in outputs][-1] == "stop" and outputs[-1].completion_tokens == 25
    assert len(outputs) > 1 if stream else len(outputs) == 1


def test_eos_and_max_tokens_finish_a_request() -> None:
    proc = OutputProcessor(BYTES, frozenset({ord("!")}), EngineMetrics())
    outputs: list[Output] = []
    _run(proc, _seq(1, max_tokens=32, into=outputs), list(b"hi! more"))
    assert ("".join(o.data for o in outputs), outputs[-1].finish_reason) == ("hi", "stop")  # not the EOS's text
    outputs.clear()
    _run(proc, _seq(1, max_tokens=3, into=outputs), list(b"abcdef"))
    assert ("".join(o.data for o in outputs), outputs[-1].finish_reason) == ("abc", "length")


def test_a_row_that_cannot_be_sampled_fails_its_request_alone() -> None:
    proc = OutputProcessor(BYTES, frozenset(), EngineMetrics())
    bad, good = [], []
    seqs = [_seq(1, into=bad), _seq(1, into=good)]
    for s in seqs:
        proc.open(s)
    logits = torch.zeros(2, 256)
    logits[0, 0] = float("nan")
    logits[1, ord("x")] = 1.0
    proc.process(seqs, logits)
    assert bad[-1].error is not None and bad[-1].error.startswith("sampling failed") and seqs[0].finished
    assert [o.data for o in good] == ["x"] and not seqs[1].finished
