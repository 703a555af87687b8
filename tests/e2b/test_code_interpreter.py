"""e2b-code-interpreter (pinned, unchanged) against sandboxd's stateful code contexts (docs/spec/e2b-compat.md).

Configured by the environment alone, as test_sdk.py is. The default template is e2b-code-interpreter's own
(`code-interpreter-v1`, sandboxd's base image). Rich results that need libraries the image lacks (pandas,
matplotlib) are not asked for here.
"""

import time

import httpx
import pytest
from e2b_code_interpreter import Sandbox
from e2b import SandboxException

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def sbx():
    s = Sandbox.create()
    yield s
    try:
        s.kill()
    except Exception:
        pass


def test_state_carries_over_between_cells(sbx):
    assert sbx.run_code("x = 1").error is None
    r = sbx.run_code("x + 1")
    assert r.error is None and r.text == "2", r
    assert r.execution_count == 2


def test_an_error_has_a_traceback_and_the_context_lives_on(sbx):
    sbx.run_code("x = 41")
    r = sbx.run_code("1/0")
    assert r.error is not None and r.error.name == "ZeroDivisionError", r
    assert "Traceback" in r.error.traceback and "ZeroDivisionError" in r.error.traceback
    assert sbx.run_code("x + 1").text == "42"


def test_stdout_streams_before_a_slow_cell_ends(sbx):
    t0 = time.monotonic()
    ticks = []
    r = sbx.run_code(
        "import time\nprint('a', flush=True)\ntime.sleep(1)\nprint('b')",
        on_stdout=lambda m: ticks.append(time.monotonic() - t0),
    )
    end = time.monotonic() - t0
    assert r.logs.stdout == ["a\n", "b\n"], r.logs
    assert ticks and end - ticks[0] >= 0.5, f"first stdout at {ticks}, the cell ended at {end:.2f} s"


def test_a_cell_past_its_timeout_is_interrupted_and_the_next_runs(sbx):
    sbx.run_code("y = 7")
    with pytest.raises(Exception):
        sbx.run_code("import time; time.sleep(60)", timeout=2)
    t0 = time.monotonic()
    r = sbx.run_code("y * 6")
    assert r.text == "42", r
    assert time.monotonic() - t0 < 10, "the next cell waited for the interrupted one"


def test_two_contexts_do_not_share_variables_and_restart_clears(sbx):
    a = sbx.create_code_context()
    b = sbx.create_code_context()
    sbx.run_code("secret = 1", context=a)
    r = sbx.run_code("secret", context=b)
    assert r.error is not None and r.error.name == "NameError", r
    assert sbx.run_code("secret", context=a).text == "1"
    ids = {c.id for c in sbx.list_code_contexts()}
    assert {a.id, b.id} <= ids
    sbx.restart_code_context(a)
    r = sbx.run_code("secret", context=a)
    assert r.error is not None and r.error.name == "NameError", r
    sbx.remove_code_context(b)
    assert b.id not in {c.id for c in sbx.list_code_contexts()}


def test_javascript_and_bash_contexts_keep_state(sbx):
    assert sbx.run_code("let z = 2; const f = (n) => n * z", language="javascript").error is None
    r = sbx.run_code("f(21)", language="javascript")
    assert r.text == "42", r
    assert sbx.run_code("v=hello; cd /tmp", language="bash").error is None
    r = sbx.run_code("echo $v; pwd", language="bash")
    assert r.logs.stdout == ["hello\n/tmp\n"] or "".join(r.logs.stdout) == "hello\n/tmp\n", r.logs
    r = sbx.run_code("false", language="bash")
    assert r.error is not None, r


def test_envs_per_call_and_rich_reprs(sbx):
    r = sbx.run_code("import os\nprint(os.environ.get('Q'))", envs={"Q": "w"})
    assert r.logs.stdout == ["w\n"], r.logs
    assert sbx.run_code("print(os.environ.get('Q'))").logs.stdout == ["None\n"]
    r = sbx.run_code("class H:\n    def _repr_html_(self): return '<b>h</b>'\nH()")
    assert r.results and r.results[0].html == "<b>h</b>" and r.results[0].is_main_result, r.results
    r = sbx.run_code("display(H()); 5")
    assert [x.html for x in r.results if not x.is_main_result] == ["<b>h</b>"], r.results


def test_bad_input_gets_a_clear_error_and_the_sandbox_lives_on(sbx):
    url = sbx.connection_config.get_sandbox_url(sbx.sandbox_id, sbx.sandbox_domain)
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._envd_access_token}
    r = httpx.post(f"{url}/execute", json={"code": "1", "context_id": "nope"}, headers=headers)
    assert r.status_code == 404, r.text
    r = httpx.post(f"{url}/execute", json={"code": "1", "language": "cobol"}, headers=headers)
    assert r.status_code == 400 and "cobol" in r.text, r.text
    r = httpx.post(f"{url}/execute", json={"code": "1"}, headers={"E2b-Sandbox-Id": sbx.sandbox_id})
    assert r.status_code == 401, r.text
    # 100 MB of output, streamed to the end.
    n = [0]
    r = sbx.run_code("import sys\nfor _ in range(100):\n    sys.stdout.write('x' * (1 << 20))", on_stdout=lambda m: n.__setitem__(0, n[0] + len(m.line)), timeout=120)
    assert n[0] >= 100 << 20, n[0]
    # Past the memory limit: the kernel is killed, the cell says so, the next cell starts a new one.
    r = sbx.run_code("b = bytearray(2 << 30)")
    assert r.error is not None, r
    assert sbx.run_code("1 + 1").text == "2"
    # Forking until the sandbox's pids limit says no: the cell gets EAGAIN, not the host; its children end and are
    # reaped, and the context goes on.
    bomb = (
        "import os, time\n"
        "pids = []\n"
        "try:\n"
        "    while len(pids) < 100000:\n"
        "        p = os.fork()\n"
        "        if p == 0:\n"
        "            time.sleep(2)\n"
        "            os._exit(0)\n"
        "        pids.append(p)\n"
        "except OSError as e:\n"
        "    print('refused', e.errno, len(pids) > 100)\n"
        "for p in pids:\n"
        "    os.waitpid(p, 0)\n"
    )
    r = sbx.run_code(bomb, timeout=60)
    assert r.error is None and r.logs.stdout == ["refused 11 True\n"], (r.error, r.logs)
    assert sbx.run_code("2 + 2").text == "4"
    # A cell that closes its own stdout: the context restarts.
    sbx.run_code("import os; os.close(1)")
    assert sbx.run_code("3 + 3").text == "6"
    assert sbx.commands.run("echo alive").stdout == "alive\n"
