"""One execution environment of the local Lambda endpoint: a process that imports one handler and
runs one invocation at a time, like a Lambda execution environment.

Run as a script by the server (not imported: it must not pull in the runtime). Protocol over the
process's stdin/stdout, binary and without pickle: each message is one JSON header line followed
by ``len`` raw bytes (the JSON event, or the JSON result/error). Handler output written to
stdout goes to stderr (the function's log file) so it can never corrupt the protocol stream.
"""

import importlib
import json
import os
import resource
import sys
import threading
import time
import traceback

LOG_TAIL = 4096  # Lambda's LogType=Tail returns the last 4 KB of the log


class Context:
    """The attributes of the Lambda Python runtime's context object that handlers commonly use."""

    def __init__(self, header):
        env = os.environ
        self.function_name = env.get("AWS_LAMBDA_FUNCTION_NAME", "")
        self.function_version = env.get("AWS_LAMBDA_FUNCTION_VERSION", "$LATEST")
        self.memory_limit_in_mb = env.get("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "128")
        self.log_group_name = "/aws/lambda/" + self.function_name
        self.log_stream_name = "local"
        self.invoked_function_arn = header.get("arn", "")
        self.aws_request_id = header.get("id", "")
        self.identity = None
        self.client_context = None
        self._deadline_ms = header.get("deadline_ms", 0)

    def get_remaining_time_in_millis(self):
        return max(0, int(self._deadline_ms - time.time() * 1000))


class Tee:
    """Writes through to the log file and keeps the invocation's last bytes for LogType=Tail."""

    def __init__(self, stream):
        self.stream, self.parts, self.size = stream, [], 0

    def write(self, s):
        self.stream.write(s)
        self.parts.append(s)
        self.size += len(s)
        if self.size > 4 * LOG_TAIL:
            text = "".join(self.parts)[-LOG_TAIL:]
            self.parts, self.size = [text], len(text)
        return len(s)

    def flush(self):
        self.stream.flush()

    def isatty(self):
        return False

    def text(self):
        return "".join(self.parts)[-LOG_TAIL:]


def error_body(exc, error_type=None):
    tb = traceback.extract_tb(exc.__traceback__)
    return {
        "errorMessage": str(exc),
        "errorType": error_type or type(exc).__name__,
        "requestId": "",
        "stackTrace": traceback.format_list(tb),
    }


def watch_parent():
    # A hung handler never reads stdin's EOF: leave when the server process is gone.
    parent = os.getppid()
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    proto_in = sys.stdin.buffer
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # fd 1 (C-level prints, subprocesses) now goes to the log as well
    sys.stdout = sys.stderr
    threading.Thread(target=watch_parent, daemon=True).start()

    def send(header, body=b""):
        header["len"] = len(body)
        proto_out.write(json.dumps(header).encode() + b"\n" + body)
        proto_out.flush()

    # This project's editable install would serve rewards/envs from the working tree: hide it, so
    # the function runs what its zip holds (as on AWS) and a package missing from the zip shows here.
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable___rollart_dask")]
    root = os.environ["LAMBDA_TASK_ROOT"]
    sys.path.insert(0, root)
    spec = os.environ["_HANDLER"]
    module_name, _, fn_name = spec.rpartition(".")
    try:
        if not module_name:
            raise ValueError(f"Bad handler '{spec}': not enough values to unpack (expected 2, got 1)")
        module = importlib.import_module(module_name)
    except Exception as e:  # the Lambda runtime reports these on the first invocation
        etype = "Runtime.MalformedHandlerName" if not module_name else "Runtime.ImportModuleError"
        msg = str(e) if not module_name else f"Unable to import module '{module_name}': {e}"
        send({"type": "init_error"}, json.dumps({**error_body(e, etype), "errorMessage": msg}).encode())
        return 1
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        body = {
            "errorMessage": f"Handler '{fn_name}' missing on module '{module_name}'",
            "errorType": "Runtime.HandlerNotFound",
            "requestId": "",
            "stackTrace": [],
        }
        send({"type": "init_error"}, json.dumps(body).encode())
        return 1
    send({"type": "ready"})

    while True:
        line = proto_in.readline()
        if not line:
            return 0
        header = json.loads(line)
        payload = proto_in.read(header["len"])
        tee = Tee(sys.__stderr__)
        sys.stdout = sys.stderr = tee
        ok = True
        try:
            event = json.loads(payload) if payload.strip() else {}
            result = fn(event, Context(header))
            try:
                body = json.dumps(result).encode()
            except (TypeError, ValueError) as e:
                ok, body = (
                    False,
                    json.dumps(
                        {**error_body(e, "Runtime.MarshalError"), "errorMessage": f"Unable to marshal response: {e}", "stackTrace": []}
                    ).encode(),
                )
        except Exception as e:
            traceback.print_exc()
            ok, body = False, json.dumps(error_body(e)).encode()
        finally:
            sys.stdout = sys.stderr = sys.__stderr__
        rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        send({"type": "result", "ok": ok, "log": tee.text(), "max_rss_mb": rss_kb // 1024}, body)


if __name__ == "__main__":
    sys.exit(main())
