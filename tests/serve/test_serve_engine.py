"""The continuous-batching engine in-process: batched results equal one-at-a-time results, slots are reused,
admission is bounded, cancellation frees a slot, a request that fails takes no neighbour down with it, prefill
computes the head at the last position only, no step prefills more than the budget (long prompts are chunked), and a
loop that hangs has the heartbeat of the step it hung on."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from shardstack.model.artifact import load_model
from shardstack.model.kvcache import KVCache
from shardstack.model.tokenizer import ByteTokenizer
from shardstack.serve.engine import FAILPOINT_HANG, Engine
from shardstack.serve.request import Output, Sequence
from shardstack.serve.runner import ModelRunner
from shardstack.serve.sampling import SamplingParams
from shardstack.serve.scheduler import QueueFull
from shardstack.serve.text import eos_ids, model_tokenizer

from .conftest import EOS_AT, EOS_PROMPT, greedy_ids


@pytest.fixture(scope="module")
def model(model_dir: Path):
    torch.set_num_threads(1)
    return load_model(model_dir, "cpu", torch.float32)[0]


@pytest.fixture
def engine(model) -> Iterator[Engine]:
    eng = Engine(model, tokenizer=BYTES, max_batch=4, max_queue=2, device="cpu", dtype=torch.float32)
    eng.start()
    yield eng
    eng.stop()


@pytest.fixture
def wide_engine(model) -> Iterator[Engine]:
    """Room for a whole test batch at once: 5 requests, 8 slots."""
    eng = Engine(model, tokenizer=BYTES, max_batch=8, max_queue=0, device="cpu", dtype=torch.float32)
    eng.start()
    yield eng
    eng.stop()


BYTES = ByteTokenizer()  # the random GPT's: token = byte


class Collector:
    def __init__(self) -> None:
        self.data = ""
        self.tokens = 0
        self.finish: str | None = None
        self.error: str | None = None
        self.events = 0
        self.done = threading.Event()

    def __call__(self, ev: Output) -> None:
        self.data += ev.data
        self.tokens = ev.completion_tokens
        self.events += 1
        if ev.finish_reason or ev.error:
            self.finish, self.error = ev.finish_reason, ev.error
            self.done.set()


def _wait_idle(engine: Engine, timeout: float = 60.0) -> None:  # a ceiling, for loaded hosts
    deadline = time.monotonic() + timeout  # the loop retires finished requests right after their last step
    while engine.in_flight() and time.monotonic() < deadline:
        time.sleep(0.01)


PROMPTS = [b"The quick brown fox", b"a", b"0123456789" * 5, b"shardstack serves"]
PARAMS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.9, seed=3),
          SamplingParams(temperature=1.2, seed=11), SamplingParams(temperature=0.0)]


def test_batched_generation_matches_one_at_a_time(engine: Engine) -> None:
    alone = [engine.generate(list(p), 24, sp) for p, sp in zip(PROMPTS, PARAMS, strict=True)]
    steps_alone = engine.steps
    # All four at once, and arriving staggered so some join while others are mid-decode.
    collectors = [Collector() for _ in PROMPTS]
    for i, (p, sp, c) in enumerate(zip(PROMPTS, PARAMS, collectors, strict=True)):
        engine.submit(Sequence(list(p), 24, sp, [], c))
        if i == 1:
            time.sleep(0.02)
    for c in collectors:
        assert c.done.wait(30)
    assert [(c.data, c.finish) for c in collectors] == alone
    assert all(c.finish == "length" and c.tokens == 24 for c in collectors)
    assert engine.steps - steps_alone < 4 * 24  # the batch shared steps (~24-30), alone they took 96


STILL = SamplingParams(temperature=0.0)  # the request that checks the engine still serves


def _batch_with(engine: Engine, bad: Sequence, bad_collector: Collector) -> None:
    """Run `bad` in one batch with the four PROMPTS (two streamed, two not): only `bad` fails, the others give
    exactly what they give alone, and the engine goes on serving."""
    alone = [engine.generate(list(p), 24, sp) for p, sp in zip(PROMPTS, PARAMS, strict=True)]
    collectors = [Collector() for _ in PROMPTS]
    seqs = [Sequence(list(p), 24, sp, [], c, stream=i % 2 == 0)
            for i, (p, sp, c) in enumerate(zip(PROMPTS, PARAMS, collectors, strict=True))]
    steps = engine.steps
    with engine.scheduler._cond:  # held while submitting: the loop admits all five in one go, sharing every step
        for seq in [*seqs[:2], bad, *seqs[2:]]:
            engine.submit(seq)
    for c in [*collectors, bad_collector]:
        assert c.done.wait(30)
    assert engine.steps - steps <= 25  # one batch: 24 tokens each in ~24 shared steps
    assert bad_collector.error is not None and bad_collector.finish is None
    assert [(c.data, c.finish, c.error) for c in collectors] == [(d, f, None) for d, f in alone]
    assert collectors[1].events == 1 and collectors[0].events > 1  # non-streamed and streamed neighbours
    _wait_idle(engine)
    assert engine.counts() == (0, 0)  # the failed request's slot was freed
    assert engine.generate(list(b"still serving"), 4, STILL)[1] == "length"


def test_unusable_sampling_parameters_fail_one_request_not_its_batch(wide_engine: Engine) -> None:
    # top_p=1e-300 is positive in float64 and 0 in float32: on main, sampling raised and all 5 requests failed.
    # The HTTP schema refuses it; the engine must contain it anyway (library callers bypass the schema).
    c = Collector()
    _batch_with(wide_engine, Sequence(list(b"poisoned"), 24, SamplingParams(temperature=1.0, top_p=1e-300), [], c), c)
    assert c.error is not None and c.error.startswith("sampling failed") and c.data == ""


def test_an_exception_in_a_requests_callback_fails_it_alone(wide_engine: Engine) -> None:
    c = Collector()

    def emit(ev: Output) -> None:
        if ev.error is None:
            raise RuntimeError("client callback broke")
        c(ev)

    _batch_with(wide_engine, Sequence(list(b"raises"), 24, SamplingParams(temperature=0.0), [], emit), c)
    assert c.error == "engine error: RuntimeError"


def test_a_row_of_nan_logits_fails_its_request_alone(model, engine: Engine) -> None:
    # A real model with one corrupted embedding row: only a prompt holding that byte gets NaN logits. The byte is
    # one no prompt holds and the healthy model does not generate for them (an ASCII byte: it decodes as itself).
    healthy = "".join(engine.generate(list(p), 24, sp)[0] for p, sp in zip(PROMPTS, PARAMS, strict=True))
    healthy += engine.generate(list(b"still serving"), 4, STILL)[0]
    seen = {*b"".join(PROMPTS), *b"bad still serving", *healthy.encode()}
    nan_byte = next(b for b in range(1, 128) if b not in seen)
    broken = copy.deepcopy(model)
    broken.tok_emb.weight = torch.nn.Parameter(broken.tok_emb.weight.detach().clone())  # untie from lm_head
    broken.tok_emb.weight.data[nan_byte] = float("nan")
    eng = Engine(broken, tokenizer=BYTES, max_batch=8, max_queue=0, device="cpu", dtype=torch.float32)
    eng.start()
    try:
        c = Collector()
        _batch_with(eng, Sequence([*b"bad ", nan_byte], 24, SamplingParams(temperature=0.0), [], c), c)
        assert c.error is not None and c.error.startswith("sampling failed")
    finally:
        eng.stop()


def test_more_requests_than_slots_reuse_slots_and_queue_is_bounded(engine: Engine) -> None:
    collectors = [Collector() for _ in range(6)]  # 4 slots + 2 queue places
    for i, c in enumerate(collectors):
        engine.submit(Sequence(list(b"slot %d" % i), 40 + i, SamplingParams(seed=i), [], c))
    with pytest.raises(QueueFull):
        engine.submit(Sequence(list(b"one too many"), 4, SamplingParams(), [], Collector()))
    for i, c in enumerate(collectors):
        assert c.done.wait(30)
        assert (c.finish, c.tokens) == ("length", 40 + i)
    _wait_idle(engine)
    assert engine.counts() == (0, 0)


def test_stop_sequence_ends_generation_early(engine: Engine) -> None:
    full, _ = engine.generate(list(b"stop here"), 32, SamplingParams(temperature=0.0))
    stop = full[10:12]
    cut = full.index(stop)
    data, finish = engine.generate(list(b"stop here"), 32, SamplingParams(temperature=0.0), [stop])
    assert (data, finish) == (full[:cut], "stop")


def test_cancelled_request_frees_its_slot(model) -> None:
    eng = Engine(model, tokenizer=BYTES, max_batch=1, max_queue=0, device="cpu", dtype=torch.float32)
    eng.start()
    try:
        c = Collector()
        seq = Sequence(list(b"long"), 250, SamplingParams(), [], c)
        eng.submit(seq)
        with pytest.raises(QueueFull):
            eng.submit(Sequence(list(b"x"), 4, SamplingParams(), [], Collector()))
        eng.cancel(seq)
        _wait_idle(eng)
        assert eng.in_flight() == 0 and not c.done.is_set()
        assert eng.generate(list(b"x"), 4, SamplingParams())[1] == "length"
    finally:
        eng.stop()


def test_heartbeat_advances_while_idle(engine: Engine) -> None:
    before = engine.heartbeat
    time.sleep(engine.idle_tick * 2.5)
    assert engine.heartbeat > before and engine.heartbeat_age() < engine.idle_tick * 2


def test_a_loop_that_hangs_on_a_step_has_its_heartbeat_from_taking_that_step(model) -> None:
    # The stall check (/health, the watchdog) measures from the last heartbeat: one from before the idle wait that
    # the hanging request ended would make a hang look older than it is.
    eng = Engine(model, tokenizer=BYTES, max_batch=1, max_queue=0, device="cpu", dtype=torch.float32,
                 failpoint=FAILPOINT_HANG)
    eng.start()
    try:
        time.sleep(eng.idle_tick * 1.5)  # idle: waiting inside the scheduler
        submitted = time.monotonic()
        eng.submit(Sequence(list(b"hang"), 4, STILL, [], Collector()))
        deadline = time.monotonic() + 30
        while eng.heartbeat_age() < eng.idle_tick * 3 and time.monotonic() < deadline:  # until it stops beating
            time.sleep(0.01)
        assert eng.heartbeat >= submitted
    finally:
        eng.stop()


def test_half_precision_engine_generates(model_dir: Path) -> None:
    # The GPU default is bf16 weights and KV cache; the same code path runs (slowly) on CPU.
    half = load_model(model_dir, "cpu", torch.bfloat16)[0]
    eng = Engine(half, tokenizer=BYTES, max_batch=2, max_queue=0, device="cpu", dtype=torch.bfloat16)
    assert eng.runner.cache.k.dtype == torch.bfloat16
    eng.start()
    try:
        c = Collector()
        eng.submit(Sequence(list(b"bf16"), 8, SamplingParams(temperature=0.0), [], c))
        assert c.done.wait(30) and (c.tokens, c.finish) == (8, "length")
    finally:
        eng.stop()


@torch.no_grad()
def test_packed_slots_attend_through_a_view_with_the_same_result(model) -> None:
    # Slots 0..B-1 in order take the model's no-gather path; a permuted batch takes the gather path.
    idx = torch.randint(0, 256, (3, 12), generator=torch.Generator().manual_seed(0))
    full = model(idx)
    for slots in ([0, 1, 2], [2, 0, 1]):
        cache = KVCache(model.config, 3, 32, dtype=torch.float32, device="cpu")
        s = torch.tensor(slots)
        logits = model(idx[:, :8], cache=cache, slots=s, positions=torch.zeros(3, dtype=torch.long))
        torch.testing.assert_close(logits, full[:, :8])
        for t in range(8, 12):
            step = model(idx[:, t : t + 1], cache=cache, slots=s, positions=torch.full((3,), t))
            torch.testing.assert_close(step[:, 0], full[:, t])


def test_a_llama_with_bpe_stops_at_its_eos_without_sending_it(bpe_model_dir: Path) -> None:
    model, meta = load_model(bpe_model_dir, "cpu", torch.float32)
    tok = model_tokenizer(bpe_model_dir, meta, model.config.vocab_size)
    prompt = tok.encode_prompt(EOS_PROMPT)
    ids = greedy_ids(bpe_model_dir, prompt, EOS_AT)
    eos = eos_ids(bpe_model_dir, tok)
    assert eos == {0, ids[-1]}  # the tokenizer's <|endoftext|> and generation_config.json's second one
    eng = Engine(model, tokenizer=tok, eos_ids=eos, max_batch=2, max_queue=0, device="cpu", dtype=torch.float32)
    c = model.config  # the KV cache holds n_kv_head heads per layer (grouped-query attention), not n_head
    assert eng.runner.cache.k.shape == (c.n_layer, 2, c.n_kv_head, c.seq_len, c.head_dim) and c.n_kv_head < c.n_head
    eng.start()
    try:
        for stream in (True, False):
            got = Collector()
            eng.submit(Sequence(prompt, 32, SamplingParams(temperature=0.0), [], got, stream=stream))
            assert got.done.wait(30)
            assert (got.data, got.finish, got.tokens) == (tok.decode(ids[:-1]), "stop", EOS_AT)
    finally:
        eng.stop()


@torch.no_grad()
@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_prefill_applies_the_head_to_each_rows_last_position_only(arch: str, request: pytest.FixtureRequest) -> None:
    m = load_model(request.getfixturevalue("model_dir" if arch == "gpt" else "bpe_model_dir"), "cpu",
                   torch.float32)[0]
    runner = ModelRunner(m, slots=3, context=64, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, m.config.vocab_size, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [ids[:17], ids[:5], ids[:1]]  # right-padded to 17: the last real positions are 16, 4 and 0
    heads: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    hook = m.lm_head.register_forward_hook(lambda _m, args, out: heads.append((tuple(args[0].shape), out.shape)))
    try:
        out = runner.prefill(prompts, [0, 1, 2])
    finally:
        hook.remove()
    hidden, vocab = m.config.d_model, m.config.vocab_size
    assert heads == [((3, 1, hidden), (3, 1, vocab))] and out.shape == (3, vocab)  # not [3, 17, V]
    for row, prompt in enumerate(prompts):  # a full forward without a cache: [1, T, V], its last position
        torch.testing.assert_close(out[row], m(torch.tensor([prompt]))[0, -1])
    # The same prompt in chunks, each continuing in its slot where the last ended, ends at the same logits.
    p = prompts[0]
    runner.prefill([p[:6]], [2], [0])
    runner.prefill([p[6:12]], [2], [6])
    torch.testing.assert_close(runner.prefill([p[12:]], [2], [12])[0], out[0])


def test_a_prompt_over_the_prefill_budget_is_chunked_while_others_decode(model, model_dir: Path) -> None:
    # On main the first admitted request was prefilled whole, whatever its length: a 200-token prompt was one
    # 200-token step, however small --max-prefill-tokens. Now no forward pass takes more than the budget.
    budget = 16
    eng = Engine(model, tokenizer=BYTES, max_batch=2, max_queue=0, device="cpu", dtype=torch.float32,
                 max_prefill_tokens=budget)
    widths: list[int] = []  # tokens per row of every forward pass
    hook = model.register_forward_pre_hook(lambda _m, args: widths.append(args[0].size(1)))
    eng.start()
    try:
        short_prompt = list(b"keep decoding")
        alone = eng.generate(short_prompt, 60, STILL)
        short, long_ = Collector(), Collector()
        short_seq = Sequence(short_prompt, 60, STILL, [], short)
        eng.submit(short_seq)
        while short_seq.generated == 0:  # running: decoding from now on
            assert not short.done.is_set()
            time.sleep(0.001)
        long_prompt = list(b"0123456789abcdefghij" * 10)  # 200 tokens: 13 chunks of at most 16
        at_long_first: list[int] = []  # the short request's tokens when the long one sampled its first

        def on_long(ev: Output) -> None:
            if not at_long_first:
                at_long_first.append(short_seq.generated)
            long_(ev)

        before = short_seq.generated
        eng.submit(Sequence(long_prompt, 8, STILL, [], on_long))
        assert short.done.wait(60) and long_.done.wait(60)
    finally:
        eng.stop()
        hook.remove()
    assert max(widths) <= budget, widths
    chunks = -(-len(long_prompt) // budget)
    # One decode step of the running request after each of the long prompt's chunks but its last, at least.
    assert at_long_first[0] - before >= chunks - 1, (before, at_long_first)
    assert (short.data, short.finish) == alone  # its neighbour's chunks left its cache slot alone
    # The chunked prefill generates what plain forward passes over the whole prompt do.
    assert (long_.data, long_.finish) == (BYTES.decode(greedy_ids(model_dir, long_prompt, 8)), "length")
