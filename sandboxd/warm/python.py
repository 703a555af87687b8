# sandboxd's warm python stub: started ahead of time as `python3 -c <this> SKIP [MODULE...] FD`, it imports the
# preload modules and waits on descriptor FD for the launch (the init passes sandboxd's launch message on: stdin,
# stdout, stderr and a memfd with the arguments and environment). It then runs the program as
# `python3 <args[SKIP]> <args[SKIP+1:]...>` would: the launch's descriptors become 0, 1 and 2, its environment
# replaces this one, sys.argv, sys.orig_argv and sys.path[0] are the script's, and the code runs as a fresh
# `__main__` module, compiled with the script's path as file name. An exception leaving the program is passed on
# to the interpreter without this stub's frames, so tracebacks, SystemExit and KeyboardInterrupt end the process
# as they end a plain one.
#
# A program that ends without an exception, or with SystemExit and an integer code, is ended the way the
# interpreter's own exit would end it up to what a program can observe (threads joined, atexit handlers, the
# program's modules cleared and collected so their finalizers run, stdio flushed), then with os._exit: the rest of
# the interpreter's tear-down is its own memory, which the exit frees anyway. Anything else (another exception,
# threads still running, a failed flush, interactive inspection) is left to the interpreter's own exit.
#
# Right before that os._exit the stub closes its stdio and reports `exit N` in a datagram to the init's abstract
# unix socket `sandboxd-warm-end` (in the container's own network namespace): the init then need not wait for the
# kernel to free the interpreter's memory to know the program's end. The program keeps no descriptor of the stub's.
import sys


def _sandboxd_launch(os, fd):
    # The launch's payload (runtime::launch::send_strings): the count of arguments, then the arguments and the
    # environment, each string ended by a NUL, decoded as JSON's UTF-8 would be.
    chunks, offset = [], 0
    while True:
        chunk = os.pread(fd, 1 << 20, offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    os.close(fd)
    items = b"".join(chunks).split(b"\0")
    count = int(items[0])
    strings = [s.decode("utf-8", "surrogateescape") for s in items[1:-1]]
    return strings[:count], strings[count:]


def _sandboxd_warm():
    # Only modules built into the interpreter, or loaded by every start anyway: a plain start of the script has no
    # more (json, socket and the re, enum and collections they import cost about 10 ms of CPU per container).
    import builtins
    import gc
    import os
    import _socket

    # What _sandboxd_exit imports, loaded now.
    import atexit
    import _thread
    import _weakref

    # importlib.machinery's SourceFileLoader, from the bootstrap module every start loads.
    SourceFileLoader = sys.modules["_frozen_importlib_external"].SourceFileLoader

    skip, fd = int(sys.argv[1]), int(sys.argv[-1])
    for name in sys.argv[2:-1]:
        # The image's preload list, each module checked at start by the self-test. One that fails here all the same
        # (a limit of the pooled container) fails again in the program that imports it, as without preloading.
        try:
            __import__(name)
        except Exception:
            pass
    # The first compile of bytes costs about 1.5 ms (codec look-ups), and the objects of the start-up are frozen: a
    # collection while the program runs, and the one at its exit, does not walk them again.
    compile(b"", "<sandboxd-warm>", "exec", dont_inherit=True)
    # The launch's own steps run once ahead, on a scratch memfd and a variable of their own (set and removed): a
    # first run of each costs about 0.25 ms more.
    scratch = os.memfd_create("sandboxd-warm", os.MFD_CLOEXEC)
    os.write(scratch, b"1\0/\0A=b\0")
    _sandboxd_launch(os, scratch)
    os.environ["SANDBOXD_WARM"] = "1"
    del os.environ["SANDBOXD_WARM"]
    os.path.dirname(os.path.realpath("/"))
    gc.collect()
    gc.freeze()
    channel = _socket.socket(fileno=fd)
    try:
        msg, ancillary, _, _ = channel.recvmsg(64, _socket.CMSG_SPACE(4 * 4), _socket.MSG_CMSG_CLOEXEC)
    finally:
        channel.close()
    fds = []
    for level, kind, data in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            fds += [int.from_bytes(data[i : i + 4], sys.byteorder, signed=True) for i in range(0, len(data) & ~3, 4)]
    if msg != b"launch" or len(fds) != 4:
        os._exit(125)
    args, env = _sandboxd_launch(os, fds[3])
    for target, src in enumerate(fds[:3]):
        os.dup2(src, target)
        os.close(src)
    started_with_path = os.environ.get("PYTHONPATH")
    os.environ.clear()
    for item in env:
        key, _, value = item.partition("=")
        os.environ[key] = value
    script = args[skip]
    sys.orig_argv = list(args)
    sys.argv = args[skip:]
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    if not started_with_path:
        # A PYTHONPATH of the launch's (the tool runner's /sandbox) goes where a plain start puts it: right after the
        # script's directory. (When the image sets PYTHONPATH, the daemon gives a launch with tools a plain start.)
        sys.path[1:1] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    main = type(sys)("__main__")
    main.__dict__.update(
        __file__=script,
        __builtins__=builtins,
        __loader__=SourceFileLoader("__main__", script),
        __cached__=None,
        __annotations__={},
    )
    sys.modules["__main__"] = main
    with open(script, "rb") as f:
        source = f.read()
    code = compile(source, script, "exec", dont_inherit=True)
    # The report's socket type, taken now: the program may replace socket.socket (gevent, proxies).
    return code, main.__dict__, (set(sys.modules), (_socket.socket, _socket.AF_UNIX, _socket.SOCK_DGRAM))


def _sandboxd_flushed():
    # As the interpreter's exit flushes: a closed or missing stream is skipped; False when a flush fails (the
    # interpreter's own exit then flushes again and reports it).
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except BaseException:
            return False
    return True


def _sandboxd_clear(module):
    # As the interpreter clears a module at exit: the names starting with a single underscore first, then all but
    # __builtins__.
    d = module.__dict__
    for name in list(d):
        if type(name) is str and name[:1] == "_" and name[1:2] != "_":
            d[name] = None
    for name in list(d):
        if name != "__builtins__":
            d[name] = None


def _sandboxd_report(os, sock, status):
    # The output is written: stdio closed (the daemon sees end of file unless the program kept a copy), then the
    # report. Whatever fails here (an audit hook of the program's, say) leaves the end to the exit that follows.
    for fd in (0, 1, 2):
        try:
            os.close(fd)
        except OSError:
            pass
    end = None
    try:
        socket_type, family, kind = sock
        end = socket_type(family, kind)
        # Never waits: a full queue (the init no longer reading) leaves the end to the exit.
        end.setblocking(False)
        end.sendto(b"exit %d\n" % (status & 0xFF), b"\0sandboxd-warm-end")
    except BaseException:
        pass
    finally:
        if end is not None:
            try:
                end.close()
            except BaseException:
                pass


def _sandboxd_exit(status, started):
    import atexit
    import builtins
    import gc
    import os
    import _thread
    import _weakref

    started, sock = started
    if sys.flags.inspect or os.environ.get("PYTHONINSPECT"):
        return
    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            threading._shutdown()
        except BaseException:
            return
    atexit._run_exitfuncs()
    # A thread still running (a daemon thread) would run on while the modules are cleared: the interpreter's exit
    # stops such threads first, which only it can do.
    if not _sandboxd_flushed() or _thread._count():
        return
    # From here as the interpreter's finalize_modules: the special names of sys and builtins cleared (nothing can
    # be imported any more), the original stdio back, sys.modules emptied, a collection (the program's module and
    # what only it held are finalized with their globals intact), then the program's modules that are still
    # alive cleared, the last imported first, and a last collection. The interpreter's own modules, imported
    # before the program and frozen, are left as they are.
    builtins._ = None
    for name in ("path", "argv", "ps1", "ps2", "last_exc", "last_type", "last_value", "last_traceback",
                 "path_hooks", "path_importer_cache", "meta_path", "__interactivehook__"):
        setattr(sys, name, None)
    for name in ("stdin", "stdout", "stderr"):
        setattr(sys, name, getattr(sys, "__%s__" % name, None))
    program = [
        _weakref.ref(m)
        for n, m in sys.modules.items()
        if (n not in started or n == "__main__") and type(m) is type(sys)
    ]
    sys.modules.clear()
    gc.collect()
    for ref in reversed(program):
        module = ref()
        if module is not None:
            _sandboxd_clear(module)
        del module
    gc.collect()
    if _sandboxd_flushed():
        try:
            _sandboxd_report(os, sock, status)
        finally:
            os._exit(status)


_sandboxd_status = None
try:
    _sandboxd_code, _sandboxd_globals, _sandboxd_started = _sandboxd_warm()
    exec(_sandboxd_code, _sandboxd_globals)
    _sandboxd_status = 0
except BaseException as _e:
    _c = getattr(_e, "code", None)
    if type(_e) is SystemExit and (_c is None or (type(_c) in (int, bool) and -(2**31) <= _c < 2**31)):
        _sandboxd_status = int(_c or 0)
    else:
        # The program's own frames only: this module's and _sandboxd_warm's are dropped (a SyntaxError keeps none,
        # as when the interpreter compiles the script itself). A bare raise adds no frame of its own.
        _t = _e.__traceback__
        while _t is not None and _t.tb_frame.f_code in (_sandboxd_warm.__code__, sys._getframe().f_code):
            _t = _t.tb_next
        _e.__traceback__ = _t
        del _t
        raise
# Outside the except clause, with the exception dropped, as the interpreter's exit runs: atexit handlers see no
# exception being handled, and the frames it held are finalized.
del _sandboxd_globals, _sandboxd_code
_sandboxd_exit(_sandboxd_status, _sandboxd_started)
raise SystemExit(_sandboxd_status)
