"""The API model of the local Lambda endpoint: names, quotas, function records and error shapes.

The endpoint speaks Invoke (RequestResponse, Event, DryRun), CreateFunction, UpdateFunctionCode,
UpdateFunctionConfiguration, GetFunction, GetFunctionConfiguration, ListFunctions,
DeleteFunction and Put/Get/DeleteFunctionConcurrency, with the status codes, headers and error
shapes botocore's restJson1 model for Lambda expects. Only ``$LATEST`` exists (no versions or
aliases).
"""

from __future__ import annotations

import base64
import datetime as dt
import io
import re
import uuid
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

ACCOUNT = "000000000000"
MAX_SYNC_PAYLOAD = 6 * 1024 * 1024  # 6291456 bytes, Lambda's synchronous request/response quota
MAX_ASYNC_PAYLOAD = 1024 * 1024  # Lambda's asynchronous (Event) quota
MAX_ZIP = 50 * 1024 * 1024  # direct-upload zip quota
MAX_UNZIPPED = 250 * 1024 * 1024
MAX_REQUEST = MAX_ZIP * 4 // 3 + 64 * 1024  # base64 of the largest zip plus the JSON around it
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
ARN_RE = re.compile(r"^arn:aws[a-zA-Z-]*:lambda:[a-z0-9-]+:\d{12}:function:([A-Za-z0-9_-]{1,64})(?::([$A-Za-z0-9_-]+))?$")


class LambdaError(Exception):
    """An API error in the shape botocore parses: status, x-amzn-ErrorType and a JSON body."""

    def __init__(self, status: int, code: str, message: str, **extra):
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra

    def response(self, request_id: str) -> web.Response:
        key = "Message" if self.code == "ResourceNotFoundException" else "message"  # as in the service model
        body = {"Type": "User" if self.status < 500 else "Service", key: self.message, **self.extra}
        return web.json_response(body, status=self.status, headers={"x-amzn-ErrorType": self.code, "x-amzn-RequestId": request_id})


def not_found(arn: str) -> LambdaError:
    return LambdaError(404, "ResourceNotFoundException", f"Function not found: {arn}")


def invalid(message: str) -> LambdaError:
    return LambdaError(400, "InvalidParameterValueException", message)


def _now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "+0000"


@dataclass
class FunctionConfig:
    name: str
    runtime: str
    handler: str
    role: str
    code_hex: str
    code_size: int
    timeout: int = 3
    memory: int = 128
    environment: dict = field(default_factory=dict)
    description: str = ""
    reserved: int | None = None
    last_modified: str = field(default_factory=_now_iso)
    revision: str = field(default_factory=lambda: str(uuid.uuid4()))

    @property
    def code_sha256(self) -> str:  # Lambda reports the base64 of the zip's SHA-256
        return base64.b64encode(bytes.fromhex(self.code_hex)).decode()

    def arn(self, region: str) -> str:
        return f"arn:aws:lambda:{region}:{ACCOUNT}:function:{self.name}"

    def to_api(self, region: str) -> dict:
        return {
            "FunctionName": self.name,
            "FunctionArn": self.arn(region),
            "Runtime": self.runtime,
            "Role": self.role,
            "Handler": self.handler,
            "CodeSize": self.code_size,
            "Description": self.description,
            "Timeout": self.timeout,
            "MemorySize": self.memory,
            "LastModified": self.last_modified,
            "CodeSha256": self.code_sha256,
            "Version": "$LATEST",
            "Environment": {"Variables": dict(self.environment)},
            "TracingConfig": {"Mode": "PassThrough"},
            "RevisionId": self.revision,
            "State": "Active",
            "LastUpdateStatus": "Successful",
            "PackageType": "Zip",
            "Architectures": ["x86_64"],
            "EphemeralStorage": {"Size": 512},
        }


@dataclass
class Outcome:
    status: int
    body: bytes
    headers: dict


def unzip_code(data: bytes, dest: Path):
    """Extract a function's zip into ``dest``, refusing what Lambda refuses and any entry that escapes it."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
        infos = zf.infolist()
    except (zipfile.BadZipFile, ValueError):
        raise invalid("Could not unzip uploaded file. Please check your file, then try to upload again.") from None
    if sum(i.file_size for i in infos) > MAX_UNZIPPED:
        raise invalid(f"Unzipped size must be smaller than {MAX_UNZIPPED} bytes")
    root = dest.resolve()
    for info in infos:
        path = (dest / info.filename).resolve()
        if root != path and root not in path.parents:  # zip-slip
            raise invalid(f"Could not unzip uploaded file: entry {info.filename!r} escapes the archive root")
        if (info.external_attr >> 16) & 0o170000 == 0o120000:
            raise invalid(f"Could not unzip uploaded file: entry {info.filename!r} is a symbolic link")
    zf.extractall(dest)


def config_fields(body: dict, cfg: FunctionConfig | None) -> dict:
    """The FunctionConfig fields a CreateFunction / UpdateFunctionConfiguration body sets, each checked as Lambda does."""
    out = {}
    if "Runtime" in body:
        if not str(body["Runtime"]).startswith("python"):
            raise invalid(f"The local endpoint runs Python handlers only, not runtime {body['Runtime']!r}")
        out["runtime"] = body["Runtime"]
    if "Handler" in body:
        out["handler"] = str(body["Handler"])
    if "Role" in body:
        out["role"] = str(body["Role"])
    if "Timeout" in body:
        t = body["Timeout"]
        if not isinstance(t, int) or not 1 <= t <= 900:
            raise invalid(f"Timeout must be an integer from 1 to 900, got {t!r}")
        out["timeout"] = t
    if "MemorySize" in body:
        m = body["MemorySize"]
        if not isinstance(m, int) or not 128 <= m <= 10240:
            raise invalid(f"MemorySize must be an integer from 128 to 10240, got {m!r}")
        out["memory"] = m
    if "Environment" in body:
        variables = (body["Environment"] or {}).get("Variables") or {}
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in variables.items()):
            raise invalid("Environment.Variables must map strings to strings")
        out["environment"] = dict(variables)
    if "Description" in body:
        out["description"] = str(body["Description"])
    return out
