# sandboxd's python context for e2b-code-interpreter's run_code: a long-lived interpreter that runs cells sent as
# JSON lines on stdin and answers with JSON lines on its stdout (the daemon's), one cell at a time. The cell's own
# stdout and stderr (python's and the file descriptors', for subprocesses) are forwarded as they are written. The
# last expression's value is the main result, with its rich representations; errors carry a traceback; SIGINT
# interrupts a cell and the context lives on. Started as `python3 -u -c <this>`.
import ast, base64, builtins, json, os, signal, sys, threading, time, traceback

PROTO = os.fdopen(os.dup(1), "w", buffering=1)
LOCK = threading.Lock()


def emit(obj):
    with LOCK:
        PROTO.write(json.dumps(obj) + "\n")
        PROTO.flush()


class Forward(threading.Thread):
    """Forwards what is written to one of the cell's descriptors (1 or 2) as stdout or stderr events."""

    def __init__(self, fd, kind):
        super().__init__(daemon=True)
        r, w = os.pipe()
        # The write end is kept apart too, so a cell that closes or replaces its descriptor gets it back.
        self.w, self.fd = w, fd
        self.restore()
        self.r, self.kind, self.marks = r, kind, {}
        self.start()

    def restore(self):
        os.dup2(self.w, self.fd)

    def run(self):
        pending = b""
        while True:
            chunk = os.read(self.r, 65536)
            if not chunk:
                return
            pending += chunk
            for mark, event in list(self.marks.items()):
                if mark in pending:
                    pending = pending.replace(mark, b"")
                    del self.marks[mark]
                    self.flush(pending)
                    pending = b""
                    event.set()
            if pending and not any(pending.endswith(m[:i]) for m in self.marks for i in range(1, len(m))):
                self.flush(pending)
                pending = b""

    def flush(self, data):
        if data:
            emit({"type": self.kind, "text": data.decode("utf-8", "replace"), "timestamp": time.time_ns() // 1000})

    def drain(self):
        """Waits until everything written to the descriptor so far has been forwarded."""
        mark = b"\x00sbx-mark-%d\x00" % time.monotonic_ns()
        event = threading.Event()
        self.marks[mark] = event
        os.write(self.w, mark)
        event.wait(5)


sys.stdout.flush()
sys.stderr.flush()
OUT = Forward(1, "stdout")
ERR = Forward(2, "stderr")
sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
os.environ.setdefault("MPLBACKEND", "Agg")

NS = {"__name__": "__main__", "__builtins__": builtins}
COUNT = 0
REPRS = [
    ("html", "_repr_html_"), ("markdown", "_repr_markdown_"), ("svg", "_repr_svg_"), ("png", "_repr_png_"),
    ("jpeg", "_repr_jpeg_"), ("latex", "_repr_latex_"), ("json", "_repr_json_"), ("javascript", "_repr_javascript_"),
    ("pdf", "_repr_pdf_"),
]


def formats(value):
    out = {"text": repr(value)}
    for key, method in REPRS:
        f = getattr(value, method, None)
        if not callable(f) or isinstance(value, type):
            continue
        try:
            data = f()
        except Exception:
            continue
        if data is None:
            continue
        if isinstance(data, tuple):
            data = data[0]
        if isinstance(data, bytes):
            data = base64.b64encode(data).decode()
        out[key] = data
    return out


def display(*values, **_):
    for v in values:
        emit({"type": "result", "is_main_result": False, **formats(v)})


NS["display"] = display


def figures():
    """matplotlib figures left open by the cell, shown as PNG, then closed (as an inline backend does)."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    import io
    for num in plt.get_fignums():
        fig = plt.figure(num)
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        emit({"type": "result", "is_main_result": False, "text": repr(fig),
              "png": base64.b64encode(buf.getvalue()).decode()})
    plt.close("all")


def run(code):
    global COUNT
    COUNT += 1
    NS["_sbx_count"] = COUNT
    tree = ast.parse(code, "<cell>", "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
    body = compile(tree, "<cell>", "exec", flags=flags)
    result = eval(body, NS)
    if hasattr(result, "__await__"):
        import asyncio
        asyncio.run(result)
    if last is not None:
        value = eval(compile(last, "<cell>", "eval", flags=flags), NS)
        if hasattr(value, "__await__"):
            import asyncio
            value = asyncio.run(value)
        figures()
        if value is not None:
            NS["_"] = value
            emit({"type": "result", "is_main_result": True, **formats(value)})
    else:
        figures()


def report(e):
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    # Only the cell's frames: drop the kernel's own.
    tb = [line for line in tb if 'File "<string>"' not in line]
    emit({"type": "error", "name": type(e).__name__, "value": str(e), "traceback": "".join(tb)})


def main():
    signal.signal(signal.SIGINT, signal.default_int_handler)
    stdin = os.fdopen(0, "r")
    while True:
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            continue
        if not line:
            return
        try:
            cell = json.loads(line)
        except ValueError:
            continue
        saved = dict(os.environ)
        try:
            os.environ.update(cell.get("env") or {})
            run(cell.get("code", ""))
        except KeyboardInterrupt as e:
            report(e)
        except SystemExit as e:
            report(e)
        except BaseException as e:
            report(e)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:
                    pass
            for forward in (OUT, ERR):
                try:
                    forward.drain()
                    forward.restore()
                except BaseException:
                    pass
            sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
            sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
            os.environ.clear()
            os.environ.update(saved)
            emit({"type": "number_of_executions", "execution_count": COUNT})
            emit({"type": "__done__"})


main()
