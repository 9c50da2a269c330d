"""Which attention heads a rank of a tensor-parallel group computes and which KV heads its pool holds."""
from __future__ import annotations

from dataclasses import dataclass


def check_tp(num_heads: int, num_kv_heads: int, tp: int) -> None:
    """A clear error, naming the sizes that would work, when ``tp`` cannot split these heads."""
    if tp < 1:
        raise ValueError("tp must be at least 1")
    fits = [n for n in range(1, num_heads + 1) if num_heads % n == 0 and
            (num_kv_heads % n == 0 if n <= num_kv_heads else n % num_kv_heads == 0)]
    if tp not in fits:
        raise ValueError(f"--tp {tp} does not divide this model's {num_heads} attention heads / {num_kv_heads} KV "
                         f"heads; use one of {fits}")


@dataclass(frozen=True)
class HeadShard:
    num_heads: int
    num_kv_heads: int
    tp: int = 1
    rank: int = 0

    def __post_init__(self):
        check_tp(self.num_heads, self.num_kv_heads, self.tp)
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"rank {self.rank} outside a group of {self.tp}")

    @property
    def heads(self) -> int:
        """Query heads on this rank."""
        return self.num_heads // self.tp

    @property
    def kv_heads(self) -> int:
        """KV heads on this rank (1 when heads are replicated)."""
        return max(1, self.num_kv_heads // self.tp)

    @property
    def kv_start(self) -> int:
        """The first of this rank's KV heads in the model's numbering."""
        return kv_start(self.num_kv_heads, self.tp, self.rank)

    @property
    def replicas(self) -> int:
        """Ranks holding each KV head."""
        return max(1, self.tp // self.num_kv_heads)

    @property
    def owns_kv(self) -> bool:
        """Whether this rank is the one that sends its KV heads (the first of their replicas)."""
        return self.rank % self.replicas == 0


def kv_start(num_kv_heads: int, tp: int, rank: int) -> int:
    return rank * num_kv_heads // tp


def kv_range(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """KV heads ``[start, end)`` held by ``rank`` of a group of ``tp``."""
    start = kv_start(num_kv_heads, tp, rank)
    return start, start + max(1, num_kv_heads // tp)


def send_pieces(num_kv_heads: int, src_tp: int, src_rank: int, dst_tp: int) -> list[tuple[int, int, int]]:
    """The KV slices rank ``src_rank`` of a group of ``src_tp`` sends to a group of ``dst_tp``:
    ``(dst_rank, first head, end head)`` each, heads in the model's numbering. Of replicated heads only the first
    replica sends; a head replicated on the receiving side goes to every rank that holds it."""
    if src_rank % max(1, src_tp // num_kv_heads):
        return []
    s0, s1 = kv_range(num_kv_heads, src_tp, src_rank)
    out = []
    for dst in range(dst_tp):
        d0, d1 = kv_range(num_kv_heads, dst_tp, dst)
        lo, hi = max(s0, d0), min(s1, d1)
        if lo < hi:
            out.append((dst, lo, hi))
    return out


def recv_pieces(num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> list[tuple[int, int]]:
    """The ``(first head, end head)`` slices rank ``dst_rank`` of a group of ``dst_tp`` receives from a group of
    ``src_tp`` (together they are its heads), in head order."""
    return [(lo, hi) for src in range(src_tp) for dst, lo, hi in send_pieces(num_kv_heads, src_tp, src, dst_tp)
            if dst == dst_rank]


def piece_id(rid: str, first_head: int, pieces: int) -> str:
    """The transfer id of one slice: the request id when a rank receives its KV in one piece."""
    return rid if pieces == 1 else f"{rid}:h{first_head}"
