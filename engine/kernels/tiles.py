"""Kernel tiles that step down to fit a GPU with less shared memory than the one their sizes were picked on."""
from __future__ import annotations

from dataclasses import replace


def smaller(tile):
    """The tile to try after ``tile`` (a config with ``stages`` and ``block_k``) did not fit: one pipeline stage
    fewer, then (at two stages) K tiles half as long; None below two stages of 64."""
    if tile.stages <= 2 and tile.block_k <= 64:
        return None
    return replace(tile, stages=tile.stages - 1) if tile.stages > 2 else replace(tile, block_k=tile.block_k // 2)
