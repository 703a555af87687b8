"""Tools of this execution, called through sandboxd (the `tool_calls` extension of FSP/1).

sandboxd writes this file next to the code of an execution whose request lists tools. Every tool is a function
of the same name (also importable: `from sandbox_tools import call, read_file`); a call goes over the unix
socket /sandbox/tools.sock to the daemon, which forwards it to the orchestrator and returns its answer.

    text = read_file("notes.txt")          # positional arguments follow the tool's schema
    hits = grep(content=text, pattern="x") # or keywords
    call("read_file", {"path": "a"})       # the generic form
    bash("make", timeout=600, _timeout_ms=700_000)  # _timeout_ms: wait less than the execution's per-call timeout

A JSON object in a result reads as attributes too (`result.exit_code`). A failed call raises ToolError with
`.code`: not_allowed, timeout, tool_error, invalid, limit or closed.
"""

# Private aliases: a tool may be named like a module (json, os, ...) without breaking the SDK.
import json as _json
import os as _os
import socket as _socket
import threading as _threading

__all__ = ["call", "ToolError", "Result"]

_SOCKET = _os.environ.get("SANDBOX_TOOLS_SOCKET", "/sandbox/tools.sock")
_HERE = _os.path.dirname(_os.path.abspath(__file__))


class ToolError(Exception):
    """A tool call failed; `code` says how, `message` why."""

    def __init__(self, code, message):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Result(dict):
    """A JSON object whose keys also read as attributes."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _wrap(value):
    if isinstance(value, dict):
        return Result((k, _wrap(v)) for k, v in value.items())
    if isinstance(value, list):
        return [_wrap(v) for v in value]
    return value


def _jsonable(value):
    return repr(value)


# One connection per thread: the daemon answers one request at a time per connection, so threads calling tools at
# once each get their own.
_local = _threading.local()


def _request(message):
    line = (_json.dumps(message, separators=(",", ":"), default=_jsonable) + "\n").encode()
    conn = getattr(_local, "conn", None)
    if conn is None:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        sock.connect(_SOCKET)
        conn = _local.conn = (sock, sock.makefile("rb"))
    sock, reader = conn
    try:
        sock.sendall(line)
        reply = reader.readline()
    except OSError as e:
        _local.conn = None
        raise ToolError("closed", f"The tool socket failed: {e}") from None
    if not reply:
        _local.conn = None
        raise ToolError("closed", "The tool socket closed")
    return _json.loads(reply)


def call(name, args=None, timeout_ms=None, **kwargs):
    """Calls the tool `name` with the arguments `args` (a dict) and/or keywords; returns its result."""
    merged = dict(args or {})
    merged.update(kwargs)
    message = {"op": "call", "name": name, "args": merged}
    if timeout_ms is not None:
        message["timeout_ms"] = int(timeout_ms)
    reply = _request(message)
    if reply.get("ok"):
        return _wrap(reply.get("result"))
    error = reply.get("error") or {}
    raise ToolError(error.get("code", "error"), error.get("message", ""))


def _return(value):
    """Sends the program's return value (the runner calls this)."""
    reply = _request({"op": "return", "value": value})
    if not reply.get("ok"):
        error = reply.get("error") or {}
        raise ToolError(error.get("code", "error"), error.get("message", ""))


def _make(name, params, doc):
    def tool(*args, _timeout_ms=None, **kwargs):
        if len(args) == 1 and not kwargs and isinstance(args[0], dict) and not params:
            return call(name, args[0], timeout_ms=_timeout_ms)
        if len(args) > len(params):
            raise TypeError(f"{name}() takes {len(params)} positional arguments ({', '.join(params)}), got {len(args)}")
        merged = dict(zip(params, args))
        for key in kwargs:
            if key in merged:
                raise TypeError(f"{name}() got multiple values for argument {key!r}")
        merged.update(kwargs)
        return call(name, merged, timeout_ms=_timeout_ms)

    tool.__name__ = tool.__qualname__ = name
    tool.__doc__ = doc or f"The tool {name}."
    return tool


def _load():
    with open(_os.path.join(_HERE, "sandbox_tools.json"), encoding="utf-8") as f:
        listed = _json.load(f)["tools"]
    tools = {}
    for t in listed:
        tools[t["name"]] = _make(t["name"], list(t.get("params") or []), t.get("description"))
    return tools


_TOOLS = _load()
globals().update(_TOOLS)
__all__ += list(_TOOLS)
