# sandboxd's bash context for e2b-code-interpreter's run_code: one bash whose variables, functions and directory
# persist between cells, driven by this python: cells arrive as JSON lines on stdin, and the cell's stdout and
# stderr go out as JSON lines on stdout as they are written, then the cell's end. A cell that ends non-zero is an
# error naming its exit status. Started as `python3 -u -c <this>` in the context's directory.
import json, os, shlex, subprocess, sys, threading, time

PROTO = os.fdopen(os.dup(1), "w", buffering=1)
LOCK = threading.Lock()
MARK = "\x1esbx-end\x1e"


def emit(obj):
    with LOCK:
        PROTO.write(json.dumps(obj) + "\n")
        PROTO.flush()


bash = subprocess.Popen(["bash", "--noprofile", "--norc"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, bufsize=0)
STATUS = {}


def forward(pipe, kind, done):
    pending = b""
    mark = MARK.encode()
    while True:
        chunk = os.read(pipe.fileno(), 65536)
        if not chunk:
            done.set()
            return
        pending += chunk
        while mark in pending:
            before, _, pending = pending.partition(mark)
            if kind == "stdout":
                status, _, pending = pending.partition(b"\n")
                STATUS["last"] = int(status or b"0")
            if before:
                emit({"type": kind, "text": before.decode("utf-8", "replace"), "timestamp": time.time_ns() // 1000})
            done.set()
        keep = max((i for i in range(1, len(mark)) if pending.endswith(mark[:i])), default=0)
        out, pending = (pending[:-keep], pending[-keep:]) if keep else (pending, b"")
        if out:
            emit({"type": kind, "text": out.decode("utf-8", "replace"), "timestamp": time.time_ns() // 1000})


events = {"stdout": threading.Event(), "stderr": threading.Event()}
threading.Thread(target=forward, args=(bash.stdout, "stdout", events["stdout"]), daemon=True).start()
threading.Thread(target=forward, args=(bash.stderr, "stderr", events["stderr"]), daemon=True).start()
count = 0
for line in sys.stdin:
    try:
        cell = json.loads(line)
    except ValueError:
        continue
    count += 1
    env = cell.get("env") or {}
    pre = "".join(f"__sbx_old_{i}=${{{k}-}}; export {k}={shlex.quote(v)}\n" for i, (k, v) in enumerate(env.items())
                  if k.isidentifier())
    post = "".join(f"export {k}=\"$__sbx_old_{i}\"\n" for i, (k, v) in enumerate(env.items()) if k.isidentifier())
    for e in events.values():
        e.clear()
    script = (pre + cell.get("code", "") + "\n__sbx_status=$?\n" + post +
              f"printf '%s%d\\n' $'\\x1esbx-end\\x1e' \"$__sbx_status\"\nprintf '%s' $'\\x1esbx-end\\x1e' >&2\n")
    try:
        bash.stdin.write(script.encode())
        bash.stdin.flush()
    except BrokenPipeError:
        pass
    for e in events.values():
        e.wait()
    if bash.poll() is not None:
        emit({"type": "error", "name": "BashExited", "value": f"bash exited with status {bash.returncode}",
              "traceback": ""})
        emit({"type": "number_of_executions", "execution_count": count})
        emit({"type": "__done__"})
        break
    status = STATUS.get("last", 0)
    if status != 0:
        emit({"type": "error", "name": "Error", "value": f"exit status {status}", "traceback": ""})
    emit({"type": "number_of_executions", "execution_count": count})
    emit({"type": "__done__"})
