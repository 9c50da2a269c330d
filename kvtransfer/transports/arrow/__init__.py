"""The arrow transport: KV as Arrow record batches over Arrow Flight (``flight``: the sender and the transport's
entry points), the Flight server that lands them (``receiver``), and the schema and metadata both ends agree on,
versioned (``wire``)."""
