#!/usr/bin/env python3
"""A client that is not the project's own: Python's `websockets`, as a new user would write it.

Run by `cargo bench -p sandboxd` (sandboxd/benches/latency.rs) against the same daemon as the Rust client, and by
hand: `plain_client.py PORT TOKEN [SAMPLES]`. Each execution is sent after the previous result on one connection,
with a bare spawn of the same program interleaved; then executions per second with 4 in flight (one connection
per worker). Prints one JSON object on stdout: per case the execute->result (or first stdout byte) times in ms of
the sandbox and of the bare spawn, and the throughput.

`plain_client.py PORT TOKEN --series LANGUAGE CODE RUNS GAP_MS`: RUNS executions of CODE on one connection, each
sent GAP_MS after the previous result (0: back to back, the sustained figure; 100: gapped, each from a full pool),
after 5 unrecorded ones; prints the execute->result p50 and p90 in ms.
"""

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

import websockets

CASES = [
    # name, language, host program, code, measure the first stdout byte
    ("shell `true`", "shell", "/bin/sh", "true\n", False),
    ("python `pass`", "python", "/usr/bin/python3", "pass\n", False),
    ("shell first stdout byte", "shell", "/bin/sh", "echo x\n", True),
]


def connect(port, token):
    headers = {"Authorization": f"Bearer {token}"}
    url = f"ws://127.0.0.1:{port}/ws"
    if int(websockets.__version__.split(".")[0]) >= 14:  # the new asyncio client
        return websockets.connect(url, additional_headers=headers)
    return websockets.connect(url, extra_headers=headers)  # Debian bookworm ships 10.4


def message(exec_id, language, code):
    # The README's example, with only the required limits: everything else at its default.
    return json.dumps({
        "v": 1, "type": "execute", "id": exec_id, "ts": "2026-01-01T00:00:00.000Z",
        "language": language, "code": code, "limits": {"timeout_ms": 5000, "memory_mb": 128},
    })


async def execute(ws, exec_id, language, code, first_byte):
    t0 = time.perf_counter()
    await ws.send(message(exec_id, language, code))
    first = None
    while True:
        msg = json.loads(await ws.recv())
        if msg.get("id") != exec_id:
            continue
        if msg["type"] == "stdout" and first is None:
            first = time.perf_counter() - t0
        elif msg["type"] == "result":
            if msg.get("exit_code") != 0:
                raise SystemExit(f"execution failed: {msg}")
            total = time.perf_counter() - t0
            return (first if first_byte else total) * 1000.0
        elif msg["type"] == "error":
            raise SystemExit(f"execution refused: {msg}")


def bare(program, code, first_byte, tmp):
    path = os.path.join(tmp, "main")
    with open(path, "w") as f:
        f.write(code)
    t0 = time.perf_counter()
    p = subprocess.Popen([program, path], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    first = None
    while True:
        chunk = p.stdout.read1(4096)
        if not chunk:
            break
        if first is None:
            first = time.perf_counter() - t0
    p.wait()
    total = time.perf_counter() - t0
    return (first if first_byte else total) * 1000.0


async def series(port, token, lang, code, runs, gap_ms):
    async with connect(port, token) as ws:
        times = []
        for i in range(5 + runs):
            t = await execute(ws, f"s-{lang}-{i}", lang, code, False)
            if i >= 5:
                times.append(t)
            if gap_ms:
                await asyncio.sleep(gap_ms / 1000.0)
    times.sort()
    print(json.dumps({"language": lang, "runs": runs, "gap_ms": gap_ms,
                      "p50_ms": round(times[len(times) // 2], 2), "p90_ms": round(times[len(times) * 9 // 10], 2)}))


async def main():
    port, token = int(sys.argv[1]), sys.argv[2]
    if len(sys.argv) > 3 and sys.argv[3] == "--series":
        lang, code, runs, gap_ms = sys.argv[4], sys.argv[5], int(sys.argv[6]), float(sys.argv[7])
        await series(port, token, lang, code + "\n", runs, gap_ms)
        return
    samples = int(sys.argv[3]) if len(sys.argv) > 3 else 80
    out = {"client": f"python websockets {websockets.__version__}", "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        async with connect(port, token) as ws:
            for name, lang, program, code, first_byte in CASES:
                for i in range(5):
                    await execute(ws, f"pw-{lang}-{i}-{first_byte}", lang, code, first_byte)
                    bare(program, code, first_byte, tmp)
                sbx, ref = [], []
                for i in range(samples):
                    sbx.append(await execute(ws, f"p-{lang}-{i}-{first_byte}", lang, code, first_byte))
                    ref.append(bare(program, code, first_byte, tmp))
                out["cases"][name] = {"sandbox_ms": sbx, "bare_ms": ref}

        # Throughput: 4 connections, each sending its next execution after the previous result.
        runs, conc = 96, 4

        async def worker(w):
            async with connect(port, token) as ws:
                i = w
                while i < runs:
                    await execute(ws, f"pt-{i}", "shell", "true\n", False)
                    i += conc

        t0 = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(conc)))
        out["throughput"] = {"concurrency": conc, "runs": runs,
                             "exec_per_s": runs / (time.perf_counter() - t0)}
    print(json.dumps(out))


asyncio.run(main())
