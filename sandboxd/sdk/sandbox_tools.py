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
with open(_os.path.join(_HERE, "sandbox_tools.json"), encoding="utf-8") as _f:
    _LISTED = _json.load(_f)
# The socket's limits: connections served at once per execution, and the longest request line.
_MAX_CONNECTIONS = max(1, int(_LISTED.get("max_connections") or 8))
_MAX_LINE = int(_LISTED.get("max_line_bytes") or (1 << 20))


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


# Connections to the daemon: it serves one request at a time per connection and at most `max_connections`
# connections per execution, so a thread holds a connection only while its call is in flight. A thread takes an idle
# connection or opens one (at most _MAX_CONNECTIONS), else waits; after the reply it hands the connection to a
# waiting thread or closes it, so an idle thread (or process) never keeps one from the others.
_cond = _threading.Condition()
_idle = []
_state = {"open": 0, "waiting": 0}
# Every open connection, idle or in flight.
_conns = set()
# Connections inherited by a forked child: detached from their descriptors and kept, never closed (a thread of the
# parent may have held the reader's lock at the fork).
_orphans = []


def _reset_after_fork():
    # The child must not keep the parent's connections open (the daemon would see them as busy until the child
    # exits): it closes its copies of the descriptors and starts without connections.
    global _cond
    _cond = _threading.Condition()
    for conn in list(_conns):
        try:
            fd = conn[0].detach()
            if fd >= 0:
                _os.close(fd)
        except OSError:
            pass
        _orphans.append(conn)
    _conns.clear()
    _idle.clear()
    _state.update(open=0, waiting=0)


if hasattr(_os, "register_at_fork"):
    _os.register_at_fork(after_in_child=_reset_after_fork)


def _take():
    with _cond:
        while not _idle and _state["open"] >= _MAX_CONNECTIONS:
            _state["waiting"] += 1
            try:
                _cond.wait()
            finally:
                _state["waiting"] -= 1
        if _idle:
            return _idle.pop()
        _state["open"] += 1
    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            sock.connect(_SOCKET)
        except BaseException:
            sock.close()
            raise
        conn = (sock, sock.makefile("rb"))
        with _cond:
            _conns.add(conn)
    except BaseException as e:
        _give(None)
        if isinstance(e, OSError):
            raise ToolError("closed", f"Cannot connect to the tool socket: {e}") from None
        raise
    return conn


def _give(conn, reusable=False):
    """Hands `conn` to a waiting thread if it is still good, else closes it and frees its place."""
    with _cond:
        if conn is not None and reusable and _state["waiting"] > len(_idle):
            _idle.append(conn)
            _cond.notify()
            return
        _state["open"] -= 1
        _cond.notify()
        _conns.discard(conn)
    if conn is not None:
        conn[1].close()
        conn[0].close()


def _request(message):
    line = (_json.dumps(message, separators=(",", ":"), default=_jsonable) + "\n").encode()
    if len(line) - 1 > _MAX_LINE:
        raise ToolError("invalid", f"The request is {len(line) - 1} bytes, over the tool socket's limit of {_MAX_LINE}")
    conn = _take()
    sock, reader = conn
    reusable = False
    try:
        try:
            sock.sendall(line)
            reply = reader.readline()
        except OSError as e:
            # The daemon may have answered before it closed the connection (a line over its limit).
            reply = _read_left(reader)
            if not reply:
                raise ToolError("closed", f"The tool socket failed: {e}") from None
        if not reply:
            raise ToolError("closed", "The tool socket closed")
        try:
            decoded = _json.loads(reply)
        except ValueError:
            raise ToolError("invalid", f"Unreadable reply from the tool socket: {reply[:200]!r}") from None
        # After `invalid` the daemon may have closed the connection: the next call uses a fresh one.
        reusable = (decoded.get("error") or {}).get("code") != "invalid"
        return decoded
    finally:
        _give(conn, reusable)


def _read_left(reader):
    try:
        return reader.readline()
    except OSError:
        return b""


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
    tools = {}
    for t in _LISTED["tools"]:
        tools[t["name"]] = _make(t["name"], list(t.get("params") or []), t.get("description"))
    return tools


_TOOLS = _load()
globals().update(_TOOLS)
__all__ += list(_TOOLS)
