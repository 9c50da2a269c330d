"""Control plane between router and workers: small msgpack messages over zmq."""
