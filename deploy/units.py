"""Sizes on the command line: ``123``, ``512M``, ``2GiB``, ``1.5g``."""
from __future__ import annotations

import argparse
import re

UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(text: str) -> int:
    """``123``, ``512M``, ``2GiB``, ``1.5g`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text).lower())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 512M or 2GiB")
    return int(float(m.group(1)) * UNITS[m.group(2)])
