"""What the tests of moving decoding requests share (``test_migration``, ``test_roles``, ``test_mlx_moves``): the slow
tiny checkpoint, streams through the ``openai`` SDK, draining through ``pdserve drain``, and the router's counts of
moves, read from ``/health`` and ``/metrics``."""
from __future__ import annotations

import threading

import httpx
import openai
import pytest

from pdserve.cli import main as pdserve
from tests.checkpoints import SLOW, write_checkpoint
from tests.test_failures import eventually

TOKENS = 300
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("slow"), SLOW)


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


def decode_workers(url: str) -> list[dict]:
    return health(url)["workers"]["decode"]


class Stream(threading.Thread):
    """One streamed completion through the SDK: its choices' texts and token counts, and the first error."""

    def __init__(self, client: openai.OpenAI, **body):
        super().__init__(daemon=True)
        self.client, self.body = client, dict(body)
        self.texts: dict[int, str] = {}
        self.tokens: dict[int, int] = {}
        self.error: Exception | None = None

    def run(self):
        try:
            extra = {**self.body.pop("extra_body", {}), "return_token_ids": True}  # an event can carry several
            for chunk in self.client.completions.create(stream=True, extra_body=extra, **self.body):
                for choice in chunk.choices:
                    self.texts[choice.index] = self.texts.get(choice.index, "") + choice.text
                    ids = (choice.model_extra or {}).get("token_ids") or []
                    self.tokens[choice.index] = self.tokens.get(choice.index, 0) + len(ids)
        except Exception as e:  # noqa: BLE001 - the test reads it
            self.error = e


def run_streams(url: str, bodies: list[dict], drain=None, decoding=None) -> tuple[list[Stream], object]:
    """The streams at once, and what ``drain(url)`` returned, called once each stream has its first few tokens (or
    once ``decoding()`` says they decode)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    streams = [Stream(client, **b) for b in bodies]
    for s in streams:
        s.start()
    drained = None
    if drain is not None:
        assert eventually(decoding or (lambda: all(sum(s.tokens.values()) >= 4 for s in streams)), 60)
        drained = drain(url)
    for s in streams:
        s.join(180)
    assert [s.error for s in streams] == [None] * len(streams)
    return streams, drained


def drain_busiest(url: str, missed_ok: bool = False) -> str | None:
    """Drain the decode worker with the most requests on it, through ``pdserve drain``; its address (``missed_ok``:
    None where no worker holds a request any more)."""
    busiest = max(decode_workers(url), key=lambda w: w["outstanding"])
    if missed_ok and busiest["outstanding"] == 0:
        return None
    assert busiest["outstanding"] > 0
    assert pdserve(["drain", "--url", url, "--worker", busiest["address"]]) == 0
    return busiest["address"]


def until_moved(url: str, attempt, undo, attempts: int = 4):
    """``attempt()`` (streams with a move asked mid-way) run again until a stream moved, ``undo(result)`` between
    runs: on a busy machine the client can read the first tokens so late that every stream has ended (or, for a short
    answer, ends before its move) when the move is asked, and such a run tests no move. Every run's streams must still
    end (``run_streams`` checks). Returns the moving run's result and how many runs it took."""
    for runs in range(1, attempts + 1):
        before = moved(url)
        got = attempt()
        if moved(url) > before:
            return got, runs
        undo(got)
    pytest.fail(f"in {attempts} runs no stream moved")


def drained_mid_way(url: str, bodies: list[dict], attempts: int = 4) -> tuple[list, str]:
    """``run_streams`` with the busiest decode worker drained (``until_moved``)."""
    def undo(got):
        if got[1] is not None:
            undrain(url, got[1])
    result, _ = until_moved(url, lambda: run_streams(url, bodies, lambda u: drain_busiest(u, missed_ok=True)), undo,
                            attempts)
    return result


def undrain(url: str, address: str) -> None:
    assert pdserve(["drain", "--url", url, "--worker", address, "--undo"]) == 0
    assert eventually(lambda: any(w["address"] == address and w["drain"] == "serving" for w in decode_workers(url)), 10)


def moved(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('pdserve_migrations_total{') and 'outcome="moved"' in line)


def check_drained(url: str, address: str) -> None:
    """The drained worker holds nothing: every block back in its pool, nothing reserved or running."""
    def empty():
        w = next(w for w in decode_workers(url) if w["address"] == address)
        return w["drain"] == "drained" and w["active"] == 0 and w["kv_reserved_bytes"] == 0 and \
            w["kv_blocks_free"] == w["kv_blocks"] and w["migrations_pausing"] == 0
    assert eventually(empty, 30)
