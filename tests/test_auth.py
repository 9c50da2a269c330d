"""Cluster-token authentication (control and data plane), the loopback rule, and the router API key."""
import importlib.util
import os
import socket
import shutil
import subprocess
import sys
import threading

import httpx
import pytest
import torch
import zmq

from control import auth
from control.messages import decode, encode
from kvtransfer import TransferError, TransportConfig, frames, make_receiver, make_sender
from kvtransfer.tensors import layout_of, materialize
from tests.fleet import Fleet
from tests.test_failures import SHORT, complete, eventually

TOKEN = "correct-horse-battery-staple-0123"
OTHER = "an-entirely-different-token-4567"
KV = [(torch.arange(48.0).view(2, 3, 8), -torch.arange(48.0).view(2, 3, 8)) for _ in range(3)]


def test_proofs_bind_the_token_the_role_and_both_nonces():
    t, a, b = TOKEN.encode(), auth.nonce(), auth.nonce()
    p = auth.proof(t, "server", a, b)
    assert auth.verify(t, "server", a, b, p)
    assert not auth.verify(OTHER.encode(), "server", a, b, p)
    assert not auth.verify(t, "client", a, b, p)
    assert not auth.verify(t, "server", b, a, p)
    assert not auth.verify(t, "server", a, b, p[:-1] + bytes([p[-1] ^ 1]))
    assert not auth.verify(t, "server", a, b, "not bytes")


def test_token_sources_and_the_loopback_rule(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    monkeypatch.delenv(auth.TOKEN_FILE_ENV, raising=False)
    assert auth.load_token() is None
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    assert auth.load_token() == TOKEN.encode()
    path = tmp_path / "token"
    path.write_text(OTHER + "\n")
    assert auth.load_token(path=str(path)) == OTHER.encode()
    with pytest.raises(ValueError, match="at least 16"):
        auth.load_token("short")
    auth.require_token_for("127.0.0.1", None, "x")
    auth.require_token_for("::1", None, "x")
    auth.require_token_for("10.0.0.5", b"t" * 16, "x")
    with pytest.raises(ValueError, match="beyond loopback"):
        auth.require_token_for("0.0.0.0", None, "x")


class Recorder:
    """A loopback TCP relay that keeps every byte it forwards."""

    def __init__(self, target):
        self.target, self.seen = target, bytearray()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                a, _ = self.server.accept()
            except OSError:
                return
            b = socket.create_connection(self.target)
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src, dst):
        try:
            while data := src.recv(65536):
                self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()


@pytest.fixture
def guarded():
    receiver = make_receiver("tcp", TransportConfig(timeout_s=2, token=TOKEN.encode()))
    receiver.start()
    yield receiver
    receiver.close()


def test_data_plane_with_the_token_transfers_and_never_shows_it(guarded):
    relay = Recorder(tuple(guarded.address.rsplit(":", 1)[0:1]) + (int(guarded.address.rsplit(":", 1)[1]),))
    sender = make_sender("tcp", TransportConfig(timeout_s=5, token=TOKEN.encode()))
    try:
        sender.send(relay.address, "ok-1", layout_of(KV), KV)
        got = guarded.wait("ok-1", 5)
        assert bytes(got.buffer.numpy()[:8]) == KV[0][0].numpy().tobytes()[:8]
        got.release()
    finally:
        sender.close()
    assert len(relay.seen) > 3 * 2 * 48 * 4
    assert TOKEN.encode() not in bytes(relay.seen)


@pytest.mark.parametrize("token", [OTHER, None])
def test_data_plane_refuses_a_wrong_or_missing_token(guarded, token):
    sender = make_sender("tcp", TransportConfig(timeout_s=3, token=token.encode() if token else None))
    try:
        with pytest.raises(TransferError):
            sender.send(guarded.address, f"bad-{token}", layout_of(KV), KV)
    finally:
        sender.close()
    if token is None:
        assert eventually(lambda: guarded.dropped_connections >= 1, 2)
    good = make_sender("tcp", TransportConfig(timeout_s=5, token=TOKEN.encode()))
    try:
        good.send(guarded.address, "after", layout_of(KV), KV)
        guarded.wait("after", 5).release()
    finally:
        good.close()


def test_receiver_drops_a_forged_proof(guarded):
    host, port = guarded.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(frames.meta_frame(frames.HELLO, {"nonce": auth.nonce()}))
        challenge = frames.read_meta_frame(sock, frames.CHALLENGE)
        forged = auth.proof(OTHER.encode(), "client", challenge["nonce"], b"x" * 16)
        sock.sendall(frames.meta_frame(frames.AUTH, {"proof": forged}))
        assert frames.read_prefix(sock, frames.ACK)[0] == 1
    assert eventually(lambda: guarded.dropped_connections >= 1, 2)


def test_sender_refuses_a_receiver_without_the_token():
    impostor = make_receiver("tcp", TransportConfig(timeout_s=2, token=OTHER.encode()))
    impostor.start()
    sender = make_sender("tcp", TransportConfig(timeout_s=3, token=TOKEN.encode()))
    try:
        with pytest.raises(TransferError, match="handshake"):
            sender.send(impostor.address, "x", layout_of(KV), KV)
    finally:
        sender.close()
        impostor.close()


def test_cluster_with_token_serves_and_refuses_strangers():
    with Fleet(env={auth.TOKEN_ENV: TOKEN}) as f:
        f.pair()
        assert complete(f.url).status_code == 200

        ctx = zmq.Context.instance()
        intruder = ctx.socket(zmq.DEALER)
        intruder.setsockopt(zmq.LINGER, 0)
        intruder.setsockopt(zmq.RCVTIMEO, 3000)
        intruder.connect(f.addrs["p"])
        intruder.send(encode("prefill", rid="x1", prompt="hi", params={}, kv_dest="127.0.0.1:1"))
        assert decode(intruder.recv())["op"] == "auth_required"
        intruder.send(encode("hello", nonce=auth.nonce()))
        challenge = decode(intruder.recv())
        assert challenge["op"] == "challenge"
        intruder.send(encode("auth", proof=auth.proof(OTHER.encode(), "client", challenge["nonce"], b"0" * 16)))
        assert decode(intruder.recv())["op"] == "auth_required"
        intruder.send(encode("ping", t=0))
        assert decode(intruder.recv())["op"] == "auth_required"
        intruder.close()

        env = {**f.env, auth.TOKEN_ENV: OTHER}
        stranger = Fleet(env=env)
        stranger.addrs, stranger.cmds = dict(f.addrs), dict(f.cmds)
        try:
            stranger.router()
            assert eventually(lambda: _health(stranger) is not None, 30)
            assert not eventually(lambda: _health(stranger)["status"] == "ok", 4)
            assert complete(stranger.url).status_code == 503
        finally:
            stranger.procs["router"].kill()
            stranger.procs["router"].wait()
        assert complete(f.url).status_code == 200


def _health(fleet):
    try:
        return httpx.get(fleet.url + "/health", timeout=2).json()
    except httpx.HTTPError:
        return None


def test_binding_beyond_loopback_without_a_token_is_refused():
    env = {k: v for k, v in os.environ.items() if k not in (auth.TOKEN_ENV, auth.TOKEN_FILE_ENV)}
    for role in ("prefill", "decode", "router"):
        extra = ["--prefill", "tcp://127.0.0.1:1", "--decode", "tcp://127.0.0.1:2"] if role == "router" else []
        r = subprocess.run([sys.executable, "-m", "pdserve", role, "--host", "0.0.0.0", *extra], env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "beyond loopback" in r.stderr


def test_router_api_key(tmp_path):
    key = tmp_path / "key"
    key.write_text("sk-test-key-123\n")
    with Fleet() as f:
        f.worker("p", "prefill")
        f.worker("d", "decode")
        f.router("--api-key-file", str(key))
        f.wait_healthy()
        missing = complete(f.url)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
        wrong = httpx.post(f.url + "/v1/completions", json=SHORT, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        right = httpx.post(f.url + "/v1/completions", json=SHORT, headers={"Authorization": "Bearer sk-test-key-123"})
        assert right.status_code == 200
        assert httpx.get(f.url + "/metrics").status_code == 200

        import openai

        client = openai.OpenAI(base_url=f.url + "/v1", api_key="sk-test-key-123")
        assert client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=4).choices[0].text is not None
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f.url + "/v1", api_key="bad").completions.create(model="tiny-llama", prompt="x")


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="pyarrow not installed")
@pytest.mark.parametrize("token", [OTHER, None])
def test_arrow_flight_refuses_a_wrong_or_missing_token_and_keeps_serving(token):
    receiver = make_receiver("arrow", TransportConfig(timeout_s=3, token=TOKEN.encode()))
    receiver.start()
    bad = make_sender("arrow", TransportConfig(timeout_s=3, token=token.encode() if token else None))
    good = make_sender("arrow", TransportConfig(timeout_s=5, token=TOKEN.encode()))
    try:
        with pytest.raises(TransferError, match="token"):
            bad.send(receiver.address, f"bad-{token}", layout_of(KV), KV)
        good.send(receiver.address, "after", layout_of(KV), KV)
        receiver.wait("after", 5).release()
    finally:
        bad.close()
        good.close()
        receiver.close()


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None, reason="pyarrow not installed")
def test_arrow_flight_proof_is_never_the_token_and_cannot_be_replayed():
    import pyarrow.flight as fl

    from kvtransfer.transports.arrow import wire as arrow_wire

    value = arrow_wire.auth_value(TOKEN.encode())
    assert TOKEN not in value
    factory = arrow_wire.AuthFactory(TOKEN.encode())
    assert factory.start_call(None, {arrow_wire.AUTH_HEADER: [value]}) is None
    with pytest.raises(fl.FlightUnauthenticatedError):
        factory.start_call(None, {arrow_wire.AUTH_HEADER: [value]})
    stale = arrow_wire.auth_value(TOKEN.encode())
    with pytest.raises(fl.FlightUnauthenticatedError):
        factory.start_call(None, {arrow_wire.AUTH_HEADER: ["1.0" + stale[stale.index(":"):]]})


@pytest.mark.skipif(importlib.util.find_spec("pyarrow") is None or shutil.which("openssl") is None,
                    reason="needs pyarrow and openssl")
def test_arrow_flight_over_tls(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    receiver = make_receiver("arrow", TransportConfig(timeout_s=5, token=TOKEN.encode(), options={
        "arrow_tls_cert": str(cert), "arrow_tls_key": str(key)}))
    receiver.start()
    sender = make_sender("arrow", TransportConfig(timeout_s=5, token=TOKEN.encode(), options={"arrow_tls_root": str(cert)}))
    plain = make_sender("arrow", TransportConfig(timeout_s=3, token=TOKEN.encode()))
    try:
        sender.send(receiver.address, "tls", layout_of(KV), KV)
        got = receiver.wait("tls", 5)
        assert all(torch.equal(a, b) for pair, back in zip(KV, materialize(got, "cpu")) for a, b in zip(pair, back))
        got.release()
        with pytest.raises(TransferError):
            plain.send(receiver.address, "plain", layout_of(KV), KV)
    finally:
        sender.close()
        plain.close()
        receiver.close()
