"""The decode graph replay timer: device time read only from completed events, a ring that never blocks, and the
mean that /health and bench goodput report beside the step's wall time."""
from engine.cuda_graphs.replay_timer import ReplayTimer
from engine.step_budget import StepLog


class FakeEvent:
    clock = 0.0

    def __init__(self):
        self.at, self.complete = None, False

    def record(self):
        self.at = FakeEvent.clock

    def query(self):
        return self.complete

    def elapsed_time(self, end):
        assert self.complete and end.complete, "elapsed_time on an event that has not completed"
        return end.at - self.at


def replay(timer, ms):
    pair = timer.start()
    FakeEvent.clock += ms
    timer.stop(pair)
    return pair


def test_only_completed_replays_are_read_in_order_and_pairs_come_back():
    timer = ReplayTimer(FakeEvent, ring=3)
    first, second = replay(timer, 5.0), replay(timer, 7.0)
    assert timer.done() == []  # nothing completed: no wait, no reading
    for event in first:
        event.complete = True
    assert timer.done() == [5.0]
    for event in second:
        event.complete = True
    assert timer.done() == [7.0] and len(timer.free) == 3 and not timer.pending


def test_a_full_ring_skips_timing_instead_of_waiting():
    timer = ReplayTimer(FakeEvent, ring=2)
    pairs = [replay(timer, 1.0) for _ in range(3)]
    assert pairs[2] is None and timer.skipped == 1
    timer.stop(None)  # the replay that was not timed
    for pair in pairs[:2]:
        for event in pair:
            event.complete = True
    assert timer.done() == [1.0, 1.0] and timer.start() is not None


def test_the_step_log_sums_replays_and_health_reports_their_mean_beside_the_step():
    from bench.health import busiest, step_delta

    log = StepLog()
    log.add_replays([5.0, 6.0])
    log.add_replays([])
    info = log.info()
    assert info["graph_replays"] == 2 and info["graph_ms"] == 11.0 and info["graph_ms_mean"] == 5.5
    before = {"decode:a": {"decode_steps": 10, "decode_ms": 70.0, "graph_replays": 10, "graph_ms": 50.0}}
    after = {"decode:a": {"decode_steps": 30, "decode_ms": 210.0, "graph_replays": 30, "graph_ms": 152.0}}
    (w,) = step_delta(before, after).values()
    assert w["decode_step_ms"] == 7.0 and w["graph_ms"] == 5.1
    assert "7.0 ms (replay 5.1 ms on the device)" in busiest({"decode:a": w})
    (w,) = step_delta({}, {"decode:a": {"decode_steps": 3, "decode_ms": 9.0}}).values()
    assert "graph_ms" not in w and "replay" not in busiest({"decode:a": w})  # a CPU worker: no graphs timed


class Done(FakeEvent):
    def query(self):
        return True

    def elapsed_time(self, end):
        return 2.5


def engine_with_timed_replays():
    """A tiny engine whose decode steps go through the replay path, with a stand-in for each captured graph (it runs
    the same forward eagerly) and a timer whose replays all took 2.5 ms."""
    from engine import EngineConfig
    from engine.engine import Engine

    engine = Engine(EngineConfig(threads=1, dtype="float32", decode_graphs="eager", warmup=False))
    graphs = engine.runner.graphs
    assert graphs.timer is None  # nothing captured on the CPU: nothing timed

    class EagerGraph:
        def __init__(self, size):
            self.size = size

        def replay(self):
            graphs.outputs[self.size] = graphs._forward(self.size)

    graphs.graphs = {size: EagerGraph(size) for size in graphs.sizes}
    graphs.timer = ReplayTimer(Done, ring=4)
    return engine


def test_bench_engine_reports_the_replay_beside_the_step():
    import random

    from bench.engine import decode_rate

    row = decode_rate(engine_with_timed_replays(), 2, 8, 6, random.Random(0), warmup=2)
    assert row["replay_ms"] == 2.5 and row["step_ms"] > 0


def test_decode_steps_that_replay_a_graph_are_timed_into_the_engine_step_log():
    """Each replay records a pair of events, and the engine's steps read the completed ones into ``step_times``."""
    from engine import SamplingParams
    from engine.sequence import Sequence

    engine = engine_with_timed_replays()
    graphs = engine.runner.graphs
    seq = Sequence.create("r", "hello", SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                          engine.tokenizer, engine.max_len)
    engine.add(seq)
    while engine.has_work:
        engine.step()
    times = engine.step_log.info()
    assert graphs.replays >= 4 and times["graph_replays"] == graphs.replays and times["graph_ms_mean"] == 2.5
