"""What forwarding costs on a fleet (`e2b.fleet`): `sandbox.commands.run("true")` through the unchanged Python `e2b`
SDK on one sandbox, sent to the node that holds it (direct) and to another node, which forwards it (forwarded),
interleaved call by call in a rotating order, so both are measured in the same run under the same conditions.

    E2B_API_KEY=<one of the daemons' auth.tokens> /var/cache/sandboxd-test/e2b-venv/bin/python \\
      tests/e2b/bench_fleet.py --node node-a=http://127.0.0.1:19081 --node node-b=http://127.0.0.1:19082

The nodes are named as in their `e2b.fleet.node`: a sandbox id ends in a digest of its node's name, which tells
which URL holds it. Prints p50 and p99 in ms of each, gapped (--gap-ms of sleep before each call) and sustained
(back to back), and the forwarded - direct difference of the p50s; asserts nothing about speed. The sandbox it
creates is killed before it exits, whatever the outcome.
"""

import argparse
import hashlib
import json
import statistics
import time

from e2b import Sandbox


def tag_of(node):
    return hashlib.sha256(node.encode()).hexdigest()[:8]


def pct(samples, p):
    s = sorted(samples)
    k = (len(s) - 1) * p
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def measure(direct, forwarded, rounds, gap_s):
    times = {"direct": [], "forwarded": []}
    pair = [("direct", direct), ("forwarded", forwarded)]
    for i in range(rounds):
        for name, sbx in pair if i % 2 == 0 else reversed(pair):
            if gap_s:
                time.sleep(gap_s)
            t0 = time.perf_counter()
            sbx.commands.run("true")
            times[name].append((time.perf_counter() - t0) * 1000)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--node", action="append", required=True, help="NAME=URL of a node's E2B listener (two or more)")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--gap-ms", type=float, default=50)
    args = ap.parse_args()
    nodes = dict(n.split("=", 1) for n in args.node)
    first = next(iter(nodes.values()))
    sbx = Sandbox.create(api_url=first, sandbox_url=first)
    try:
        holder = next(name for name in nodes if sbx.sandbox_id.endswith("-" + tag_of(name)))
        other = next(name for name in nodes if name != holder)
        direct = Sandbox.connect(sbx.sandbox_id, api_url=nodes[holder], sandbox_url=nodes[holder])
        forwarded = Sandbox.connect(sbx.sandbox_id, api_url=nodes[other], sandbox_url=nodes[other])
        measure(direct, forwarded, 20, 0)  # warm both paths' connections
        out = {"sandbox": sbx.sandbox_id, "holder": holder, "forwarder": other, "rounds": args.rounds}
        for mode, gap in (("gapped", args.gap_ms / 1000), ("sustained", 0)):
            times = measure(direct, forwarded, args.rounds, gap)
            row = {name: {"p50": round(statistics.median(t), 3), "p99": round(pct(t, 0.99), 3)}
                   for name, t in times.items()}
            row["forwarded_minus_direct_p50"] = round(row["forwarded"]["p50"] - row["direct"]["p50"], 3)
            out[mode] = row
        print(json.dumps(out, indent=1))
    finally:
        Sandbox.kill(sbx.sandbox_id, api_url=first)


if __name__ == "__main__":
    main()
