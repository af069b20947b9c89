"""Auth of the local Lambda endpoint: every endpoint asks for a token, loopback ones too (a web page the user visits
can POST to 127.0.0.1: without the token it can neither deploy a function nor invoke one). One is made when none is
given; the run hands it to its callers, ``rollart rewards serve`` prints it.

Every request must be SigV4-signed with the token as the AWS secret access key (any access key id), verified here
with botocore's own signer, so plain boto3/AWS CLI usage works unchanged. ``/_local/*`` also accepts
``Authorization: Bearer <token>`` (for curl); ``/_local/health`` is open. A loopback endpoint also refuses a Host
header that is not a loopback name (DNS rebinding).
"""

from __future__ import annotations

import datetime as dt
import hmac
import ipaddress
import os
import re
import secrets

from rollart_dask.data.serverless.client import TOKEN_ENV

MIN_TOKEN_LEN = 16
SIGV4_SKEW_S = 300
SIGV4_RE = re.compile(
    r"^AWS4-HMAC-SHA256 Credential=([^/,\s]+)/(\d{8})/([^/,\s]+)/([^/,\s]+)/aws4_request,\s*"
    r"SignedHeaders=([a-z0-9;_.-]+),\s*Signature=([0-9a-f]{64})$"
)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname, "" or "0.0.0.0": reachable from elsewhere


def verify_sigv4(method: str, raw_path: str, headers, body: bytes, secret: str) -> str | None:
    """None when the request is SigV4-signed with ``secret``; otherwise why not."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    m = SIGV4_RE.match(headers.get("Authorization", ""))
    if not m:
        return "missing or malformed AWS4-HMAC-SHA256 Authorization header"
    akid, date, region, service, signed, signature = m.groups()
    amz_date = headers.get("X-Amz-Date", "")
    try:
        when = dt.datetime.strptime(amz_date, "%Y%m%dT%H%M%SZ").replace(tzinfo=dt.timezone.utc)
    except ValueError:
        return "missing or malformed X-Amz-Date"
    if abs((dt.datetime.now(dt.timezone.utc) - when).total_seconds()) > SIGV4_SKEW_S or amz_date[:8] != date:
        return "signature expired or dated outside the allowed clock skew"
    names = signed.split(";")
    if "host" not in names:
        return "the Host header must be signed"
    signed_headers = {}
    for name in names:
        values = headers.getall(name, None) if hasattr(headers, "getall") else [headers.get(name)]
        if not values or values[0] is None:
            return f"signed header {name!r} is missing"
        signed_headers[name] = ",".join(values)
    req = AWSRequest(method=method, url=f"http://{signed_headers['host']}{raw_path}", headers=signed_headers, data=body)
    req.context["timestamp"] = amz_date
    signer = SigV4Auth(Credentials(akid, secret), service, region)
    expected = signer.signature(signer.string_to_sign(req, signer.canonical_request(req)), req)
    return None if hmac.compare_digest(expected, signature) else "signature does not match"


def authorize(token: str, method: str, path: str, raw_path: str, headers, body: bytes) -> str | None:
    """None when a request to an endpoint guarded by ``token`` may proceed; otherwise why not."""
    if path == "/_local/health":
        return None
    authz = headers.get("Authorization", "")
    if authz.startswith("Bearer ") and path.startswith("/_local/"):
        ok = hmac.compare_digest(authz[7:].strip().encode(), token.encode())
        return None if ok else "bad bearer token"
    return verify_sigv4(method, raw_path, headers, body, token)


def check_token(host: str, token: str | None) -> str:
    """The token to require (``token``, else $ROLLART_LAMBDA_TOKEN, else a new random one on loopback); ValueError if
    too short, or missing off loopback (remote callers must be given it)."""
    token = token if token is not None else os.environ.get(TOKEN_ENV) or None
    if token is not None and len(token) < MIN_TOKEN_LEN:
        raise ValueError(f"the auth token must be at least {MIN_TOKEN_LEN} characters")
    if token is None and not is_loopback(host):
        raise ValueError(
            f"refusing to bind the Lambda endpoint to non-loopback address {host!r} without an auth token "
            f"(pass token=... or set {TOKEN_ENV}; clients sign with it as the AWS secret access key)"
        )
    return token if token is not None else secrets.token_urlsafe(24)


def loopback_host_header(host_header: str) -> bool:
    """A Host header naming a loopback address (any port): what a loopback endpoint accepts."""
    name = host_header.rsplit(":", 1)[0] if not host_header.endswith("]") else host_header
    return is_loopback(name.strip("[]"))
