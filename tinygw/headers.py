"""Which request headers are the gateway's own: one policy, read by both the
configuration (a provider's static `headers` may not set them) and the wire (a
client's copy is never forwarded).

Hop-by-hop headers (RFC 9110 section 7.6.1) belong to one connection; the others the
gateway sets itself for each upstream request: the credentials (the provider's key
goes in their place), `host` and `content-length` (framing), `accept-encoding` (the
gateway asks for `identity`), `expect`, and `x-request-id` (the gateway sends its own).
"""

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
CREDENTIALS = frozenset({"authorization", "x-api-key"})
GATEWAY_SET = frozenset({"host", "content-length", "accept-encoding", "expect", "x-request-id"})

# EHBP's (docs/confidential.md): the gateway opens the body with it; a provider never sees it.
SEALING = frozenset({"ehbp-encapsulated-key"})

# A client's name for its conversation (docs/configuration.md, conversation affinity): read by
# the gateway to choose a target and key, never sent on.
CONVERSATION = "x-tinygw-conversation"

# Never from a client, never in a provider's static `headers`.
GATEWAY_HEADERS = HOP_BY_HOP | CREDENTIALS | GATEWAY_SET | SEALING | {CONVERSATION}

# The headers that choose which account (organization, project) a provider key acts
# for: the operator's to set, dropped from clients unless the provider lets them
# through (`client_account_headers`, docs/design.md section 16).
ACCOUNT = frozenset({"openai-organization", "openai-project"})
