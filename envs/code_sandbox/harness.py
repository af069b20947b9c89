"""Test harness that runs inside the sandbox (standard library only; copied into the scratch dir).

Usage: python harness.py  (reads cases.json and solution.py from the working dir).
It only computes the function's outputs for the hidden inputs; the env compares them with the
expected values outside the sandbox, so nothing printed here can claim a pass. Results go out as
one ``@@R`` JSON line per event on the original stdout; the code's own stdout/stderr are dropped.
"""

import copy
import json
import os

MARK = "@@R "
MAIN = os.getpid()
MAX_OUT = 2000  # characters of a returned value that are reported (expected values are short)


def main():
    out_fd = os.dup(1)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)

    def emit(**event):
        os.write(out_fd, (MARK + json.dumps(event) + "\n").encode())

    def guard():  # a process the code forked must never report
        if os.getpid() != MAIN:
            os._exit(0)

    def describe(e):
        msg = str(e).replace("\n", " ")[:120]
        return {"error": type(e).__name__ + (": " + msg if msg else ""), "kind": kind(e)}

    with open("cases.json") as f:
        cases = json.load(f)
    with open("solution.py") as f:
        src = f.read()
    try:
        code = compile(src, "solution.py", "exec")
    except SyntaxError as e:
        emit(event="syntax_error", error=f"line {e.lineno}: {e.msg}")
        return
    except (ValueError, MemoryError, RecursionError, OverflowError) as e:
        emit(event="syntax_error", error=type(e).__name__)
        return
    ns = {"__name__": "solution"}
    try:
        exec(code, ns)
    except BaseException as e:  # noqa: BLE001 - anything the code raises at import is its failure
        guard()
        emit(event="load_error", **describe(e))
        return
    guard()
    fn = ns.get(cases["func"])
    if not callable(fn):
        emit(event="load_error", error=f"no function named {cases['func']}", kind="missing")
        return
    for i, args in enumerate(cases["inputs"]):
        try:
            value = fn(*copy.deepcopy(args))
            try:
                text = json.dumps(value, sort_keys=True)
            except (TypeError, ValueError):
                text = json.dumps({"__repr__": repr(value)[:MAX_OUT]})
            if len(text) > MAX_OUT:
                text = json.dumps({"__repr__": repr(value)[:MAX_OUT]})
            event = {"event": "result", "i": i, "out": text}
        except BaseException as e:  # noqa: BLE001
            event = {"event": "result", "i": i, **describe(e)}
        finally:
            guard()
        emit(**event)
    emit(event="done")


def kind(e):
    if isinstance(e, MemoryError):
        return "memory"
    if isinstance(e, BlockingIOError) or (isinstance(e, OSError) and e.errno == 11):
        return "process_limit"  # fork/clone hit the process limit (EAGAIN)
    if isinstance(e, RecursionError):
        return "recursion"
    return "exception"


if __name__ == "__main__":
    main()
    os._exit(0)  # do not wait for threads the code left running
