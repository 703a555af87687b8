"""Runs the code of an execution with tools (sandboxd writes this file; see sandbox_tools.py).

The code runs as the body of a function, with every tool in scope: a top-level `return` ends it with that value,
and when the last statement is an expression, its value is returned. A returned value other than None is sent to
the daemon, which reports it as `result.return_value` (as JSON; what JSON cannot hold is sent as its repr).
"""

import ast
import sys
import traceback


def main():
    import sandbox_tools

    path = sys.argv[1]
    with open(path, encoding="utf-8") as f:
        source = f.read()
    try:
        module = ast.parse(source, filename=path)
    except SyntaxError:
        traceback.print_exc(limit=0)
        return 1
    body = module.body
    if body and isinstance(body[-1], ast.Expr):
        last = body[-1]
        body[-1] = ast.copy_location(ast.Return(value=last.value), last)
    wrapper = ast.parse("def __sandbox_main__():\n    pass\n", filename=path)
    wrapper.body[0].body = body or [ast.Pass()]
    ast.fix_missing_locations(wrapper)
    scope = {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__}
    scope.update(sandbox_tools._TOOLS)
    scope["call"] = sandbox_tools.call
    scope["ToolError"] = sandbox_tools.ToolError
    try:
        exec(compile(wrapper, path, "exec"), scope)
        value = scope["__sandbox_main__"]()
    except SystemExit:
        raise
    except BaseException as e:  # the program's own error: show its traceback without this runner's frames
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != path:
            tb = tb.tb_next
        traceback.print_exception(type(e), e, tb)
        return 1
    if value is not None:
        sys.stdout.flush()
        sandbox_tools._return(value)
    return 0


sys.exit(main())
