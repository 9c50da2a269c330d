"""Structured outputs: grammars that constrain which tokens a sequence may take (``grammars``)."""
