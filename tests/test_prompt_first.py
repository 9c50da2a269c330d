"""The decode pick leaves the prompt's worker free (``router.policy.prompt_first``): a disaggregated request's decode
worker is picked first and its prompt may not go to that worker, so with mixed workers (a client in each group) the
decode pick keeps off the twin of the prefill worker with the fewest prompts in flight."""
from router.policy import prompt_first


class worker:  # noqa: N801 - a stand-in for the router's worker client (hashable, as the groups' clients are)
    def __init__(self, address: str, outstanding: int = 0):
        self.address, self.outstanding = address, outstanding


def test_the_decode_pick_keeps_off_the_twin_of_the_least_busy_prefill_worker():
    prefill = [worker("a", 40), worker("b", 2)]
    decode = [worker("a", 1), worker("b", 9)]
    assert prompt_first(prefill, decode) == {decode[1]}  # b takes the prompt: decode on a, however busy b's decoding


def test_no_preference_on_a_tie_with_one_prefill_worker_or_without_twins():
    assert prompt_first([worker("a", 3), worker("b", 3)], [worker("a"), worker("b")]) == set()
    assert prompt_first([worker("a", 3)], [worker("a"), worker("b")]) == set()
    assert prompt_first([worker("p1", 0), worker("p2", 5)], [worker("d1"), worker("d2")]) == set()
