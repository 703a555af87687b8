"""How fast the unchanged Python `e2b` SDK (2.63.0, pinned by tests/e2b/setup.sh) drives sandboxd's E2B facade.

Prints figures and asserts nothing about speed. Configured as the scenario suite (test_sdk.py) is, by the
environment alone: E2B_API_KEY (one of the daemon's `auth.tokens`), E2B_API_URL and E2B_SANDBOX_URL (the facade's
listener). Runs as a plain client of the facade; the only thing it reads on the host is each sandbox's memory
cgroup (and, with --daemon-pid, the daemon's VmRSS and `--version`), so it needs root for the memory figures.

    E2B_API_KEY=... E2B_API_URL=http://127.0.0.1:19071 E2B_SANDBOX_URL=http://127.0.0.1:19071 \\
      /var/cache/sandboxd-test/e2b-venv/bin/python tests/e2b/bench.py --daemon-pid <sandboxd's pid>

What it measures, in ms (p50 / p99, the p99 interpolated between the two nearest samples; with 50 samples it is
about the second-worst):
- `Sandbox.create()`, --create-rounds times one after the other; each sandbox is killed right after (`kill()`
  timed apart).
- `sandbox.commands.run("true")` on one warm sandbox, --rounds times, gapped (--gap-ms of sleep before each call)
  and sustained (back to back), interleaved call by call with three baselines on the same sandbox, so the SDK's own
  cost is measured in the same run under the same conditions:
    raw bash: the Start RPC the SDK sends (`/bin/bash -l -c true`) as one raw Connect request (JSON codec, one
              envelope) over plain httpx with one kept-alive connection, the whole streamed answer read;
    raw true: the same request running `/bin/true` directly (raw bash − raw true is bash's login start);
    health:   `GET /health` on the same connection (the HTTP floor of the sandbox plane).
  The order of the four calls rotates from round to round.
- memory per idle sandbox: --idle sandboxes created, each one's memory cgroup found from a process started in it (a
  background `sleep` with a unique argument, found in the host's /proc, then killed; `cat /proc/self/cgroup` inside
  says only `/`, the container has a cgroup namespace of its own), 2 s of quiet, then the sum of their cgroups' usage
  (v1 memory.usage_in_bytes, v2 memory.current) / K, the daemon's VmRSS growth / K, and the summed Pss of the
  processes left in each cgroup / K (a cgroup is charged only for pages first touched inside it).
Every sandbox it creates is killed before it exits, whatever the outcome.
"""

import argparse
import importlib.metadata
import json
import os
import platform
import struct
import subprocess
import sys
import time
import uuid

import httpx

from e2b import Sandbox

ENV = ("E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL")
ENVD_PORT = "49983"
START = "/process.Process/Start"

# Every sandbox id created and not yet killed (killed on the way out).
_LIVE = set()


def percentile(samples, q):
    """Linear interpolation between the two nearest ranks (numpy's default)."""
    s = sorted(samples)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def p50(samples):
    return percentile(samples, 0.50)


def p99(samples):
    return percentile(samples, 0.99)


def ms(seconds):
    return seconds * 1000.0


def create():
    sbx = Sandbox.create()
    _LIVE.add(sbx.sandbox_id)
    return sbx


def kill(sbx):
    try:
        sbx.kill()
    finally:
        _LIVE.discard(sbx.sandbox_id)


def kill_quietly(sandbox_id):
    try:
        Sandbox.kill(sandbox_id)
    except Exception as e:  # every id must be tried
        print(f"cleanup: kill {sandbox_id}: {e!r}", file=sys.stderr)
    _LIVE.discard(sandbox_id)


# ---------------------------------------------------------------------------------------------------------------
# The raw Connect client (the baselines)


def envelope(message):
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", 0, len(data)) + data


def start_body(cmd, args):
    return envelope({"process": {"cmd": cmd, "args": args}, "stdin": False})


def envelopes(body):
    """The (flags, json) of each envelope of a Connect streaming answer."""
    out = []
    i = 0
    while i + 5 <= len(body):
        flags, length = struct.unpack(">BI", body[i : i + 5])
        out.append((flags, json.loads(body[i + 5 : i + 5 + length] or b"{}")))
        i += 5 + length
    if i != len(body):
        raise RuntimeError(f"a truncated envelope: {len(body) - i} bytes left")
    return out


class Raw:
    """One httpx client (one kept-alive HTTP/1.1 connection) speaking to one sandbox's envd as the SDK does."""

    def __init__(self, sbx):
        self.base = sbx.envd_api_url.rstrip("/")
        token = sbx._envd_access_token  # where SandboxBase keeps envdAccessToken from the create's answer
        self.headers = {"e2b-sandbox-id": sbx.sandbox_id, "e2b-sandbox-port": ENVD_PORT}
        if token:
            self.headers["x-access-token"] = token
        self.client = httpx.Client(
            timeout=30.0, limits=httpx.Limits(max_connections=1, max_keepalive_connections=1)
        )
        self.rpc_headers = {
            **self.headers,
            "content-type": "application/connect+json",
            "connect-protocol-version": "1",
        }
        self.bash = start_body("/bin/bash", ["-l", "-c", "true"])
        self.true = start_body("/bin/true", [])

    def start(self, body):
        """One Start RPC, the whole stream read; returns (seconds, body) and checks it after the clock stops."""
        t0 = time.perf_counter()
        r = self.client.post(self.base + START, content=body, headers=self.rpc_headers)
        content = r.content
        elapsed = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"Start: HTTP {r.status_code}: {content[:200]!r}")
        frames = envelopes(content)
        if not frames or frames[-1][0] != 2 or "error" in frames[-1][1]:
            raise RuntimeError(f"Start: no clean end of stream: {frames[-1:]!r}")
        ends = [f for fl, f in frames if fl == 0 and "end" in f.get("event", {})]
        if not ends or ends[0]["event"]["end"].get("exitCode", 0) != 0:
            raise RuntimeError(f"Start: the process did not exit 0: {ends!r}")
        return elapsed

    def health(self):
        t0 = time.perf_counter()
        r = self.client.get(self.base + "/health", headers=self.headers)
        r.read()
        elapsed = time.perf_counter() - t0
        if r.status_code not in (200, 204):
            raise RuntimeError(f"/health: HTTP {r.status_code}")
        return elapsed

    def close(self):
        self.client.close()


# ---------------------------------------------------------------------------------------------------------------
# The measurements


def bench_create(rounds):
    created, killed = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        sbx = create()
        created.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        kill(sbx)
        killed.append(time.perf_counter() - t0)
    return created, killed


def bench_run(sbx, raw, rounds, gap):
    def sdk():
        t0 = time.perf_counter()
        result = sbx.commands.run("true")
        elapsed = time.perf_counter() - t0
        if result.exit_code != 0:
            raise RuntimeError(f"commands.run('true'): exit code {result.exit_code}")
        return elapsed

    calls = {
        "sdk": sdk,
        "raw bash": lambda: raw.start(raw.bash),
        "raw true": lambda: raw.start(raw.true),
        "health": raw.health,
    }
    names = list(calls)
    samples = {name: [] for name in names}
    for i in range(rounds):
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            if gap:
                time.sleep(gap)
            samples[name].append(calls[name]())
    return samples


def host_pid_of(marker, deadline=5.0):
    """The host pid of the process whose command line holds `marker`."""
    end = time.monotonic() + deadline
    needle = marker.encode()
    while time.monotonic() < end:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"sleep") and needle in argv:
                return int(entry)
        time.sleep(0.05)
    raise RuntimeError(f"no host process with {marker} in its command line")


def memory_file(pid):
    """The memory usage file of the cgroup `pid` is in (v1 memory controller, else v2's unified one)."""
    with open(f"/proc/{pid}/cgroup") as f:
        lines = [line.rstrip("\n").split(":", 2) for line in f]
    for _, controllers, path in lines:
        if "memory" in controllers.split(","):
            return f"/sys/fs/cgroup/memory{path}/memory.usage_in_bytes"
    for hid, controllers, path in lines:
        if hid == "0" and controllers == "":
            for root in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"):
                candidate = f"{root}{path}/memory.current"
                if os.path.exists(candidate):
                    return candidate
    raise RuntimeError(f"/proc/{pid}/cgroup names no memory cgroup: {lines!r}")


def pss(cgroup_file):
    """The summed Pss of the processes in the cgroup of `cgroup_file` (what they cost, wherever charged)."""
    total = 0
    with open(os.path.join(os.path.dirname(cgroup_file), "cgroup.procs")) as f:
        pids = f.read().split()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total, len(pids)


def vm_rss(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS")


def bench_idle(k, daemon_pid):
    rss_before = vm_rss(daemon_pid) if daemon_pid else None
    sandboxes = [create() for _ in range(k)]
    files = []
    for sbx in sandboxes:
        # A unique duration names the process on the host; the sleep is killed before the memory is read.
        marker = f"1000.{uuid.uuid4().int % 10**9:09d}"
        handle = sbx.commands.run(f"sleep {marker}", background=True)
        files.append(memory_file(host_pid_of(marker)))
        sbx.commands.kill(handle.pid)
    time.sleep(2.0)
    usage, psss, procs = [], [], []
    for path in files:
        with open(path) as f:
            usage.append(int(f.read()))
        p, n = pss(path)
        psss.append(p)
        procs.append(n)
    rss_after = vm_rss(daemon_pid) if daemon_pid else None
    for sbx in sandboxes:
        kill(sbx)
    distinct = len(set(files))
    return {
        "cgroup_sum": sum(usage),
        "cgroup_min": min(usage),
        "cgroup_max": max(usage),
        "distinct": distinct,
        "pss_sum": sum(psss),
        "procs": sorted(set(procs)),
        "file": files[0],
        "rss_growth": None if rss_before is None else rss_after - rss_before,
    }


# ---------------------------------------------------------------------------------------------------------------
# Reporting


def versions(daemon_pid, envd_version):
    out = []
    if daemon_pid:
        try:
            exe = os.readlink(f"/proc/{daemon_pid}/exe")
            v = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
            out.append(f"{v} ({exe})")
        except Exception as e:
            out.append(f"sandboxd ? ({e!r})")
    else:
        out.append("sandboxd ? (no --daemon-pid)")
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        rev = subprocess.run(
            ["git", "-C", here, "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        if rev:
            out.append(f"checkout {rev}")
    except Exception:
        pass
    out.append(f"envd {envd_version}")
    out.append(f"e2b {importlib.metadata.version('e2b')}")
    out.append(f"httpx {httpx.__version__}")
    out.append(f"python {platform.python_version()}")
    return ", ".join(out)


def row(name, samples, width=36):
    return f"{name:<{width}} {ms(p50(samples)):>8.2f} {ms(p99(samples)):>8.2f} {len(samples):>5}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=200, help="commands.run rounds per mode (default 200)")
    parser.add_argument("--create-rounds", type=int, default=50, help="Sandbox.create rounds (default 50)")
    parser.add_argument("--gap-ms", type=float, default=100.0, help="sleep before each gapped call (default 100)")
    parser.add_argument("--idle", type=int, default=20, help="idle sandboxes for the memory figures (default 20)")
    parser.add_argument("--daemon-pid", type=int, help="sandboxd's pid, for its RSS growth and --version")
    parser.add_argument("--warmup", type=int, default=10, help="untimed rounds of each call first (default 10)")
    args = parser.parse_args()

    missing = [name for name in ENV if not os.environ.get(name)]
    if missing:
        sys.exit(f"{', '.join(missing)} not set: the bench drives a live facade (see docs/spec/e2b-compat.md)")

    began = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    t_start = time.monotonic()
    try:
        created, killed = bench_create(args.create_rounds) if args.create_rounds else ([], [])

        sbx = create()
        raw = Raw(sbx)
        try:
            envd_version = sbx._envd_version
            bench_run(sbx, raw, args.warmup, 0)
            gapped = bench_run(sbx, raw, args.rounds, args.gap_ms / 1000.0)
            sustained = bench_run(sbx, raw, args.rounds, 0)
        finally:
            raw.close()
            kill(sbx)

        idle = bench_idle(args.idle, args.daemon_pid) if args.idle else None
    finally:
        for sandbox_id in sorted(_LIVE):
            kill_quietly(sandbox_id)

    print(f"# e2b SDK bench, {began}, {time.monotonic() - t_start:.0f} s, {os.cpu_count()} cores, {platform.release()}")
    print(f"# {versions(args.daemon_pid, envd_version)}")
    print(f"# {' '.join(sys.argv)}")
    print(f"{'ms':<36} {'p50':>8} {'p99':>8} {'n':>5}")
    if created:
        print(row("Sandbox.create()", created))
        print(row("sandbox.kill()", killed))
    for mode, samples in ((f"gapped {args.gap_ms:g} ms", gapped), ("sustained", sustained)):
        for name in ("sdk", "raw bash", "raw true", "health"):
            label = {"sdk": 'commands.run("true")'}.get(name, name)
            print(row(f"{mode}: {label}", samples[name]))
    print("p50 ratios and differences (ms)      sdk/raw bash  sdk-raw bash  raw bash-raw true  raw true-health")
    for mode, samples in ((f"gapped {args.gap_ms:g} ms", gapped), ("sustained", sustained)):
        m = {name: p50(s) for name, s in samples.items()}
        print(
            f"{mode:<36} {m['sdk'] / m['raw bash']:>12.2f} {ms(m['sdk'] - m['raw bash']):>13.2f}"
            f" {ms(m['raw bash'] - m['raw true']):>18.2f} {ms(m['raw true'] - m['health']):>16.2f}"
        )
    if idle:
        k = args.idle
        mib = 1024.0 * 1024.0
        line = (
            f"idle sandbox memory (K={k}), MiB/sandbox: cgroup {idle['cgroup_sum'] / k / mib:.2f}"
            f" (min {idle['cgroup_min'] / mib:.2f}, max {idle['cgroup_max'] / mib:.2f})"
        )
        if idle["rss_growth"] is not None:
            line += f", daemon RSS {idle['rss_growth'] / k / 1024:+.0f} KiB"
        line += f", Pss of its processes {idle['pss_sum'] / k / mib:.2f}"
        print(line)
        print(
            f"  {idle['distinct']} distinct cgroups, {'/'.join(map(str, idle['procs']))} process(es) each,"
            f" e.g. {idle['file']}"
        )
        print(
            "  (the cgroup holds only pages first touched inside it: the init's binary, shared with the daemon, is\n"
            "   charged elsewhere; Pss counts every page its processes map, shared pages divided among their users)"
        )


if __name__ == "__main__":
    main()
