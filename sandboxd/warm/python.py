# sandboxd's warm python stub: started ahead of time as `python3 -c <this> SKIP [MODULE...] FD`, it imports the
# preload modules and waits on descriptor FD for the launch (the init passes sandboxd's launch message on: stdin,
# stdout, stderr and a memfd with the arguments and environment). It then runs the program as
# `python3 <args[SKIP]> <args[SKIP+1:]...>` would: the launch's descriptors become 0, 1 and 2, its environment
# replaces this one, sys.argv, sys.orig_argv and sys.path[0] are the script's, and the code runs as a fresh
# `__main__` module, compiled with the script's path as file name. An exception leaving the program is passed on
# to the interpreter without this stub's frames, so tracebacks, SystemExit and KeyboardInterrupt end the process
# as they end a plain one.
import sys


def _sandboxd_warm():
    import builtins
    import json
    import os
    import socket
    import types
    from importlib.machinery import SourceFileLoader

    skip, fd = int(sys.argv[1]), int(sys.argv[-1])
    for name in sys.argv[2:-1]:
        # The image's preload list, each module checked at start by the self-test. One that fails here all the same
        # (a limit of the pooled container) fails again in the program that imports it, as without preloading.
        try:
            __import__(name)
        except Exception:
            pass
    channel = socket.socket(fileno=fd)
    try:
        msg, fds, _, _ = socket.recv_fds(channel, 64, 4, socket.MSG_CMSG_CLOEXEC)
    finally:
        channel.close()
    if msg != b"launch" or len(fds) != 4:
        os._exit(125)
    with os.fdopen(fds[3], "rb") as payload:
        payload.seek(0)
        launch = json.loads(payload.read())
    for target, src in enumerate(fds[:3]):
        os.dup2(src, target)
        os.close(src)
    started_with_path = os.environ.get("PYTHONPATH")
    os.environ.clear()
    for item in launch["env"]:
        key, _, value = item.partition("=")
        os.environ[key] = value
    args = launch["args"]
    script = args[skip]
    sys.orig_argv = list(args)
    sys.argv = args[skip:]
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    if not started_with_path:
        # A PYTHONPATH of the launch's (the tool runner's /sandbox) goes where a plain start puts it: right after the
        # script's directory. (When the image sets PYTHONPATH, the daemon gives a launch with tools a plain start.)
        sys.path[1:1] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    main = types.ModuleType("__main__")
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
    return compile(source, script, "exec", dont_inherit=True), main.__dict__


try:
    exec(*_sandboxd_warm())
except BaseException as _e:
    # The program's own frames only: this module's and _sandboxd_warm's are dropped (a SyntaxError keeps none,
    # as when the interpreter compiles the script itself). A bare raise adds no frame of its own.
    _t = _e.__traceback__
    while _t is not None and _t.tb_frame.f_code in (_sandboxd_warm.__code__, sys._getframe().f_code):
        _t = _t.tb_next
    _e.__traceback__ = _t
    del _t
    raise
