"""The HTTP front against hostile or broken clients: malformed JSON that a parser chokes on, bodies over
the limit, requests that are never finished, clients that vanish mid-body, and a result with no audio.
Every case ends with a 4xx naming the field (or a closed connection), never a 500; waits are on events
(a connection closing, a counter), never on a fixed sleep."""

from __future__ import annotations

import json
import logging
import socket

import pytest

from service.http import body_limit
from service.server import ServiceLimits
from tts.checkpoints.load import load_bundle
from tts.engine import EngineConfig
from tts.engine.engine import Engine

pytest.importorskip("fastapi")
from service_helpers import wait_idle  # noqa: E402
from test_http import HTTPServerThread, error_of, held, requests_total, wait_for  # noqa: E402

READ_TIMEOUT = 0.5  # seconds: small, so that the tests of half-sent requests end quickly


@pytest.fixture(scope="module")
def server():
    limits = ServiceLimits(max_waiting=4, max_reference_bytes=64 * 1024, http_read_timeout=READ_TIMEOUT)
    srv = HTTPServerThread(load_bundle("tiny"), EngineConfig(max_batch=4), limits)
    yield srv
    srv.stop()


def post(server, body: bytes) -> tuple[int, dict]:
    status, headers, data = server.request(
        "POST", "/v1/audio/speech", body, {"Content-Type": "application/json"}
    )
    return error_of(status, headers, data)


# ---- bodies a JSON parser chokes on ------------------------------------------------------------------


def test_a_huge_json_integer_is_400_naming_its_field(server):
    digits = "9" * 5000
    status, err = post(server, b'{"input": "Hi.", "seed": %s}' % digits.encode())
    assert (status, err["param"]) == (400, "seed")
    assert err["message"].startswith("seed must be an integer in [-2**63, 2**63), got a 5000-digit")
    status, err = post(server, b'{"input": "Hi.", "top_k": -%s}' % digits.encode())
    assert (status, err["param"]) == (400, "top_k") and "5000-digit" in err["message"]
    status, err = post(server, b'{"input": %s}' % digits.encode())
    assert (status, err["param"]) == (400, "input")


def test_deeply_nested_json_is_400(server):
    depth = 100_000
    status, err = post(server, b'{"input": "Hi.", "voice": ' + b"[" * depth + b"]" * depth + b"}")
    assert status == 400 and "nests too deeply" in err["message"]
    status, err = post(server, b"[" * depth + b"]" * depth)
    assert status == 400 and "nests too deeply" in err["message"]


@pytest.mark.parametrize("field", ["input", "voice", "model", "reference_text"])
def test_a_lone_surrogate_escape_is_400_naming_its_field(server, field):
    body = {"input": "Hi.", field: "x\\ud800y"}
    raw = ("{" + ", ".join(f'"{k}": "{v}"' for k, v in body.items()) + "}").encode()
    status, err = post(server, raw)
    assert (status, err["param"]) == (400, field)
    assert err["message"] == f"{field} holds a lone surrogate (\\ud800) at character 1: not valid Unicode"


def test_a_lone_surrogate_in_a_key_is_400(server):
    status, err = post(server, b'{"input": "Hi.", "\\udc00": 1}')
    assert status == 400 and "lone surrogate" in err["message"]


# ---- bodies over the limit, requests never finished, clients that leave ----------------------------------


def raw_connection(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=60)


def read_response(sock: socket.socket) -> tuple[int, dict]:
    """Read one whole response from `sock` (the server closes or sends Content-Length bytes)."""
    import http.client

    resp = http.client.HTTPResponse(sock)
    resp.begin()
    return error_of(resp.status, resp.headers, resp.read())


def closed_by_server(sock: socket.socket) -> bool:
    """Block until the server closes `sock` (EOF or reset); False if it sent data instead."""
    sock.settimeout(60)  # only a bound against a hang: the server's read timeout is far shorter
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("close", [False, True], ids=["keep-alive", "connection-close"])
@pytest.mark.parametrize("declared", [True, False], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_gets_a_readable_413_naming_the_limit(server, declared, close):
    """The client sends the whole body before reading (as most HTTP clients do): it must still read the
    413, not a reset (a server that closes with unread bytes makes the kernel send one)."""
    limit = body_limit(server.server.limits)
    body = b"x" * (limit + 16 * 1024 * 1024)  # more than the kernel buffers between client and server
    sock = raw_connection(server)
    head = b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\n" + (
        b"Connection: close\r\n" if close else b""
    )
    if declared:
        sock.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    else:
        sock.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
        for i in range(0, len(body), 65536):
            piece = body[i : i + 65536]
            sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
        sock.sendall(b"0\r\n\r\n")
    status, err = read_response(sock)
    sock.close()
    assert status == 413 and err["code"] == "request_too_large"
    from service.server import format_size

    assert f"the limit is {format_size(limit)}" in err["message"]


@pytest.mark.parametrize(
    "sent",
    [
        b"",  # connected, nothing sent
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le",  # headers cut off
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n"
        b'{"input": ',  # body cut
    ],
    ids=["idle", "half-sent-headers", "half-sent-body"],
)
def test_a_connection_that_stops_sending_is_closed_by_the_server(server, sent):
    sock = raw_connection(server)
    if sent:
        sock.sendall(sent)
    assert closed_by_server(sock)
    sock.close()


def test_a_voice_upload_over_the_limit_gets_a_readable_413(server):
    size = server.server.limits.max_reference_bytes + 16 * 1024 * 1024
    sock = raw_connection(server)
    head = (
        b"POST /v1/audio/voices HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Content-Type: multipart/form-data; boundary=b\r\n"
        b"Content-Length: %d\r\n\r\n" % size
    )
    sock.sendall(head + b"x" * size)
    status, err = read_response(sock)
    sock.close()
    assert (status, err["param"], err["code"]) == (413, "file", "request_too_large")


def test_an_idle_kept_alive_connection_is_closed_by_the_server(server):
    sock = raw_connection(server)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    import http.client

    resp = http.client.HTTPResponse(sock)
    resp.begin()
    assert resp.status == 200 and resp.read()
    sock.sendall(b"GET /health HTTP/1.1\r\nHo")  # the next request, never finished
    assert closed_by_server(sock)
    sock.close()


def test_a_client_that_leaves_mid_body_is_cancelled_not_an_error(server, caplog):
    wait_for(lambda: server.loop.in_flight == 0, "an idle server")
    errors, cancelled = requests_total(server, "error"), requests_total(server, "cancelled")
    sock = raw_connection(server)
    with caplog.at_level(logging.INFO):
        sock.sendall(
            b'POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{"input": '
        )
        sock.close()  # gone before the rest of the body
        wait_for(lambda: requests_total(server, "cancelled") == cancelled + 1, "the cancel to be counted")
    assert requests_total(server, "error") == errors
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not [r for r in caplog.records if r.exc_info]
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("outcome=cancelled" in line and "rpc=http" in line for line in lines), lines


# ---- a result without audio ---------------------------------------------------------------------------


@pytest.fixture
def end_at_once(monkeypatch):
    """A scripted engine: every frame step samples the end token, so each text chunk ends with no frames
    (the case the planner calls `short`), whatever the random weights would have said."""
    original = Engine._frame_to_host

    def ending(self, n):
        out = original(self, n).clone()
        cols = self.runner.out_layout
        out[:, cols.token] = self.model.config.eos_token_id
        out[:, cols.done] = 1
        return out

    monkeypatch.setattr(Engine, "_frame_to_host", ending)


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
def test_no_audio_is_not_an_empty_200(server, end_at_once, stream_format):
    before, ok = requests_total(server, "no_audio"), requests_total(server, "ok")
    status, headers, body = server.request(
        "POST",
        "/v1/audio/speech",
        {"input": "Hello there, this text deserves some audio.", "stream_format": stream_format},
    )
    status, err = error_of(status, headers, body)
    assert (status, err["code"], err["param"]) == (422, "no_audio", "input")
    assert err["message"].startswith("the model produced no audio for this text (finish reason short: ")
    assert headers["X-Finish-Reason"] == "short"
    assert "ended after 0 frames" in headers["X-Warnings"]
    assert requests_total(server, "no_audio") == before + 1 and requests_total(server, "ok") == ok


# ---- voice files ------------------------------------------------------------------------------------------


def test_a_malformed_voice_file_is_refused_at_start_and_the_others_serve(tmp_path, caplog):
    """A voices folder with one file of wrong-shaped codes: the server starts, logs the file and why,
    counts it in tts_voice_files_refused_total, lists and serves the good voice, and a request naming the
    bad one gets a 404 saying why (never a 500 from the codec)."""
    import torch
    from safetensors.torch import save_file

    from tts.runtime.voices import VoiceRegistry, codec_fingerprint

    bundle = load_bundle("tiny")
    codec, fp = bundle.codec, codec_fingerprint(bundle.codec)
    directory = tmp_path / "voices"
    good = bundle.voices["alpha"]
    VoiceRegistry({}, directory, fp).add("good", good)
    wrong = torch.zeros(codec.num_codebooks + 1, 8, dtype=torch.int64)
    save_file({"codes": wrong}, str(directory / "bad.safetensors"), metadata={"text": "x", "codec": fp})
    with caplog.at_level(logging.WARNING, logger="tts.runtime.voices"):
        srv = HTTPServerThread(bundle, EngineConfig(max_batch=2), ServiceLimits(voices_dir=str(directory)))
    try:
        lines = [r.getMessage() for r in caplog.records if "bad.safetensors" in r.getMessage()]
        assert len(lines) == 1 and f"its codes are [{codec.num_codebooks + 1}, 8]" in lines[0], lines
        registry = srv.server.metrics.registry
        assert registry.get_sample_value("tts_voice_files_refused_total") == 1
        status, _, body = srv.request("GET", "/v1/audio/voices")
        names = [v["name"] if isinstance(v, dict) else v for v in json.loads(body).get("voices", [])]
        assert status == 200 and "good" in json.dumps(names) and "bad" not in names
        status, err = error_of(*srv.speech(input="Hi.", voice="bad", max_new_frames=4))
        assert (status, err["param"]) == (404, "voice") and "refused" in err["message"]
        assert srv.speech(input="Hi.", voice="good", seed=1, max_new_frames=4, min_new_frames=4)[0] == 200
    finally:
        srv.stop()


def test_a_client_that_leaves_while_queued_is_cancelled_before_any_audio(bundle_server_1row):
    """One row, held by a stream whose client does not read; a second request waits for the row, and its
    client leaves: its job is cancelled (counted `cancelled`), not left to wait for a row and its first
    audio (the status line waits for that)."""
    srv = bundle_server_1row
    conn, resp = srv.open_speech(rcvbuf=4096, response_format="pcm", **held(600))
    assert resp.status == 200
    wait_for(lambda: srv.loop.stats.paused == 1, "the first request to pause")
    cancelled = requests_total(srv, "cancelled")
    sock = raw_connection(srv)
    body = json.dumps({"input": "Wait for a row, then leave."}).encode()
    sock.sendall(
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    wait_for(lambda: srv.loop.in_flight == 2, "the second request to be queued")
    sock.close()
    wait_for(lambda: requests_total(srv, "cancelled") == cancelled + 1, "the queued request to be cancelled")
    wait_for(lambda: srv.loop.in_flight == 1, "the queued job to end")
    conn.close()
    wait_idle(srv.loop)


@pytest.fixture
def bundle_server_1row():
    srv = HTTPServerThread(
        load_bundle("tiny"),
        EngineConfig(max_batch=1),
        ServiceLimits(max_waiting=2, max_queued_chunks=2, pause_timeout=None),
    )
    yield srv
    srv.stop()
