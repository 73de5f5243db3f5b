"""Who may use the server (service/access.py): API keys on gRPC (an interceptor) and HTTP (middleware),
the open paths, TLS on both fronts, and the HTTP front's browser rules (form-type POSTs, foreign
Origins, CORS, the Host header). A real TTSServer (tiny model) on 127.0.0.1, real clients."""

from __future__ import annotations

import http.client
import json
import shutil
import ssl
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.access import Access, parse_keys
from service.client import build_request, channel_options
from service.grpc_gen.v1 import tts_pb2 as pb
from service.grpc_gen.v1 import tts_pb2_grpc as pb_grpc
from service.server import ServiceLimits
from tts.checkpoints.load import load_bundle

pytest.importorskip("fastapi")
from fastapi import WebSocket  # noqa: E402  (module level: the route's annotation must resolve)
from service_helpers import ServerThread  # noqa: E402
from test_http import multipart, tone_wav  # noqa: E402

KEY = "s3cret-key-1"
OTHER_KEY = "another-key-2"


@pytest.fixture(scope="module")
def bundle():
    return load_bundle("tiny")


def start(bundle, **access) -> ServerThread:
    limits = ServiceLimits(max_waiting=4, max_reference_bytes=256 * 1024, voices_dir=None)
    return ServerThread(bundle, limits=limits, http_port=0, access=Access(**access))


@pytest.fixture(scope="module")
def keyed(bundle):
    srv = start(bundle, api_keys=(KEY, OTHER_KEY))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def open_server(bundle):
    srv = start(bundle, cors_origins=("https://app.example",))
    yield srv
    srv.stop()


def request(srv, method, path, body=None, headers=None, *, context=None):
    """(status, headers, body) of one HTTP request to srv's HTTP front; a dict body is sent as JSON."""
    if context is None:
        conn = http.client.HTTPConnection("127.0.0.1", srv.server.http_port, timeout=60)
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", srv.server.http_port, timeout=60, context=context)
    headers = dict(headers or {})
    if isinstance(body, dict):
        body = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read()
    finally:
        conn.close()


SPEECH = {"input": "Hello.", "seed": 1, "max_new_frames": 3, "response_format": "pcm"}


def bearer(key):
    return {"Authorization": f"Bearer {key}"}


# ---- keys: HTTP ----------------------------------------------------------------------------------------


def test_http_without_or_with_a_wrong_key_is_401_and_with_either_key_works(keyed):
    for headers in ({}, bearer("wrong"), {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}):
        status, head, body = request(keyed, "POST", "/v1/audio/speech", SPEECH, headers)
        assert status == 401, (headers, body)
        err = json.loads(body)["error"]
        assert "\n" not in err["message"] and "API key" in err["message"]
        assert head["WWW-Authenticate"].startswith("Bearer")
    for path in ("/v1/audio/voices", "/v1/models", "/v1/models/tiny", "/no/such/route/yet"):
        assert request(keyed, "GET", path)[0] == 401, path
    assert request(keyed, "DELETE", "/v1/audio/voices/alpha")[0] == 401
    for key in (KEY, OTHER_KEY):
        status, _, audio = request(keyed, "POST", "/v1/audio/speech", SPEECH, bearer(key))
        assert status == 200 and len(audio) > 0
    assert request(keyed, "GET", "/v1/models", headers=bearer(KEY))[0] == 200


def test_health_playground_docs_and_metrics_stay_open(keyed):
    for path in ("/health", "/metrics", "/load", "/", "/openapi.json"):
        assert request(keyed, "GET", path)[0] == 200, path


def test_metrics_auth_puts_metrics_and_load_behind_the_key(bundle):
    srv = start(bundle, api_keys=(KEY,), metrics_auth=True)
    try:
        assert request(srv, "GET", "/metrics")[0] == 401
        assert request(srv, "GET", "/load")[0] == 401
        assert request(srv, "GET", "/metrics", headers=bearer(KEY))[0] == 200
        assert request(srv, "GET", "/health")[0] == 200
    finally:
        srv.stop()


# ---- keys: gRPC ----------------------------------------------------------------------------------------


def test_grpc_calls_need_the_key_health_and_reflection_do_not(keyed):
    with grpc.insecure_channel(keyed.address, options=channel_options()) as channel:
        stub = pb_grpc.TextToSpeechStub(channel)
        for metadata in (None, (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as info:
                stub.GetInfo(pb.GetInfoRequest(), metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "API key" in info.value.details()
            with pytest.raises(grpc.RpcError) as info:  # a server-streaming method too
                list(stub.Synthesize(pb.SynthesizeRequest(text="Hello."), metadata=metadata))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.GetInfo(pb.GetInfoRequest(), metadata=(("authorization", f"Bearer {KEY}"),)).model
        # (3 frames at least: the end token drawn at once would give no audio: FAILED_PRECONDITION)
        request = build_request("Hello.", seed=1, min_new_frames=3, max_new_frames=3)
        chunks = list(stub.Synthesize(request, metadata=(("authorization", f"Bearer {OTHER_KEY}"),)))
        assert chunks[-1].end.frames > 0
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_parse_keys_merges_options_environment_and_files(tmp_path):
    keyfile = tmp_path / "keys"
    keyfile.write_text("# ops keys\nfile-key-1\n\nfile-key-2\nflag-key\n", encoding="utf-8")
    keys = parse_keys(["flag-key"], env="env-a, env-b,", files=[str(keyfile)])
    assert keys == ("flag-key", "env-a", "env-b", "file-key-1", "file-key-2")
    with pytest.raises(ValueError, match="without spaces"):
        parse_keys(["has space"])
    with pytest.raises(ValueError, match="--api-key-file"):
        parse_keys([], files=[str(tmp_path / "missing")])
    access = Access(api_keys=keys)
    assert access.key_ok("Bearer env-b") and access.key_ok("bearer  file-key-2")
    assert not access.key_ok("Bearer env") and not access.key_ok(None) and not access.key_ok("env-a")
    assert Access().key_ok(None)  # no keys: open


# ---- TLS -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def test_tls_on_both_fronts(bundle, certificate):
    cert, key = certificate
    srv = start(bundle, api_keys=(KEY,), tls_cert=str(cert), tls_key=str(key))
    try:
        context = ssl.create_default_context(cafile=str(cert))
        status, _, audio = request(srv, "POST", "/v1/audio/speech", SPEECH, bearer(KEY), context=context)
        assert status == 200 and audio
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.HTTPException)):
            request(srv, "GET", "/health")  # plain HTTP to a TLS port
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(srv.address, credentials, options=channel_options()) as channel:
            info = pb_grpc.TextToSpeechStub(channel).GetInfo(
                pb.GetInfoRequest(), metadata=(("authorization", f"Bearer {KEY}"),), timeout=30
            )
            assert info.model
    finally:
        srv.stop()


# ---- browser rules ---------------------------------------------------------------------------------------


def test_a_text_plain_or_form_post_to_speech_is_refused(open_server):
    """A page on any site can POST text/plain or a form without a preflight: the speech route wants JSON."""
    body = json.dumps(SPEECH).encode()
    for content_type in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded"):
        status, _, reply = request(
            open_server, "POST", "/v1/audio/speech", body, {"Content-Type": content_type}
        )
        assert status == 415, (content_type, reply)
        assert "application/json" in json.loads(reply)["error"]["message"]
    assert request(open_server, "POST", "/v1/audio/speech", SPEECH)[0] == 200


def test_a_foreign_origin_cannot_change_state_and_the_own_origin_can(open_server):
    port = open_server.server.http_port
    body, headers = multipart({"name": "from-page", "text": "A tone."}, tone_wav())
    for origin in ("http://evil.example", "null", f"http://127.0.0.1:{port + 1}"):
        status, _, reply = request(
            open_server, "POST", "/v1/audio/voices", body, {**headers, "Origin": origin}
        )
        assert status == 403, (origin, reply)
        assert "--cors-origin" in json.loads(reply)["error"]["message"]
        assert request(open_server, "DELETE", "/v1/audio/voices/x", headers={"Origin": origin})[0] == 403
        status, _, _ = request(open_server, "POST", "/v1/audio/speech", SPEECH, {"Origin": origin})
        assert status == 403
    names = [v["name"] for v in json.loads(request(open_server, "GET", "/v1/audio/voices")[2])["voices"]]
    assert "from-page" not in names
    own = {**headers, "Origin": f"http://127.0.0.1:{port}"}
    status, _, reply = request(open_server, "POST", "/v1/audio/voices", body, own)
    assert status == 201, reply
    listed = {**headers, "Origin": "https://app.example"}  # --cors-origin
    assert (
        request(open_server, "POST", "/v1/audio/voices", body.replace(b"from-page", b"from-app"), listed)[0]
        == 201
    )
    for name in ("from-page", "from-app"):
        assert request(open_server, "DELETE", f"/v1/audio/voices/{name}")[0] == 200
    # reading is not state-changing: a GET with any Origin is answered (CORS decides what a page sees)
    assert (
        request(open_server, "GET", "/v1/audio/voices", headers={"Origin": "http://evil.example"})[0] == 200
    )


def test_cors_is_off_unless_configured(bundle, open_server):
    preflight = {
        "Origin": "https://app.example",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    status, head, _ = request(open_server, "OPTIONS", "/v1/audio/speech", headers=preflight)
    assert status == 200 and head["Access-Control-Allow-Origin"] == "https://app.example"
    assert "authorization" in head["Access-Control-Allow-Headers"].lower()
    _, head, _ = request(open_server, "GET", "/v1/models", headers={"Origin": "https://app.example"})
    assert head["Access-Control-Allow-Origin"] == "https://app.example"
    _, head, _ = request(open_server, "GET", "/v1/models", headers={"Origin": "http://evil.example"})
    assert "Access-Control-Allow-Origin" not in head
    srv = start(bundle)
    try:
        status, head, _ = request(srv, "OPTIONS", "/v1/audio/speech", headers=preflight)
        assert "Access-Control-Allow-Origin" not in head
        _, head, _ = request(srv, "GET", "/v1/models", headers={"Origin": "https://app.example"})
        assert "Access-Control-Allow-Origin" not in head
    finally:
        srv.stop()


def test_a_loopback_server_answers_only_its_own_host_names(open_server):
    """DNS rebinding: a page of evil.example whose name now resolves to 127.0.0.1 sends Host: evil.example."""
    port = open_server.server.http_port
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
        status, _, reply = request(open_server, "GET", "/v1/audio/voices", headers={"Host": host})
        assert status == 421, (host, reply)
        assert "--allowed-host" in json.loads(reply)["error"]["message"]
        status, _, _ = request(open_server, "POST", "/v1/audio/speech", SPEECH, {"Host": host})
        assert status == 421
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}"):
        assert request(open_server, "GET", "/v1/audio/voices", headers={"Host": host})[0] == 200, host


def test_allowed_hosts_extend_the_loopback_names(bundle):
    srv = start(bundle, allowed_hosts=("tts.internal",))
    try:
        assert request(srv, "GET", "/v1/models", headers={"Host": "tts.internal:8000"})[0] == 200
        assert request(srv, "GET", "/v1/models", headers={"Host": "evil.example"})[0] == 421
    finally:
        srv.stop()


# ---- tts serve's options -------------------------------------------------------------------------------


def serve_args(*argv):
    from tts.cli.main import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_serve_options_make_the_access_and_warn_when_open_beyond_loopback(tmp_path, monkeypatch):
    from tts.cli.serve import serve_access, unauthenticated_warning

    monkeypatch.delenv("TTS_API_KEYS", raising=False)
    keys = tmp_path / "keys"
    keys.write_text("from-file\n", encoding="utf-8")
    monkeypatch.setenv("TTS_API_KEYS", "from-env")
    args = serve_args(
        "--api-key", "k1", "--api-key", "k2", "--api-key-file", str(keys), "--metrics-auth",
        "--cors-origin", "https://a.example,https://b.example", "--allowed-host", "tts.lan",
    )  # fmt: skip
    access = serve_access(args)
    assert access.api_keys == ("k1", "k2", "from-env", "from-file")
    assert access.metrics_auth and access.cors_origins == ("https://a.example", "https://b.example")
    assert access.allowed_hosts == ("tts.lan",) and not access.tls
    assert unauthenticated_warning("0.0.0.0", access) is None
    monkeypatch.delenv("TTS_API_KEYS")
    open_access = serve_access(serve_args())
    assert unauthenticated_warning("127.0.0.1", open_access) is None
    assert unauthenticated_warning("::1", open_access) is None
    warning = unauthenticated_warning("0.0.0.0", open_access)
    assert warning is not None and "no API key" in warning and "--api-key" in warning


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tls-cert", "/etc/hostname"], "--tls-cert and --tls-key go together"),
        (["--tls-cert", "/no/cert.pem", "--tls-key", "/no/key.pem"], "--tls-cert /no/cert.pem"),
        (["--cors-origin", "app.example"], "--cors-origin must be an origin"),
        (["--api-key", "two words"], "without spaces"),
        (["--api-key-file", "/no/such/keys"], "--api-key-file /no/such/keys"),
    ],
)
def test_bad_access_options_are_one_line_exit_2(argv, message, capsys, monkeypatch):
    from tts.cli.main import main

    monkeypatch.delenv("TTS_API_KEYS", raising=False)
    assert main(["serve", "--model", "tiny", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tts: error: ") and message in err and "\n" not in err


# ---- routes added later ----------------------------------------------------------------------------------


def test_routes_and_websockets_added_later_are_covered_without_code_of_their_own():
    """AccessMiddleware wraps the whole app: a route or WebSocket another module adds later needs the key
    and is refused from a foreign origin with no check of its own."""
    from fastapi import FastAPI
    from starlette.testclient import TestClient
    from starlette.websockets import WebSocketDisconnect

    from service.access import AccessMiddleware

    app = FastAPI()

    @app.post("/v1/tts")  # (as a Fish-API module might add)
    async def fish(request_body: dict):
        return {"ok": True}

    @app.websocket("/v1/live")
    async def live(ws: WebSocket):
        await ws.accept()
        await ws.send_text("hello")
        await ws.close()

    client = TestClient(
        AccessMiddleware(app, Access(api_keys=(KEY,)), check_host=True), base_url="http://127.0.0.1"
    )
    assert client.post("/v1/tts", json={}).status_code == 401
    assert client.post("/v1/tts", json={}, headers=bearer(KEY)).status_code == 200
    foreign = {**bearer(KEY), "Origin": "http://evil.example"}
    assert client.post("/v1/tts", json={}, headers=foreign).status_code == 403
    for headers in ({}, foreign, {**bearer(KEY), "Host": "evil.example"}):
        with (
            pytest.raises(WebSocketDisconnect) as info,
            client.websocket_connect("ws://127.0.0.1/v1/live", headers=headers),
        ):
            pass
        assert info.value.code == 1008
    with client.websocket_connect("ws://127.0.0.1/v1/live", headers=bearer(KEY)) as ws:
        assert ws.receive_text() == "hello"


def test_tts_client_sends_the_key(keyed, tmp_path, capsys, monkeypatch):
    from tts.cli.main import main

    monkeypatch.delenv("TTS_API_KEY", raising=False)
    out = tmp_path / "hi.wav"
    argv = [
        "client",
        "Hi.",
        "--server",
        keyed.address,
        "-o",
        str(out),
        "--max-new-frames",
        "3",
        "--seed",
        "1",
        "-q",
    ]
    assert main(argv) == 1  # (a call the server refused, as any server error)
    err = capsys.readouterr().err.strip()
    assert "UNAUTHENTICATED" in err and "API key" in err and "\n" not in err
    assert main([*argv, "--api-key", KEY]) == 0 and out.stat().st_size > 44
    monkeypatch.setenv("TTS_API_KEY", OTHER_KEY)
    out.unlink()
    assert main(argv) == 0 and out.exists()
