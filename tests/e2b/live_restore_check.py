"""Live restore of E2B sandboxes (`agents.live_restore: true`), driven by the unchanged Python `e2b` SDK (2.63.0,
pinned by tests/e2b/setup.sh). sandboxd/tests/suite/e2b_live_restore.rs runs it in phases against one daemon and
restarts the daemon (SIGKILL or SIGTERM, then a new one on the same state_dir and config) between them.

Configured as a user's program is, by the environment alone: E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL.

    live_restore_check.py before
        Sandbox.create(timeout=600, metadata={"phase": "before"}), writes /home/user/before.txt, starts the ticker
        (a background command printing `tick N` every 0.2 s), reads one tick and disconnects; prints
        `STATE <json>` (sandbox_id, pid, tick, ticker_started, end_at, started_at, at).
    live_restore_check.py after STATE_JSON [rearm]
        Sandbox.connect(sandbox_id): end_at and started_at as before (to the second), the metadata, before.txt,
        after.txt written and read back, `echo hi`, the ticker in commands.list(), commands.connect(pid) receiving
        ticks above the one read before and consecutive, commands.kill(pid) ending it. When the test added `down_at`
        to the state (when the old daemon was gone, wall clock), the re-attach must also begin no later than the
        first tick written after it (what the ticker wrote while no daemon ran waits in its pipe). With `rearm`:
        set_timeout(500) and a new ticker, and a new `STATE <json>` line for the next round.
    live_restore_check.py short
        Creates a companion sandbox (timeout=600) and one with timeout=4; prints `STATE <json>` (short, long,
        created: the wall-clock time the create returned, short_end_at).
    live_restore_check.py short-after STATE_JSON
        The companion is back (connect, `echo hi`), then killed; the short one is gone by `created` + 6 s:
        get_info and connect raise NotFoundException (or SandboxNotRunningException), Sandbox.list() lacks it.
    live_restore_check.py kill SANDBOX_ID
        Sandbox.kill(SANDBOX_ID).

Every check prints `CHECK ok <name>` or `CHECK FAIL <name>: <why>`; the phase goes on after a failed check where it
can, prints `OK` at its end when every check passed, and otherwise exits 1.
"""

import json
import queue
import sys
import threading
import time
from datetime import datetime

from e2b import NotFoundException, Sandbox, SandboxNotRunningException

HOME = "/home/user"
BEFORE_TEXT = "written before the restart\n"
TICKER = "bash -c 'i=0; while true; do echo tick $i; i=$((i+1)); sleep 0.2; done'"
# How long re-attached ticks are collected after the first one.
COLLECT_SECONDS = 1.2

_failures = []


class Fatal(Exception):
    """A check the rest of the phase cannot do without."""


def check(name, fn, fatal=False):
    """Runs one check: its return value, or None after printing why it failed."""
    try:
        out = fn()
    except Exception as e:
        why = f"{type(e).__name__}: {e}".replace("\n", " ")[:600]
        print(f"CHECK FAIL {name}: {why}", flush=True)
        _failures.append(name)
        if fatal:
            raise Fatal(name) from e
        return None
    print(f"CHECK ok {name}", flush=True)
    return out


def expect(cond, why):
    if not cond:
        raise AssertionError(why)


def seconds_apart(a, b):
    return abs((a - b).total_seconds())


class Ticks:
    """The ticker's `tick N` lines from a command handle, read by a thread (so every wait has a deadline)."""

    def __init__(self, handle):
        self.handle = handle
        self.q = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        buf = ""
        try:
            for out, _err, _pty in self.handle:
                if not out:
                    continue
                buf += out
                *lines, buf = buf.split("\n")
                for line in lines:
                    self.q.put(("line", line))
            self.q.put(("end", None))
        except BaseException as e:  # reported to the main thread
            self.q.put(("error", f"{type(e).__name__}: {e}"))

    def next_event(self, until):
        left = until - time.monotonic()
        if left <= 0:
            return None
        try:
            return self.q.get(timeout=left)
        except queue.Empty:
            return None

    def first(self, within):
        """The number of the first tick line within `within` seconds."""
        until = time.monotonic() + within
        seen = []
        while True:
            ev = self.next_event(until)
            if ev is None:
                raise AssertionError(f"no tick within {within} s (other lines: {seen[-5:]!r})")
            kind, value = ev
            if kind != "line":
                raise AssertionError(f"the stream ended before a tick: {kind} {value} (lines: {seen[-5:]!r})")
            parts = value.split()
            if len(parts) == 2 and parts[0] == "tick" and parts[1].isdigit():
                return int(parts[1])
            seen.append(value)

    def collect(self, first_within, for_seconds):
        """Tick numbers: the first within `first_within` s, then all that arrive for `for_seconds` s more."""
        ticks = [self.first(first_within)]
        until = time.monotonic() + for_seconds
        while True:
            ev = self.next_event(until)
            if ev is None:
                return ticks
            kind, value = ev
            if kind != "line":
                raise AssertionError(f"the stream ended after ticks {ticks}: {kind} {value}")
            parts = value.split()
            expect(len(parts) == 2 and parts[0] == "tick" and parts[1].isdigit(), f"not a tick line: {value!r}")
            ticks.append(int(parts[1]))

    def wait_end(self, within):
        """How the stream ended ("end" or the error), or None if it did not within `within` s."""
        until = time.monotonic() + within
        while True:
            ev = self.next_event(until)
            if ev is None:
                return None
            if ev[0] != "line":
                return ev


def start_ticker(sbx):
    """Starts the ticker (no stream deadline: envd's kills the process) and reads its first tick; returns its pid,
    that tick and the wall-clock time just before it started (tick N is written no earlier than 0.2 N s later)."""
    started = time.time()
    h = sbx.commands.run(TICKER, background=True, timeout=0)
    tick = Ticks(h).first(20)
    return h.pid, tick, started


def state_line(sbx, pid, tick, started):
    info = sbx.get_info()
    state = {
        "sandbox_id": sbx.sandbox_id,
        "pid": pid,
        "tick": tick,
        "ticker_started": started,
        "end_at": info.end_at.isoformat(),
        "started_at": info.started_at.isoformat(),
        "at": time.time(),
    }
    print("STATE " + json.dumps(state), flush=True)


def before():
    sbx = check("create", lambda: Sandbox.create(timeout=600, metadata={"phase": "before"}), fatal=True)
    check("write before.txt", lambda: sbx.files.write(f"{HOME}/before.txt", BEFORE_TEXT), fatal=True)
    pid, tick, started = check("start the ticker and read a tick", lambda: start_ticker(sbx), fatal=True)
    print(f"ticker pid {pid}, read tick {tick}", flush=True)
    state_line(sbx, pid, tick, started)
    # The ticker's stream is left open by the reader thread; it closes with this process (as `disconnect`).


def after(state, rearm):
    sid, pid, last = state["sandbox_id"], state["pid"], state["tick"]
    sbx = check("connect", lambda: Sandbox.connect(sid), fatal=True)

    def info():
        got = sbx.get_info()
        end_at = datetime.fromisoformat(state["end_at"])
        started_at = datetime.fromisoformat(state["started_at"])
        expect(seconds_apart(got.end_at, end_at) < 1, f"end_at {got.end_at.isoformat()}, before {state['end_at']}")
        expect(
            seconds_apart(got.started_at, started_at) < 1,
            f"started_at {got.started_at.isoformat()}, before {state['started_at']}",
        )
        expect(got.metadata == {"phase": "before"}, f"metadata {got.metadata!r}")
        expect(got.state.value == "running", f"state {got.state!r}")

    check("get_info: end_at, started_at, metadata and state as before", info)

    def files():
        text = sbx.files.read(f"{HOME}/before.txt")
        expect(text == BEFORE_TEXT, f"before.txt holds {text!r}")

    check("read before.txt", files)

    def write_after():
        sbx.files.write(f"{HOME}/after.txt", f"written after the restart {time.time()}\n")
        text = sbx.files.read(f"{HOME}/after.txt")
        expect(text.startswith("written after the restart "), f"after.txt holds {text!r}")

    check("write and read after.txt", write_after)

    def echo():
        r = sbx.commands.run("echo hi")
        expect(r.exit_code == 0 and r.stdout == "hi\n", f"{r!r}")

    check("commands.run echo hi", echo)

    def listed():
        procs = {p.pid: p for p in sbx.commands.list()}
        expect(pid in procs, f"pid {pid} not in {sorted(procs)}")
        line = " ".join([procs[pid].cmd, *procs[pid].args])
        expect("tick" in line, f"pid {pid} is {line!r}")

    check("commands.list has the ticker", listed)

    def reattach():
        h = sbx.commands.connect(pid, timeout=0)
        expect(h.pid == pid, f"connect gave pid {h.pid}")
        ticks = Ticks(h)
        got = ticks.collect(10, COLLECT_SECONDS)
        elapsed = time.time() - state["at"]
        print(
            f"re-attached: ticks {got[0]}..{got[-1]} ({len(got)} in ~{COLLECT_SECONDS} s); read before: {last}; "
            f"{elapsed:.1f} s since (~{last + elapsed / 0.2:.0f} if none was lost or held up)",
            flush=True,
        )
        expect(got[0] > last, f"first tick after re-attach {got[0]} is not above the one read before, {last}")
        gaps = [(a, b) for a, b in zip(got, got[1:]) if b != a + 1]
        expect(not gaps, f"ticks not consecutive: gaps {gaps[:5]} in {got}")
        expect(len(got) >= 3, f"only {len(got)} ticks in ~{COLLECT_SECONDS} s: {got}")
        return ticks, got

    ticks, got = check("commands.connect(pid) gets consecutive later ticks", reattach) or (None, None)

    def held_up():
        # The tick written first after the old daemon was gone (`down_at`, from the test) is number `bound` or lower
        # (ticks are at least 0.2 s apart); no daemon ran until well after it was written, so it waited in the pipe
        # and the re-attach must begin with it or with an earlier one.
        expect(got is not None, "no ticks were received")
        down_after = state["down_at"] - state["ticker_started"]
        bound = int(down_after / 0.2) + 1
        expect(
            got[0] <= bound,
            f"the re-attach begins at tick {got[0]}, but tick {bound} or an earlier one was written after the "
            f"daemon stopped ({down_after:.1f} s after the ticker started) and before a new one ran: what the "
            f"ticker wrote while no daemon ran is not received",
        )

    if "down_at" in state:
        check("the re-attach gets the ticks written while no daemon ran", held_up)

    def kill():
        expect(sbx.commands.kill(pid) is True, "commands.kill returned False")
        if ticks is not None:
            end = ticks.wait_end(10)
            expect(end is not None, "the re-attached stream did not end within 10 s of the kill")
        deadline = time.monotonic() + 5
        while pid in {p.pid for p in sbx.commands.list()}:
            expect(time.monotonic() < deadline, f"pid {pid} still listed 5 s after commands.kill")
            time.sleep(0.1)

    check("commands.kill(pid) ends the ticker", kill)

    if rearm:
        check("set_timeout(500)", lambda: sbx.set_timeout(500))
        pid2, tick2, started2 = check("start a new ticker and read a tick", lambda: start_ticker(sbx), fatal=True)
        print(f"new ticker pid {pid2}, read tick {tick2}", flush=True)
        state_line(sbx, pid2, tick2, started2)


def short():
    long = check("create the companion", lambda: Sandbox.create(timeout=600, metadata={"phase": "long"}), fatal=True)
    s = check("create with timeout=4", lambda: Sandbox.create(timeout=4, metadata={"phase": "short"}), fatal=True)
    created = time.time()
    info = check("get_info of the short one", s.get_info, fatal=True)
    print(
        "STATE "
        + json.dumps(
            {
                "short": s.sandbox_id,
                "long": long.sandbox_id,
                "created": created,
                "short_end_at": info.end_at.isoformat(),
            }
        ),
        flush=True,
    )


def short_after(state):
    created = state["created"]
    print(f"short-after starts {time.time() - created:.1f} s after the create", flush=True)

    def companion():
        long = Sandbox.connect(state["long"])
        r = long.commands.run("echo hi")
        expect(r.stdout == "hi\n", f"{r!r}")

    check("the companion is back after the restart", companion)

    def gone_now():
        """Why the short sandbox is not gone, or None."""
        try:
            info = Sandbox.get_info(state["short"])
            return f"get_info answers {info.state!r}, end_at {info.end_at.isoformat()}"
        except NotFoundException:
            pass
        try:
            Sandbox.connect(state["short"])
            return "connect succeeds"
        except (NotFoundException, SandboxNotRunningException):
            pass
        listed = [s.sandbox_id for s in Sandbox.list().next_items()]
        if state["short"] in listed:
            return "Sandbox.list() has it"
        return None

    def gone():
        wait = created + 6 - time.time()
        if wait > 0:
            time.sleep(wait)
        first_at = time.time() - created
        why = gone_now()
        if why is None:
            print(f"gone at +{first_at:.1f} s", flush=True)
            return
        # Not gone at +6 s: how late it goes, for the report.
        deadline = max(created + 15, time.time() + 5)
        while time.time() < deadline:
            time.sleep(0.5)
            if gone_now() is None:
                raise AssertionError(
                    f"at +{first_at:.1f} s: {why}; gone only at +{time.time() - created:.1f} s "
                    f"(end_at before the restart {state['short_end_at']})"
                )
        raise AssertionError(
            f"still there at +{time.time() - created:.1f} s: {gone_now()} (end_at before the restart "
            f"{state['short_end_at']})"
        )

    check("the timeout=4 sandbox is gone 6 s after its create", gone)
    check("kill the companion", lambda: expect(Sandbox.kill(state["long"]) is True, "Sandbox.kill returned False"))


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    try:
        if mode == "before":
            before()
        elif mode == "after":
            after(json.loads(sys.argv[2]), sys.argv[3:] == ["rearm"])
        elif mode == "short":
            short()
        elif mode == "short-after":
            short_after(json.loads(sys.argv[2]))
        elif mode == "kill":
            check("kill the sandbox", lambda: expect(Sandbox.kill(sys.argv[2]) is True, "Sandbox.kill returned False"))
        else:
            sys.exit(f"unknown mode {mode!r}")
    except Fatal as e:
        print(f"stopped after the failed check {e}", flush=True)
    if _failures:
        print(f"FAILED {len(_failures)}: {', '.join(_failures)}", flush=True)
        sys.exit(1)
    print("OK", flush=True)


if __name__ == "__main__":
    main()
