"""Every exception tinygw raises, grouped by what the caller should do.

Foreign exceptions (OSError, ssl.SSLError, h11's errors) are translated once, at the
upstream client's boundary (`tinygw.upstream.network`, `tinygw.upstream.connection`), into the `UpstreamError`
family below. Nothing above that layer catches a foreign exception.
"""


class ConfigError(Exception):
    """A configuration value is wrong. Stops the start with exit code 2.

    `where` names the environment variable or the JSON path at fault; `reason` says
    what is wrong with it. Neither ever holds a secret value.
    """

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason


class UnsendableRequest(Exception):
    """The client's request cannot be forwarded as it was sent (a header that HTTP/1.1
    cannot carry): the client's error, a 400 before any attempt. The message says which
    part (the query, a header), never the provider."""


class UpstreamError(Exception):
    """An attempt at a provider failed before a complete answer arrived."""

    #: what docs/design.md section 3 calls the cause, in the 502/504 error body
    cause = "connect_error"


class ConnectError(UpstreamError):
    """Refused, reset, unreachable, DNS or TLS failure while connecting."""


class ConnectTimeout(UpstreamError):
    """No connection (TCP and TLS) within the provider's `connect_timeout_s`."""

    cause = "timeout"


class HeadTimeout(UpstreamError):
    """A streamed request was sent, but no response head arrived within `head_timeout_s`
    (a provider's streamed answer starts at once: its tokens come later)."""

    cause = "timeout"


class FirstByteTimeout(UpstreamError):
    """A streamed answer's head came, but not the first byte of its body within
    `first_byte_timeout_s` from it."""

    cause = "timeout"


class TotalTimeout(UpstreamError):
    """The whole exchange outlived the provider's `timeout_s`."""

    cause = "timeout"


class StallTimeout(UpstreamError):
    """A streamed answer that had begun paused longer than `stall_timeout_s` between two reads."""

    cause = "timeout"


class UnusableAnswer(UpstreamError):
    """The provider answered, but not with anything a client can use: a redirect (a
    misconfigured `base_url`), or a 200 on a JSON route whose body is not JSON."""

    cause = "bad_response"


class WriteError(UpstreamError):
    """The connection broke while the request was being sent."""


class ReadError(UpstreamError):
    """The connection broke, or was closed early, while the response was being read."""


class ResponseTooLarge(ReadError):
    """A non-streamed answer outgrew the gateway's bound on what it reads whole."""


class RemoteProtocolError(UpstreamError):
    """The provider spoke HTTP/1.1 wrongly (or sent a body the gateway cannot decode).
    Its fault, not ours."""

    cause = "protocol_error"


class ProviderCredentials(UpstreamError):
    """A cloud provider's credentials cannot be used: its access token cannot be had
    (the token endpoint refused the service account, or could not be reached), or the
    cloud refused the signature or the token (AccessDeniedException and the like). A
    provider configuration error: a failure, and the client gets 502 (docs/design.md
    section 18)."""

    cause = "provider_credentials"


class PoolTimeout(UpstreamError):
    """Every one of the provider's `max_connections` stayed busy for `pool_timeout_s`: the
    target is busy, which is no verdict on its health (docs/design.md section 17)."""

    cause = "provider_busy"


class EvidenceUnavailable(Exception):
    """No attestation evidence can be given now (503); the message says which step failed."""

    code = "evidence_unavailable"


class Raced(EvidenceUnavailable):
    """The report entry's `generation` changed while it was read: someone else wrote."""

    code = "attestation_raced"


class SealedBodyRefused(Exception):
    """An EHBP-sealed request body that does not open (tinygw.trust.ehbp): the client's
    fault, answered with the protocol's own error in the clear, before anything reads the
    body: `status` 422 (sealed to another key configuration: the client fetches the key
    again) or 400, and a fixed `title` that tells nothing of which step failed."""

    def __init__(self, status: int, title: str) -> None:
        super().__init__(title)
        self.status = status
        self.title = title
