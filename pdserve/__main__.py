"""``python -m pdserve``: the ``pdserve`` command (how pdserve starts its own worker processes too)."""
import sys

from .cli import main

sys.exit(main())
