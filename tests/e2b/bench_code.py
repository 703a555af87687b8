"""Stateful code contexts through the unchanged e2b-code-interpreter: `run_code("1+1")` on a warm context, the first
cell of a new context (its kernel's start included), and memory per idle python context (the sum of its kernel's
processes' Pss, found on the host by the kernel's pid namespace). Prints figures; asserts nothing about speed.
Configured as test_sdk.py is (E2B_API_KEY, E2B_API_URL, E2B_SANDBOX_URL). Usage: bench_code.py [--rounds N]
"""

import argparse
import statistics
import time

from e2b_code_interpreter import Sandbox


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def pss_of(pid_marker):
    """Pss (MiB) of the host processes whose command line holds `pid_marker`."""
    import os
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            if pid_marker.encode() not in cmd:
                continue
            for line in open(f"/proc/{pid}/smaps_rollup"):
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--contexts", type=int, default=10)
    args = ap.parse_args()
    s = Sandbox.create()
    try:
        s.run_code("1+1")
        warm = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            r = s.run_code("1+1")
            warm.append((time.perf_counter() - t) * 1000)
            assert r.text == "2", r
        first = []
        contexts = []
        for _ in range(args.contexts):
            t = time.perf_counter()
            c = s.create_code_context()
            r = s.run_code("1+1", context=c)
            first.append((time.perf_counter() - t) * 1000)
            assert r.text == "2", r
            contexts.append(c)
        time.sleep(1)
        # The kernels are `python3 -u -c <kernel>`: their command lines hold the kernel's first line.
        pss = pss_of("sandboxd's python context") / (args.contexts + 1)
        print("ms                                         p50      p99     n")
        print(f"run_code('1+1'), warm context        {statistics.median(warm):8.2f} {pct(warm, 99):8.2f} {len(warm):5d}")
        print(f"create_code_context + first cell     {statistics.median(first):8.2f} {pct(first, 99):8.2f} {len(first):5d}")
        print(f"idle python context, Pss MiB each    {pss:8.2f}")
    finally:
        s.kill()


main()
