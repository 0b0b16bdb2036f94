"""Black-box: Claude on Bedrock and Vertex through the gateway (docs/design.md section 18).

A real gateway in front of fakes on loopback: an Anthropic provider, a Bedrock that checks
every request's signature with botocore's SigV4 signer and streams event-stream frames, a
Vertex, and a Google token endpoint that checks the JWT bearer grant's assertion."""

from __future__ import annotations

import base64
import json
import urllib.parse

import anthropic
import pytest
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.eventstream import EventStreamBuffer
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from conftest import call
from tinygw.config import environment
from tinygw.errors import ConfigError
from tinygw.fake.upstream import (
    EVENTSTREAM,
    FakeUpstream,
    Reply,
    anthropic_stream_events,
    bedrock_exception,
    bedrock_frames,
    json_reply,
    sse_reply,
    well_behaved,
)

GATEWAY_KEY = "gw-key-clouds"
AUTH = {"Authorization": f"Bearer {GATEWAY_KEY}"}
REGION = "us-east-1"
AWS = Credentials("AKIDCLOUDSTEST000001", "cloudsTest/secret+key0000000000000000000", "clouds-session-token-0001")
BEDROCK_MODEL = "anthropic.claude-sonnet-4-5-v1:0"
VERTEX_MODEL = "claude-sonnet-4-5@20250929"
PROJECT, LOCATION = "tinygw-proj", "us-east5"
MESSAGES = "/v1/messages"
PROMPT = {"max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def google_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


class Clouds:
    """The fakes of one test: anthropic, bedrock (signatures checked), vertex, google (tokens)."""

    def __init__(self, google_key: rsa.RSAPrivateKey) -> None:
        self.google_key = google_key
        self.anthropic = FakeUpstream(well_behaved("anthropic")).start_in_thread()
        self.bedrock = FakeUpstream().start_in_thread()
        self.vertex = FakeUpstream(well_behaved("vertex")).start_in_thread()
        self.google = FakeUpstream().start_in_thread()
        self.signatures: list[bool] = []  # each Bedrock request's, as botocore judged it
        self.assertions: list[dict] = []  # each grant's JWT claims, once its signature was checked
        self.bedrock_answers(well_behaved("bedrock"))
        self.google_answers(well_behaved("google"))

    def bedrock_answers(self, script) -> None:
        def checked(request):
            ok = signature_ok(request)
            self.signatures.append(ok)
            if not ok:
                return json_reply(
                    403, {"message": "bad signature"}, [("x-amzn-ErrorType", "InvalidSignatureException")]
                )
            return script(request)

        self.bedrock.script = checked

    def google_answers(self, script) -> None:
        def checked(request):
            form = urllib.parse.parse_qs(request.body.decode())
            assert form["grant_type"] == ["urn:ietf:params:oauth:grant-type:jwt-bearer"]
            header, claims, signed = form["assertion"][0].split(".")
            public = self.google_key.public_key()
            public.verify(_unb64(signed), f"{header}.{claims}".encode(), padding.PKCS1v15(), hashes.SHA256())
            self.assertions.append(json.loads(_unb64(claims)))
            return script(request)

        self.google.script = checked

    def service_account(self) -> str:
        pem = self.google_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return json.dumps(
            {
                "type": "service_account",
                "project_id": PROJECT,
                "private_key_id": "key-1",
                "private_key": pem.decode(),
                "client_email": "gateway@tinygw-proj.iam.gserviceaccount.com",
                "token_uri": f"{self.google.url}/token",
            }
        )

    def config(self, models: dict, **routing) -> dict:
        return {
            "providers": {
                "anthropic": {"base_url": self.anthropic.url, "api": "anthropic", "listing": False},
                "bedrock": {
                    "base_url": self.bedrock.url,
                    "api": "bedrock",
                    "region": REGION,
                    "aws_access_key_id_env": "PROVIDER_CLOUDS_AWS_KEY_ID",
                    "aws_secret_access_key_env": "CLOUDS_AWS_SECRET",
                    "aws_session_token_env": "CLOUDS_AWS_TOKEN",
                },
                "vertex": {
                    "base_url": self.vertex.url,
                    "api": "vertex",
                    "project": PROJECT,
                    "region": LOCATION,
                    "credentials_env": "CLOUDS_VERTEX_SA",
                },
            },
            "models": {name: {"targets": targets} for name, targets in models.items()},
            "routing": {"debug": True, "max_attempts": 3, **routing},
        }

    def env(self) -> dict[str, str]:
        return {
            "TINYGW_API_KEYS": GATEWAY_KEY,
            "PROVIDER_CLOUDS_AWS_KEY_ID": AWS.access_key,
            "CLOUDS_AWS_SECRET": AWS.secret_key,
            "CLOUDS_AWS_TOKEN": AWS.token,
            "CLOUDS_VERTEX_SA": self.service_account(),
            "PROVIDER_RETRY_FAST_FAILURES": "false",
            "PROVIDER_LISTING_SECONDS": "0",
            "PROVIDER_HEALTH_CHECK_SECONDS": "0",
        }

    def stop(self) -> None:
        for fake in (self.anthropic, self.bedrock, self.vertex, self.google):
            fake.stop_thread()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def signature_ok(request) -> bool:
    """botocore's SigV4 signer, given the signed headers and the time the gateway signed
    with, must find the gateway's signature."""
    authorization = request.headers.get("authorization", "")
    if not authorization.startswith("AWS4-HMAC-SHA256 ") or f"Credential={AWS.access_key}/" not in authorization:
        return False
    names = authorization.partition("SignedHeaders=")[2].partition(",")[0].split(";")
    if not {"host", "x-amz-date", "x-amz-security-token"} <= set(names):
        return False
    signed = AWSRequest(
        method=request.method,
        url=f"http://{request.headers['host']}{request.path}",
        data=request.body,
        headers={name: request.headers[name] for name in names},
    )
    signed.context["timestamp"] = request.headers["x-amz-date"]
    signer = SigV4Auth(AWS, "bedrock", REGION)
    expected = signer.signature(signer.string_to_sign(signed, signer.canonical_request(signed)), signed)
    return authorization.endswith(f"Signature={expected}")


@pytest.fixture
def clouds(google_key):
    fakes = Clouds(google_key)
    yield fakes
    fakes.stop()


SONNET = {"sonnet": ["anthropic:claude-sonnet-4-5", f"bedrock:{BEDROCK_MODEL}", f"vertex:{VERTEX_MODEL}"]}


def error_of(status: int, name: str | None, google: bool = False) -> Reply:
    if google:
        return json_reply(status, {"error": {"code": status, "message": "no", "status": name}})
    headers = [("x-amzn-ErrorType", f"{name}:http://internal.amazon.com/coral/com.amazon.bedrock/")] if name else []
    return json_reply(status, {"message": f"{name}"}, headers)


def sse_text(body: bytes) -> str:
    text = ""
    for event in body.split(b"\n\n"):
        data = event.partition(b"data: ")[2]
        if data:
            value = json.loads(data)
            text += value.get("delta", {}).get("text", "") if value.get("type") == "content_block_delta" else ""
    return text


# ---- an Anthropic alias falls back Anthropic -> Bedrock -> Vertex ------------------------


def test_an_alias_falls_back_from_anthropic_to_bedrock_to_vertex(start_gateway, clouds):
    clouds.anthropic.script = lambda r: json_reply(500, {"type": "error", "error": {"type": "api_error"}})
    clouds.bedrock_answers(lambda r: error_of(503, "ServiceUnavailableException"))
    gateway = start_gateway(clouds.config(SONNET), **clouds.env())
    body = json.dumps({"model": "sonnet", **PROMPT, "metadata": {"user_id": "u-1"}}).encode()
    status, headers, answer = call("POST", f"{gateway.url}{MESSAGES}", body, AUTH)
    assert status == 200, answer
    assert json.loads(answer)["model"] == VERTEX_MODEL
    assert headers["x-tinygw-attempts"] == ("anthropic:500,bedrock:503+ServiceUnavailableException,vertex:200"), (
        headers["x-tinygw-attempts"]
    )
    # Bedrock: the model in the path, no model nor stream in the body, its version first, the rest as sent
    sent = clouds.bedrock.requests[0]
    assert sent.path == "/model/anthropic.claude-sonnet-4-5-v1%3A0/invoke"
    assert sent.body == b'{"anthropic_version":"bedrock-2023-05-31",' + body[len(b'{"model": "sonnet", ') :]
    assert clouds.signatures == [True]
    # Vertex: the provider's project and region, a token from the grant
    sent = clouds.vertex.requests[0]
    assert (
        sent.path
        == f"/v1/projects/{PROJECT}/locations/{LOCATION}/publishers/anthropic/models/{VERTEX_MODEL}:rawPredict"
    )
    assert sent.body == b'{"anthropic_version":"vertex-2023-10-16",' + body[len(b'{"model": "sonnet", ') :]
    assert sent.headers["authorization"] == "Bearer fake-access-token"
    (claims,) = clouds.assertions
    assert claims["iss"] == "gateway@tinygw-proj.iam.gserviceaccount.com" and claims["aud"].endswith("/token")


def test_a_streamed_alias_falls_back_over_an_exception_frame_before_output(start_gateway, clouds):
    clouds.anthropic.script = lambda r: json_reply(529, {"type": "error", "error": {"type": "overloaded_error"}})
    exception = bedrock_exception("internalServerException", "it broke")
    clouds.bedrock_answers(
        lambda r: Reply(headers=[("content-type", EVENTSTREAM)], chunks=[(0, f) for f in [exception]])
    )
    gateway = start_gateway(clouds.config(SONNET), **clouds.env())
    status, headers, answer = call(
        "POST", f"{gateway.url}{MESSAGES}", {"model": "sonnet", "stream": True, **PROMPT}, AUTH
    )
    assert status == 200
    assert headers["x-tinygw-attempts"] == "anthropic:529,bedrock:200+error_event,vertex:200"
    assert sse_text(answer) == "Hello from vertex."
    sent = json.loads(clouds.bedrock.requests[0].body)
    assert clouds.bedrock.requests[0].path.endswith("/invoke-with-response-stream") and "stream" not in sent
    assert json.loads(clouds.vertex.requests[0].body)["stream"] is True
    assert clouds.vertex.requests[0].path.endswith(":streamRawPredict")


def test_bedrock_frames_are_unwrapped_into_anthropic_events_on_messages(start_gateway, clouds):
    gateway = start_gateway(clouds.config({"claude": [f"bedrock:{BEDROCK_MODEL}"]}), **clouds.env())
    client = anthropic.Anthropic(base_url=gateway.url, api_key=GATEWAY_KEY, max_retries=0, timeout=10)
    with client.messages.stream(model="claude", **PROMPT) as stream:
        text = "".join(stream.text_stream)
    assert text == "Hello from bedrock."
    assert client.messages.create(model="claude", **PROMPT).content[0].text == "Hello from bedrock."
    assert clouds.signatures == [True, True]


# ---- the cloud shapes, with the Anthropic SDK's clients for them ------------------------


def test_the_bedrock_shape_with_the_sdk_plain_and_streamed(start_gateway, clouds):
    gateway = start_gateway(clouds.config({"sonnet": [f"bedrock:{BEDROCK_MODEL}"]}), **clouds.env())
    client = anthropic.AnthropicBedrock(
        api_key=GATEWAY_KEY, base_url=gateway.url, aws_region="eu-west-3", max_retries=0, timeout=10
    )
    assert client.messages.create(model="sonnet", **PROMPT).content[0].text == "Hello from bedrock."
    with client.messages.stream(model="sonnet", **PROMPT) as stream:
        assert "".join(stream.text_stream) == "Hello from bedrock."
    paths = [r.path for r in clouds.bedrock.requests]
    model = urllib.parse.quote(BEDROCK_MODEL, safe="")
    assert paths == [f"/model/{model}/invoke", f"/model/{model}/invoke-with-response-stream"]
    assert clouds.signatures == [True, True]
    assert "x-api-key" not in clouds.bedrock.requests[0].headers  # the gateway key stays with the gateway


def test_the_bedrock_shape_forwards_the_body_byte_exact_and_relays_frames(start_gateway, clouds):
    gateway = start_gateway(clouds.config({"sonnet": [f"bedrock:{BEDROCK_MODEL}"]}), **clouds.env())
    body = b'{ "anthropic_version" : "bedrock-2023-05-31",\n "max_tokens": 16, '
    body += b'"messages": [{"role":"user","content":"hi"}]}'
    status, headers, answer = call(
        "POST",
        f"{gateway.url}/model/sonnet/invoke-with-response-stream",
        body,
        AUTH | {"Content-Type": "application/json"},
    )
    assert status == 200 and headers["content-type"] == EVENTSTREAM
    assert clouds.bedrock.requests[0].body == body
    # the frames as Bedrock sent them, byte for byte
    expected = b"".join(bedrock_frames(anthropic_stream_events(BEDROCK_MODEL, ["Hello", " from", " bedrock", "."])))
    assert answer == expected


def test_the_vertex_shape_with_the_sdk_in_the_providers_project(start_gateway, clouds):
    gateway = start_gateway(clouds.config({"claude-*": [f"vertex:{VERTEX_MODEL}"]}), **clouds.env())
    client = anthropic.AnthropicVertex(
        access_token=GATEWAY_KEY,
        region="europe-west1",
        project_id="the-clients-project",
        base_url=f"{gateway.url}/v1",
        max_retries=0,
        timeout=10,
    )
    assert client.messages.create(model="claude-sonnet-5-5", **PROMPT).content[0].text == "Hello from vertex."
    with client.messages.stream(model="claude-sonnet-5-5", **PROMPT) as stream:
        assert "".join(stream.text_stream) == "Hello from vertex."
    models = f"/v1/projects/{PROJECT}/locations/{LOCATION}/publishers/anthropic/models/{VERTEX_MODEL}"
    assert [r.path for r in clouds.vertex.requests] == [f"{models}:rawPredict", f"{models}:streamRawPredict"]
    assert all(r.headers["authorization"] == "Bearer fake-access-token" for r in clouds.vertex.requests)
    assert len(clouds.assertions) == 1  # the token is kept


def test_cloud_shapes_need_the_gateway_key(start_gateway, clouds):
    gateway = start_gateway(clouds.config({"sonnet": [f"bedrock:{BEDROCK_MODEL}"]}), **clouds.env())
    assert call("POST", f"{gateway.url}/model/sonnet/invoke", PROMPT)[0] == 401
    status, _, answer = call("POST", f"{gateway.url}/model/nothing/invoke", PROMPT, {"x-api-key": GATEWAY_KEY})
    assert status == 404 and json.loads(answer)["error"]["type"] == "not_found_error"
    assert not clouds.bedrock.requests


# ---- eventstream CRCs ---------------------------------------------------------------------


def _corrupt(frame: bytes, at: int) -> bytes:
    return frame[:at] + bytes([frame[at] ^ 0x01]) + frame[at + 1 :]


def _frames_reply(frames: list[bytes]) -> Reply:
    return Reply(headers=[("content-type", EVENTSTREAM)], chunks=[(0, f) for f in frames])


EVENTS = anthropic_stream_events(BEDROCK_MODEL, ["Hello", " from", " bedrock", "."])


@pytest.mark.parametrize("where", [8, 30], ids=["prelude_crc", "message_crc"])
def test_a_frame_whose_crc_does_not_match_before_output_falls_back(start_gateway, clouds, where):
    frames = bedrock_frames(EVENTS)
    clouds.bedrock_answers(lambda r: _frames_reply([_corrupt(frames[0], where), *frames[1:]]))
    gateway = start_gateway(
        clouds.config({"m": [f"bedrock:{BEDROCK_MODEL}", f"vertex:{VERTEX_MODEL}"]}), **clouds.env()
    )
    status, headers, answer = call("POST", f"{gateway.url}{MESSAGES}", {"model": "m", "stream": True, **PROMPT}, AUTH)
    assert status == 200 and sse_text(answer) == "Hello from vertex."
    assert headers["x-tinygw-attempts"] == "bedrock:protocol_error,vertex:200"


def test_a_frame_whose_crc_does_not_match_after_output_cuts_the_stream(start_gateway, clouds):
    frames = bedrock_frames(EVENTS)
    clouds.bedrock_answers(lambda r: _frames_reply([*frames[:5], _corrupt(frames[5], 30), *frames[6:]]))
    gateway = start_gateway(clouds.config({"m": [f"bedrock:{BEDROCK_MODEL}"]}), **clouds.env())
    status, _, answer = call("POST", f"{gateway.url}{MESSAGES}", {"model": "m", "stream": True, **PROMPT}, AUTH)
    assert status == 200
    assert b"content_block_delta" in answer and not answer.rstrip().endswith(b'"message_stop"}')
    last = answer.strip().split(b"\n\n")[-1]
    assert (
        last.startswith(b"event: error")
        and json.loads(last.partition(b"data: ")[2])["error"]["cause"] == "protocol_error"
    )
    # on the Bedrock route the client's stream ends with an exception frame
    status, _, answer = call("POST", f"{gateway.url}/model/m/invoke-with-response-stream", PROMPT, AUTH)
    decoded = EventStreamBuffer()
    decoded.add_data(answer)
    messages = list(decoded)
    assert [m.headers[":message-type"] for m in messages] == ["event"] * 5 + ["exception"]
    assert messages[-1].headers[":exception-type"] == "modelStreamErrorException"
    assert any(r.get("status") == 200 and r.get("cut") for r in gateway.log_records() if r.get("msg") == "request")


def test_an_exception_frame_after_output_ends_the_stream_with_an_error(start_gateway, clouds):
    frames = bedrock_frames(EVENTS)
    clouds.bedrock_answers(lambda r: _frames_reply([*frames[:4], bedrock_exception("modelStreamErrorException", "x")]))
    gateway = start_gateway(
        clouds.config({"m": [f"bedrock:{BEDROCK_MODEL}", f"vertex:{VERTEX_MODEL}"]}), **clouds.env()
    )
    status, headers, answer = call("POST", f"{gateway.url}{MESSAGES}", {"model": "m", "stream": True, **PROMPT}, AUTH)
    assert status == 200 and headers["x-tinygw-attempts"] == "bedrock:200"
    assert answer.strip().split(b"\n\n")[-1].startswith(b"event: error")
    assert not clouds.vertex.requests  # nothing is switched after output


# ---- the failure table's cloud rows -------------------------------------------------------


def failures_of(gateway, provider: str) -> int:
    status = json.loads(call("GET", f"{gateway.url}/status.json")[2])
    entry = next(p for p in status["providers"] if p["name"] == provider)
    return sum(c["consecutive_failures"] for c in entry["circuits"])


ROWS = [
    # (who fails, its answer, attempts header, the client's status, counts as a failure)
    ("bedrock", error_of(429, "ThrottlingException"), "bedrock:429+ThrottlingException,vertex:200", 200, False),
    ("bedrock", error_of(429, "ModelNotReadyException"), "bedrock:429+ModelNotReadyException,vertex:200", 200, False),
    (
        "vertex",
        error_of(429, "RESOURCE_EXHAUSTED", google=True),
        "vertex:429+RESOURCE_EXHAUSTED,bedrock:200",
        200,
        False,
    ),
    (
        "bedrock",
        error_of(503, "ServiceUnavailableException"),
        "bedrock:503+ServiceUnavailableException,vertex:200",
        200,
        True,
    ),
    ("vertex", error_of(500, "INTERNAL", google=True), "vertex:500,bedrock:200", 200, True),
    ("bedrock", error_of(403, "AccessDeniedException"), "bedrock:403+AccessDeniedException,vertex:200", 200, True),
    (
        "bedrock",
        error_of(403, "UnrecognizedClientException"),
        "bedrock:403+UnrecognizedClientException,vertex:200",
        200,
        True,
    ),
    ("vertex", error_of(401, "UNAUTHENTICATED", google=True), "vertex:401,bedrock:200", 200, True),
    ("vertex", error_of(403, "PERMISSION_DENIED", google=True), "vertex:403,bedrock:200", 200, True),
    ("bedrock", error_of(400, "ValidationException"), "bedrock:400+ValidationException", 400, False),
]


STREAM_ROWS = [
    # (a leading exception frame, the attempts header, the client's status, counts as a failure)
    ("throttlingException", "bedrock:429+throttlingException,vertex:200", 200, False),
    ("modelNotReadyException", "bedrock:429+modelNotReadyException,vertex:200", 200, False),
    ("serviceUnavailableException", "bedrock:503+serviceUnavailableException,vertex:200", 200, True),
    ("validationException", "bedrock:400+validationException", 400, False),
    ("internalServerException", "bedrock:200+error_event,vertex:200", 200, True),
]


@pytest.mark.parametrize("name,attempts,client_status,failure", STREAM_ROWS, ids=[row[0] for row in STREAM_ROWS])
def test_a_leading_exception_frame_is_judged_by_its_name(start_gateway, clouds, name, attempts, client_status, failure):
    clouds.bedrock_answers(lambda r: _frames_reply([bedrock_exception(name, "no")]))
    gateway = start_gateway(
        clouds.config({"m": [f"bedrock:{BEDROCK_MODEL}", f"vertex:{VERTEX_MODEL}"]}), **clouds.env()
    )
    status, headers, answer = call("POST", f"{gateway.url}{MESSAGES}", {"model": "m", "stream": True, **PROMPT}, AUTH)
    assert (status, headers["x-tinygw-attempts"]) == (client_status, attempts), answer
    assert failures_of(gateway, "bedrock") == (1 if failure else 0)


def test_a_throttled_stream_with_no_other_target_is_the_client_s_429_with_retry_after(start_gateway, clouds):
    clouds.bedrock_answers(lambda r: _frames_reply([bedrock_exception("throttlingException", "slow down")]))
    gateway = start_gateway(clouds.config({"m": [f"bedrock:{BEDROCK_MODEL}"]}), **clouds.env())
    for _ in range(6):  # more than PROVIDER_BREAKER_FAILURES: a rate limit never opens the circuit
        status, headers, answer = call(
            "POST", f"{gateway.url}{MESSAGES}", {"model": "m", "stream": True, **PROMPT}, AUTH
        )
        assert (status, headers["retry-after"]) == (429, "1"), answer
    assert failures_of(gateway, "bedrock") == 0


@pytest.mark.parametrize("who,reply,attempts,client_status,failure", ROWS, ids=[row[2].split(",")[0] for row in ROWS])
def test_cloud_failures(start_gateway, clouds, who, reply, attempts, client_status, failure):
    if who == "bedrock":
        clouds.bedrock_answers(lambda r: reply)
        targets = [f"bedrock:{BEDROCK_MODEL}", f"vertex:{VERTEX_MODEL}"]
    else:
        clouds.vertex.script = lambda r: reply
        targets = [f"vertex:{VERTEX_MODEL}", f"bedrock:{BEDROCK_MODEL}"]
    gateway = start_gateway(clouds.config({"m": targets}), **clouds.env())
    status, headers, answer = call("POST", f"{gateway.url}{MESSAGES}", {"model": "m", **PROMPT}, AUTH)
    assert (status, headers["x-tinygw-attempts"]) == (client_status, attempts), answer
    assert failures_of(gateway, who) == (1 if failure else 0)


@pytest.mark.parametrize(
    "reply", [error_of(403, "AccessDeniedException"), error_of(403, None)], ids=["AccessDenied", "403"]
)
def test_refused_credentials_are_a_502_for_the_client(start_gateway, clouds, reply):
    clouds.bedrock_answers(lambda r: reply)
    gateway = start_gateway(clouds.config({"m": [f"bedrock:{BEDROCK_MODEL}"]}), **clouds.env())
    status, _, answer = call("POST", f"{gateway.url}{MESSAGES}", {"model": "m", **PROMPT}, AUTH)
    error = json.loads(answer)["error"]
    assert status == 502 and error["cause"] == "provider_credentials" and error["provider"] == "bedrock"


@pytest.mark.parametrize(
    "script",
    [
        lambda r: json_reply(400, {"error": "invalid_grant", "error_description": "Invalid JWT"}),
        lambda r: Reply(action="close"),
    ],
    ids=["refused", "unreachable"],
)
def test_a_token_that_cannot_be_had_is_a_provider_failure(start_gateway, clouds, script):
    clouds.google_answers(script)
    gateway = start_gateway(
        clouds.config({"m": [f"vertex:{VERTEX_MODEL}"], "n": [f"vertex:{VERTEX_MODEL}", f"bedrock:{BEDROCK_MODEL}"]}),
        **clouds.env(),
    )
    status, _, answer = call("POST", f"{gateway.url}{MESSAGES}", {"model": "m", **PROMPT}, AUTH)
    error = json.loads(answer)["error"]
    assert status == 502 and error["cause"] == "provider_credentials", answer
    assert "invalid_grant" in error["message"] or "reached" in error["message"]
    status, headers, _ = call("POST", f"{gateway.url}{MESSAGES}", {"model": "n", **PROMPT}, AUTH)
    assert status == 200 and headers["x-tinygw-attempts"] == "vertex:provider_credentials,bedrock:200"
    assert failures_of(gateway, "vertex") == 2
    assert not clouds.vertex.requests


def test_a_sse_stream_from_vertex_is_relayed_as_it_is(start_gateway, clouds):
    events = anthropic_stream_events(VERTEX_MODEL, ["a", "b"])
    clouds.vertex.script = lambda r: sse_reply(events)
    gateway = start_gateway(clouds.config({"m": [f"vertex:{VERTEX_MODEL}"]}), **clouds.env())
    path = "/v1/projects/x/locations/y/publishers/anthropic/models/m:streamRawPredict"
    status, headers, answer = call(
        "POST", f"{gateway.url}{path}", {"anthropic_version": "vertex-2023-10-16", "stream": True, **PROMPT}, AUTH
    )
    assert status == 200 and answer == b"".join(events)
    assert headers["content-type"].startswith("text/event-stream")


# ---- configuration ------------------------------------------------------------------------


def _environ(clouds: Clouds, provider: dict, **extra: str) -> dict[str, str]:
    return {"TINYGW_CONFIG": json.dumps({"providers": {"c": provider}}), **extra}


BEDROCK_DOC = {
    "api": "bedrock",
    "region": "eu-west-3",
    "aws_access_key_id_env": "PROVIDER_C_KEY_ID",
    "aws_secret_access_key_env": "PROVIDER_C_SECRET",
}


def test_a_bedrock_provider_reads_its_keys_as_key_variables_with_file(tmp_path, clouds):
    secret = tmp_path / "secret"
    secret.write_text("the-secret\n")
    settings = environment.from_environ(
        _environ(clouds, BEDROCK_DOC, PROVIDER_C_KEY_ID="AKIDX", PROVIDER_C_SECRET_FILE=str(secret))
    )
    provider = settings.providers["c"]
    assert provider.origin.host == "bedrock-runtime.eu-west-3.amazonaws.com" and provider.origin.scheme == "https"
    assert provider.aws.secret_access_key.reveal() == "the-secret" and provider.aws.session_token is None
    assert "the-secret" not in json.dumps(settings.effective())


@pytest.mark.parametrize(
    "change,where",
    [
        ({"region": None}, "$.providers.c.region"),
        ({"aws_secret_access_key_env": None}, "$.providers.c.aws_secret_access_key_env"),
        ({"project": "p"}, "$.providers.c.project"),
        ({"base_url": "https://bedrock.example/v1"}, "$.providers.c.base_url"),
        ({"api_key_env": "PROVIDER_C_KEY_ID"}, "$.providers.c.api_key_env"),
        ({"region": "EU WEST"}, "$.providers.c.region"),
    ],
)
def test_a_bedrock_provider_is_refused_naming_its_field(clouds, change, where):
    doc = {k: v for k, v in {**BEDROCK_DOC, **change}.items() if v is not None}
    with pytest.raises(ConfigError) as e:
        variables = {doc[f]: "x" for f in ("aws_access_key_id_env", "aws_secret_access_key_env") if f in doc}
        environment.from_environ(_environ(clouds, doc, **variables))
    assert e.value.where.endswith(where)


def test_a_vertex_provider_needs_a_service_account_key(clouds):
    doc = {"api": "vertex", "project": "p", "region": "global", "credentials_env": "PROVIDER_C_SA"}
    settings = environment.from_environ(_environ(clouds, doc, PROVIDER_C_SA=clouds.service_account()))
    assert settings.providers["c"].origin.host == "aiplatform.googleapis.com"
    assert settings.providers["c"].token_origin.port == clouds.google.port
    for bad in ("{}", "not json", json.dumps({**json.loads(clouds.service_account()), "private_key": "x"})):
        with pytest.raises(ConfigError) as e:
            environment.from_environ(_environ(clouds, doc, PROVIDER_C_SA=bad))
        assert e.value.where == "PROVIDER_C_SA" and "PRIVATE KEY" not in str(e.value)
    with pytest.raises(ConfigError) as e:  # an unknown variable with our prefix is still refused
        environment.from_environ(_environ(clouds, doc, PROVIDER_C_SA=clouds.service_account(), PROVIDER_C_SB="x"))
    assert e.value.where == "PROVIDER_C_SB"


# ---- a Messages body for a cloud (pure) -----------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "stream": true, "max_tokens": 5, "messages": [{"role": "user", "content": "a \\"model\\""}]}',
        b'{ "max_tokens" : 5 , "stream":false, "model" : "m" }',
        b'{"model":"m","metadata":{"stream":1,"model":"x"},"stream":true}',  # nested keys: re-encoded
        b'{"mod\\u0065l":"m","max_tokens":5}',  # an escaped key: re-encoded
        b'{"model":"m","anthropic_version":"2023-06-01","max_tokens":5}',
        b'{"model":"m","content":"\\ud83d"}',  # a lone surrogate: JSON, kept
    ],
)
@pytest.mark.parametrize("api", ["bedrock", "vertex"])
def test_a_messages_body_for_a_cloud_keeps_its_meaning(body, api):
    from tinygw.protocol import clouds

    edited = clouds.messages_body(body, api)
    original, result = json.loads(body), json.loads(edited)
    dropped = {"model", "stream", "anthropic_version"} if api == "bedrock" else {"model", "anthropic_version"}
    assert result == {
        "anthropic_version": clouds.ANTHROPIC_VERSION[api],
        **{k: v for k, v in original.items() if k not in dropped},
    }
    assert edited.startswith(b'{"anthropic_version":')


def test_a_plain_messages_body_is_spliced_not_reencoded():
    from tinygw.protocol import clouds

    body = b'{"model": "m",  "messages": [ {"role":"user", "content":"x"} ] ,"stream": true}'
    assert clouds.messages_body(body, "bedrock") == (
        b'{"anthropic_version":"bedrock-2023-05-31","messages": [ {"role":"user", "content":"x"} ] }'
    )
