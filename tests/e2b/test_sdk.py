"""The unchanged Python `e2b` SDK (2.63.0, pinned by tests/e2b/setup.sh) as a client of sandboxd's E2B facade.

Configured as a user's program is, by the environment alone: E2B_API_KEY (one of the daemon's `auth.tokens`),
E2B_API_URL and E2B_SANDBOX_URL (both `http://127.0.0.1:PORT`, the facade's one listener). Every sandbox a test
creates is killed by a finalizer, whatever the outcome; the template is the SDK's default, `base`.
sandboxd/tests/suite/e2b_sdk.rs runs this file against a fresh daemon and then checks that no sandbox is left.

The scenarios, by area (the wire contract: docs/spec/e2b-compat.md):
- commands: envs and metadata at create, streamed stdout, exit codes, background processes (wait, kill, a shared pid
  namespace, list, reattach), stdin, per-call envs and cwd;
- files: every call, 10 MiB byte-exact, file-like (octet-stream) and gzip uploads;
- lifecycle: set_timeout, list with a metadata filter and paging, kill, pause and resume, the async SDK;
- refusals: a wrong API key, a wrong or missing access token, symlinks and `..` towards the host's /etc/shadow, a
  write through a symlink to a host path, an unknown sandbox id.
"""

import asyncio
import hashlib
import io
import os
import tempfile
import time
import uuid

import httpx
import pytest
from packaging.version import Version

from e2b import (
    AsyncSandbox,
    AuthenticationException,
    CommandExitException,
    FileNotFoundException,
    FileType,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxNotRunningException,
    SandboxQuery,
    SandboxState,
)

# A hung stream must fail its test, not the whole run (pytest-timeout, installed by setup.sh).
pytestmark = pytest.mark.timeout(120)

ENV = ("E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL")
HOME = "/home/user"
ENVD_PORT = "49983"

# Every sandbox id this test run created and has not seen killed.
_LIVE = set()


def _kill_quietly(sandbox_id):
    try:
        Sandbox.kill(sandbox_id)
    except Exception as e:  # the finalizer must try every id
        print(f"cleanup: kill {sandbox_id}: {e!r}")
    _LIVE.discard(sandbox_id)


@pytest.fixture(scope="session", autouse=True)
def environment():
    missing = [name for name in ENV if not os.environ.get(name)]
    if missing:
        pytest.fail(f"{', '.join(missing)} not set: the suite drives a live facade (see sandboxd/tests/suite/e2b_sdk.rs)")
    yield
    for sandbox_id in sorted(_LIVE):
        _kill_quietly(sandbox_id)


@pytest.fixture
def new_sandbox():
    """Creates sandboxes (Sandbox.create's arguments) and kills them all when the test ends."""
    mine = []

    def create(**kwargs):
        sbx = Sandbox.create(**kwargs)
        mine.append(sbx.sandbox_id)
        _LIVE.add(sbx.sandbox_id)
        return sbx

    yield create
    for sandbox_id in mine:
        _kill_quietly(sandbox_id)


# The sandbox most command and file scenarios share (created once: with envs and metadata).
SBX_ENVS = {"SANDBOX_VAR": "from-create", "OTHER_VAR": "other"}
SBX_METADATA = {"suite": "e2b-sdk", "run": uuid.uuid4().hex}


@pytest.fixture(scope="module")
def sbx():
    sbx = Sandbox.create(envs=SBX_ENVS, metadata=SBX_METADATA)
    _LIVE.add(sbx.sandbox_id)
    yield sbx
    _kill_quietly(sbx.sandbox_id)


def unique(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def envd_headers(sandbox_id, token=None):
    headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": ENVD_PORT}
    if token is not None:
        headers["X-Access-Token"] = token
    return headers


def host_shadow():
    with open("/etc/shadow") as f:  # the suite runs as root on the host
        return f.read()


def assert_not_host_shadow(read, what):
    """`read()` must raise an SDK error or return something other than the host's /etc/shadow. A failure names the
    call and the size, never the content (CI logs are not the place for password hashes)."""
    try:
        got = read()
    except SandboxException:
        return
    got = bytes(got).decode(errors="replace") if isinstance(got, (bytes, bytearray)) else got
    if got.strip() == host_shadow().strip():
        pytest.fail(f"{what} returned the host's /etc/shadow ({len(got)} bytes)")


# ---------------------------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------------------------


def test_create_with_envs_and_metadata(sbx):
    r = sbx.commands.run('echo "$SANDBOX_VAR $OTHER_VAR"')
    assert r.exit_code == 0
    assert r.stdout == "from-create other\n", r
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id
    assert info.state == SandboxState.RUNNING
    for key, value in SBX_METADATA.items():
        assert info.metadata.get(key) == value, info.metadata
    assert sbx.is_running()


def test_run_streams_stdout_before_the_command_ends(sbx):
    ticks = []
    r = sbx.commands.run("echo a; sleep 1; echo b", on_stdout=lambda chunk: ticks.append((time.monotonic(), chunk)))
    ended = time.monotonic()
    assert r.stdout == "a\nb\n", r
    assert ticks, "on_stdout never fired"
    first_at, first = ticks[0]
    assert first.startswith("a"), ticks
    assert ended - first_at >= 0.5, (
        f"the first stdout chunk came {ended - first_at:.2f} s before the run returned (want >= 0.5 s): "
        f"output is not streamed as it is written; chunks {ticks}"
    )


def test_nonzero_exit_raises_with_code_and_stderr(sbx):
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo out; echo oops >&2; exit 3")
    assert e.value.exit_code == 3
    assert "oops" in e.value.stderr
    assert e.value.stdout == "out\n"


def test_background_then_wait(sbx):
    h = sbx.commands.run("sleep 0.5; echo done", background=True)
    assert h.pid > 0
    r = h.wait()
    assert r.exit_code == 0
    assert r.stdout == "done\n"


def test_background_kill(sbx):
    h = sbx.commands.run("sleep 30", background=True)
    assert h.kill() is True
    with pytest.raises(CommandExitException) as e:
        h.wait()
    assert e.value.exit_code == -1, f"a killed process reports exit code -1 (envd's convention): {e.value!r}"
    assert sbx.commands.kill(h.pid) is False, "killing a process that is gone returns False"


def test_commands_share_one_pid_namespace(sbx):
    h = sbx.commands.run("sleep 30", background=True)
    try:
        r = sbx.commands.run(f"kill -0 {h.pid} && echo alive")
        assert r.stdout == "alive\n", r
    finally:
        h.kill()


def test_list_shows_the_background_process(sbx):
    h = sbx.commands.run("sleep 31", background=True)
    try:
        procs = {p.pid: p for p in sbx.commands.list()}
        assert h.pid in procs, procs
        assert "sleep 31" in " ".join(procs[h.pid].args), procs[h.pid]
    finally:
        h.kill()
    deadline = time.monotonic() + 5
    while h.pid in {p.pid for p in sbx.commands.list()}:
        assert time.monotonic() < deadline, f"pid {h.pid} still listed 5 s after it was killed"
        time.sleep(0.1)


def test_connect_reattaches_and_receives_later_output(sbx):
    h = sbx.commands.run("sleep 1.5; echo after-reconnect", background=True)
    h.disconnect()
    again = sbx.commands.connect(h.pid)
    assert again.pid == h.pid
    r = again.wait()
    assert r.exit_code == 0
    assert "after-reconnect" in r.stdout, r


def test_stdin_send_and_close(sbx):
    h = sbx.commands.run("cat", background=True, stdin=True)
    h.send_stdin("hello\n")
    sbx.commands.send_stdin(h.pid, b"world\n")
    h.close_stdin()
    r = h.wait()
    assert r.stdout == "hello\nworld\n", r


def test_envs_per_call_override_the_sandboxs(sbx):
    r = sbx.commands.run('echo "$SANDBOX_VAR $OTHER_VAR $CALL_VAR"', envs={"SANDBOX_VAR": "from-call", "CALL_VAR": "c"})
    assert r.stdout == "from-call other c\n", r
    r = sbx.commands.run('echo "$SANDBOX_VAR"')
    assert r.stdout == "from-create\n", "a per-call env does not stick"


def test_cwd(sbx):
    d = f"{HOME}/{unique('cwd')}"
    sbx.commands.run(f"mkdir -p {d}")
    assert sbx.commands.run("pwd", cwd=d).stdout == f"{d}\n"
    assert sbx.commands.run("pwd", cwd="/tmp").stdout == "/tmp\n"


# ---------------------------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------------------------


def test_every_file_call(sbx):
    base = f"{HOME}/{unique('files')}"
    a = f"{base}/a.txt"

    info = sbx.files.write(a, "hello")
    assert (info.path, info.name) == (a, "a.txt"), info
    assert sbx.files.read(a) == "hello"
    assert sbx.commands.run(f"cat {a}").stdout == "hello", "commands and files see one tree"

    sbx.files.write(f"{base}/b.bin", b"\x00\x01\xfe\xff")
    assert sbx.files.read(f"{base}/b.bin", format="bytes") == bytearray(b"\x00\x01\xfe\xff")

    assert sbx.files.make_dir(f"{base}/d/e") is True
    assert sbx.files.make_dir(f"{base}/d/e") is False, "make_dir of an existing directory returns False"
    sbx.files.write(f"{base}/d/e/deep.txt", "deep")

    shallow = {e.path for e in sbx.files.list(base)}
    assert shallow == {a, f"{base}/b.bin", f"{base}/d"}, shallow
    two = {e.path: e for e in sbx.files.list(base, depth=2)}
    assert set(two) == {a, f"{base}/b.bin", f"{base}/d", f"{base}/d/e"}, set(two)
    assert two[f"{base}/d/e"].type == FileType.DIR
    assert two[a].type == FileType.FILE

    assert sbx.files.exists(a) is True
    assert sbx.files.exists(f"{base}/nope") is False
    st = sbx.files.get_info(a)
    assert (st.name, st.type, st.size, st.path) == ("a.txt", FileType.FILE, 5, a), st
    assert sbx.files.get_info(f"{base}/d").type == FileType.DIR
    with pytest.raises(FileNotFoundException):
        sbx.files.get_info(f"{base}/nope")
    with pytest.raises(FileNotFoundException):
        sbx.files.read(f"{base}/nope")

    c = f"{base}/c.txt"
    moved = sbx.files.rename(a, c)
    assert moved.path == c, moved
    assert sbx.files.exists(a) is False
    assert sbx.files.read(c) == "hello"

    sbx.files.remove(c)
    assert sbx.files.exists(c) is False
    sbx.files.remove(base)
    assert sbx.files.exists(base) is False, "remove takes a directory with its contents"


def test_relative_paths_resolve_against_home(sbx):
    name = f"{unique('rel')}.txt"
    sbx.files.write(name, "relative")
    assert sbx.commands.run(f"cat {HOME}/{name}").stdout == "relative"
    assert sbx.files.read(f"{HOME}/{name}") == "relative"


def test_10_mib_random_binary_is_byte_exact(sbx):
    data = os.urandom(10 << 20)
    path = f"{HOME}/{unique('big')}.bin"
    sbx.files.write(path, data)
    back = sbx.files.read(path, format="bytes")
    assert len(back) == len(data)
    assert hashlib.sha256(back).hexdigest() == hashlib.sha256(data).hexdigest()
    assert sbx.files.get_info(path).size == len(data)
    r = sbx.commands.run(f"sha256sum {path}")
    assert r.stdout.split()[0] == hashlib.sha256(data).hexdigest(), "the sandbox holds the same bytes"
    sbx.files.remove(path)


def test_write_file_like_and_gzip_uploads(sbx):
    # From envd 0.5.7 the SDK sends these as `application/octet-stream` (gzip: Content-Encoding: gzip, iterables
    # chunked); below it silently falls back to multipart, so the advertised version is part of the scenario.
    assert Version(sbx.get_info().envd_version) >= Version("0.5.7")
    base = f"{HOME}/{unique('octet')}"
    data = os.urandom(300_000)
    sbx.files.write(f"{base}/io.bin", io.BytesIO(data))
    assert sbx.files.read(f"{base}/io.bin", format="bytes") == data
    sbx.files.write(f"{base}/gz.txt", "squeeze me " * 10_000, gzip=True)
    assert sbx.files.read(f"{base}/gz.txt") == "squeeze me " * 10_000
    sbx.files.write(f"{base}/io-gz.bin", io.BytesIO(data), gzip=True)
    assert sbx.files.read(f"{base}/io-gz.bin", format="bytes") == data
    sbx.files.write(f"{base}/chunks.txt", (f"chunk {i}\n".encode() for i in range(1000)))
    assert sbx.files.read(f"{base}/chunks.txt") == "".join(f"chunk {i}\n" for i in range(1000))
    sbx.files.remove(base)


# ---------------------------------------------------------------------------------------------------------------
# Lifecycle
# ---------------------------------------------------------------------------------------------------------------


def test_set_timeout_ends_the_sandbox(new_sandbox):
    s = new_sandbox()
    s.set_timeout(3)
    t0 = time.monotonic()
    assert s.is_running()
    time.sleep(5)
    deadline = t0 + 15
    while s.is_running() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not s.is_running(), f"still running {time.monotonic() - t0:.1f} s after set_timeout(3)"
    with pytest.raises(SandboxException) as e:
        s.commands.run("echo still here")
    assert not isinstance(e.value, CommandExitException), e.value
    with pytest.raises(NotFoundException):
        s.get_info()


def test_list_with_a_metadata_filter_and_paging(new_sandbox, sbx):
    tag = unique("list")
    ids = {new_sandbox(metadata={"list": tag, "i": str(i)}).sandbox_id for i in range(5)}
    paginator = Sandbox.list(query=SandboxQuery(metadata={"list": tag}), limit=2)
    seen, pages = [], 0
    while paginator.has_next:
        page = paginator.next_items()
        pages += 1
        assert len(page) <= 2, f"page {pages} has {len(page)} sandboxes with limit=2"
        for s in page:
            assert s.metadata.get("list") == tag, s
        seen += [s.sandbox_id for s in page]
        assert pages <= 10, "the paginator does not end"
    assert sorted(seen) == sorted(ids), f"every sandbox once across {pages} pages: {seen}"
    assert pages >= 3
    assert sbx.sandbox_id not in seen, "the filter leaves out other sandboxes"
    one = Sandbox.list(query=SandboxQuery(metadata={"list": tag, "i": "3"})).next_items()
    assert len(one) == 1 and one[0].metadata["i"] == "3", one


def test_kill(new_sandbox):
    s = new_sandbox()
    assert s.kill() is True
    assert not s.is_running()
    with pytest.raises(NotFoundException):
        s.get_info()
    assert Sandbox.kill(s.sandbox_id) is False, "killing a sandbox that is gone returns False"
    with pytest.raises(SandboxNotRunningException):
        s.commands.run("echo gone")


def test_pause_then_connect_resumes(new_sandbox):
    s = new_sandbox()
    s.files.write(f"{HOME}/kept.txt", "kept")
    assert s.pause() is True
    assert s.get_info().state == SandboxState.PAUSED
    resumed = Sandbox.connect(s.sandbox_id)
    assert resumed.get_info().state == SandboxState.RUNNING
    assert resumed.commands.run("echo resumed").stdout == "resumed\n"
    assert resumed.files.read(f"{HOME}/kept.txt") == "kept"


def test_async_sdk():
    async def scenario():
        s = await AsyncSandbox.create(envs={"ASYNC_VAR": "async"}, metadata={"suite": "e2b-sdk-async"})
        _LIVE.add(s.sandbox_id)
        try:
            ticks = []
            r = await s.commands.run(
                'echo "$ASYNC_VAR"; sleep 1; echo b', on_stdout=lambda c: ticks.append((time.monotonic(), c))
            )
            ended = time.monotonic()
            assert r.stdout == "async\nb\n", r
            assert ticks and ended - ticks[0][0] >= 0.5, f"async on_stdout not streamed: {ticks}, end {ended}"
            path = f"{HOME}/{unique('async')}.bin"
            data = os.urandom(100_000)
            await s.files.write(path, data)
            assert await s.files.read(path, format="bytes") == data
            assert await s.kill() is True
            assert not await s.is_running()
        finally:
            _kill_quietly(s.sandbox_id)

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------------------------


def test_wrong_api_key_is_refused():
    wrong = f"wrong-{uuid.uuid4().hex}"
    with pytest.raises(AuthenticationException):
        s = Sandbox.create(api_key=wrong)
        _kill_quietly(s.sandbox_id)  # reached only when the key was wrongly accepted
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key=wrong).next_items()
    r = httpx.get(f"{os.environ['E2B_API_URL']}/v2/sandboxes")
    assert r.status_code == 401, f"no X-API-KEY: {r.status_code} {r.text}"


def test_wrong_or_missing_access_token_is_refused(sbx):
    url = os.environ["E2B_SANDBOX_URL"]
    for token in ("wrong-" + uuid.uuid4().hex, None):
        r = httpx.get(f"{url}/files", params={"path": f"{HOME}/x"}, headers=envd_headers(sbx.sandbox_id, token))
        assert r.status_code == 401, f"/files with access token {token!r}: {r.status_code} {r.text}"
        r = httpx.post(
            f"{url}/process.Process/List",
            content=b"{}",
            headers={**envd_headers(sbx.sandbox_id, token), "Content-Type": "application/json"},
        )
        assert r.status_code == 401, f"Process/List with access token {token!r}: {r.status_code} {r.text}"
    # The right token opens the same door (so the 401s above are about the token).
    r = httpx.get(
        f"{url}/health", headers=envd_headers(sbx.sandbox_id, sbx._envd_access_token)
    )
    assert r.is_success, f"/health with the sandbox's token: {r.status_code} {r.text}"


def test_symlinks_do_not_read_the_hosts_files(sbx):
    sbx.commands.run(f"ln -sfn /etc/shadow {HOME}/s && ln -sfn ../../etc/shadow {HOME}/rel-s && ln -sfn /etc {HOME}/etc")
    assert_not_host_shadow(lambda: sbx.files.read(f"{HOME}/s"), "files.read through a symlink to /etc/shadow")
    assert_not_host_shadow(lambda: sbx.files.read(f"{HOME}/rel-s"), "files.read through a relative symlink")
    assert_not_host_shadow(lambda: sbx.files.read(f"{HOME}/etc/shadow"), "files.read through a symlinked directory")
    assert_not_host_shadow(lambda: sbx.files.read(f"{HOME}/s", format="bytes"), "files.read bytes via symlink")


def test_a_write_through_a_symlink_stays_in_the_sandbox(sbx):
    host_dir = tempfile.mkdtemp(prefix="e2b-sdk-symlink-")
    target = os.path.join(host_dir, "planted")
    try:
        sbx.commands.run(f"ln -sfn {target} {HOME}/w && ln -sfn {host_dir} {HOME}/wdir")
        for path in (f"{HOME}/w", f"{HOME}/wdir/planted"):
            try:
                sbx.files.write(path, "from the sandbox")
            except SandboxException:
                pass
            assert not os.path.exists(target), f"files.write({path!r}) wrote the host's {target}"
    finally:
        if os.path.exists(target):
            os.remove(target)
        os.rmdir(host_dir)


def test_dot_dot_does_not_reach_the_hosts_files(sbx):
    for path in ("../../../../etc/shadow", f"{HOME}/../../../../etc/shadow", "/etc/shadow"):
        assert_not_host_shadow(lambda: sbx.files.read(path), f"files.read({path!r})")
    # The same on the wire, with the sandbox's own (valid) access token.
    r = httpx.get(
        f"{os.environ['E2B_SANDBOX_URL']}/files",
        params={"path": "../../../../etc/shadow"},
        headers=envd_headers(sbx.sandbox_id, sbx._envd_access_token),
    )
    if r.status_code == 200 and r.text.strip() == host_shadow().strip():
        pytest.fail("GET /files?path=../../../../etc/shadow returned the host's /etc/shadow")


def test_unknown_sandbox_id():
    r = httpx.get(f"{os.environ['E2B_SANDBOX_URL']}/health", headers=envd_headers("nope"))
    assert r.status_code == 502, f"{r.status_code} {r.text}"
    assert "was not found" in r.text, r.text
    with pytest.raises(NotFoundException):
        Sandbox.get_info("nope")
    assert Sandbox.kill("nope") is False
    with pytest.raises(NotFoundException):
        Sandbox.connect("nope")


def test_malformed_connect_requests_get_a_clear_error_and_the_listener_serves_on(sbx):
    url = os.environ["E2B_SANDBOX_URL"]
    headers = {
        **envd_headers(sbx.sandbox_id, sbx._envd_access_token),
        "Content-Type": "application/connect+json",
        "Connect-Protocol-Version": "1",
    }
    # A stream request whose envelope says 1000 bytes and carries 3; one that is not JSON; a unary one that is
    # not JSON.
    for body in (b"\x00\x00\x00\x03\xe8{}\n", b"\x00\x00\x00\x00\x05hello"):
        r = httpx.post(f"{url}/process.Process/Start", content=body, headers=headers)
        text = r.content.decode("utf-8", "replace")
        assert r.status_code != 500 and "invalid_argument" in text, f"{body!r}: {r.status_code} {text}"
    r = httpx.post(
        f"{url}/process.Process/List",
        content=b"{not json",
        headers={**envd_headers(sbx.sandbox_id, sbx._envd_access_token), "Content-Type": "application/json"},
    )
    assert r.status_code == 400 and "invalid_argument" in r.text, f"{r.status_code} {r.text}"
    # An RPC that does not exist is `unimplemented`, never a bare 404 (the SDK would read "not found").
    r = httpx.post(
        f"{url}/process.Process/Nope",
        content=b"{}",
        headers={**envd_headers(sbx.sandbox_id, sbx._envd_access_token), "Content-Type": "application/json"},
    )
    assert r.status_code == 501 and "unimplemented" in r.text, f"{r.status_code} {r.text}"
    # The same sandbox still answers.
    assert sbx.commands.run("echo still").stdout == "still\n"


def test_an_upload_over_the_limit_is_refused_and_leaves_no_file(sbx):
    # The suite's daemon has e2b.max_upload_mb: 16.
    url = os.environ["E2B_SANDBOX_URL"]
    big = os.urandom(17 << 20)
    r = httpx.post(
        f"{url}/files",
        params={"path": f"{HOME}/too-big.bin"},
        content=big,
        headers={
            **envd_headers(sbx.sandbox_id, sbx._envd_access_token),
            "Content-Type": "application/octet-stream",
        },
        timeout=60,
    )
    assert r.status_code == 413, f"{r.status_code} {r.text}"
    assert not sbx.files.exists(f"{HOME}/too-big.bin"), "a refused upload left its partial file"
    sbx.files.write(f"{HOME}/after.txt", "fine")
    assert sbx.files.read(f"{HOME}/after.txt") == "fine"


def test_get_metrics(sbx):
    sbx.commands.run("python3 -c 'x = bytearray(32 << 20); import time; time.sleep(0.2)'")
    metrics = sbx.get_metrics()
    assert len(metrics) >= 1, metrics
    m = metrics[-1]
    assert m.cpu_count >= 1 and m.mem_total > 0 and m.mem_used > 0, m


def test_killing_a_paused_sandbox_is_prompt_and_the_host_creates_on(new_sandbox):
    s = new_sandbox()
    assert s.pause()
    t0 = time.monotonic()
    assert Sandbox.kill(s.sandbox_id) is True
    assert time.monotonic() - t0 < 5, f"kill of a paused sandbox took {time.monotonic() - t0:.1f} s"
    assert new_sandbox().commands.run("echo on").stdout == "on\n"


def test_a_command_ends_with_its_sandbox(new_sandbox):
    s = new_sandbox()
    handle = s.commands.run("sleep 30", background=True)
    assert Sandbox.kill(s.sandbox_id) is True
    with pytest.raises(SandboxException) as e:
        handle.wait()
    assert not isinstance(e.value, CommandExitException), f"a killed sandbox's command ended as a command: {e.value!r}"


def test_signed_urls_work_without_the_sdks_headers(sbx):
    import urllib.error
    import urllib.request

    sbx.files.write(f"{HOME}/signed.txt", "signed")
    with urllib.request.urlopen(sbx.download_url(f"{HOME}/signed.txt")) as r:
        assert r.read() == b"signed"
    expired = sbx.download_url(f"{HOME}/signed.txt", use_signature_expiration=-120)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(expired)
    assert e.value.code == 401
