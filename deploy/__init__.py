"""Launching pdserve: the ``pdserve`` command and the local cluster (``up``)."""
