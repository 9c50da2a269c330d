"""What one engine step emits goes to each router as one ``batch`` message; a router unpacks it."""
from control import messages
from control.worker import WorkerLoop


class Recorder:
    def __init__(self):
        self.sent = []

    def send(self, identity, op, **fields):
        self.sent.append((identity, messages.decode(messages.encode(op, **fields))))


def loop_with(replies):
    loop = WorkerLoop("127.0.0.1", 0)
    loop.server.close()
    loop.server = Recorder()
    loop.reply_to.update(replies)
    return loop


def test_a_step_goes_to_each_router_as_one_batch():
    loop = loop_with({"a": b"r1", "b": b"r1", "c": b"r2"})
    with loop.batched():
        loop.emit("a", "tokens", ids=[1], text="x")
        loop.emit("b", "done", ids=[2], text="y", finish_reason="stop")
        loop.emit("c", "tokens", ids=[3], text="z")
        assert loop.server.sent == []
    by_router = dict(loop.server.sent)
    assert by_router[b"r1"]["op"] == "batch"
    assert [(m["op"], m["rid"]) for m in messages.unbatch(by_router[b"r1"])] == [("tokens", "a"), ("done", "b")]
    assert by_router[b"r2"]["op"] == "tokens" and by_router[b"r2"]["rid"] == "c"
    assert "b" not in loop.reply_to and "a" in loop.reply_to


def test_outside_a_step_messages_go_at_once():
    loop = loop_with({"a": b"r1"})
    loop.emit("a", "tokens", ids=[1], text="x")
    assert [m["op"] for _, m in loop.server.sent] == ["tokens"]


def test_unbatch_refuses_nested_and_unnamed_items():
    for items in ([{"op": "batch", "rid": "a"}], [{"op": "tokens"}], ["x"], None):
        try:
            messages.unbatch(messages.decode(messages.encode("batch", msgs=items)))
        except messages.MessageError:
            continue
        raise AssertionError(f"accepted {items!r}")
