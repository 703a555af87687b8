"""The unchanged Python `e2b` SDK against a fleet of sandboxd nodes behind one front address, in phases that
client/tests/suite/fleet_e2b.rs runs between its own steps (SIGKILL of a node, its restart):

    fleet_check.py create N STATE      N sandboxes through the front, each given a command, a file and a background
                                       process; placement balanced; `list` pages through all N
    fleet_check.py after-kill STATE NODE
                                       the sandboxes of node NODE (killed) answer "not found" promptly,
                                       every other one finishes its background process and runs on
    fleet_check.py after-restart STATE NODE
                                       the sandboxes of that node (back with live restore) serve again, files intact
    fleet_check.py bad-input STATE NODE...
                                       a forged id naming no node, a forwarded call sent to a node that does not
                                       hold its sandbox (a loop), a wrong or missing fleet secret ($FLEET_SECRET is
                                       the right one; NODE are the nodes' own addresses): each a clear error
    fleet_check.py cleanup STATE       kills every sandbox left

Configured as a user's program is: E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL (all the front address). Prints one
line of JSON per phase with what it measured; any failed check raises (exit status 1).
"""

import collections
import concurrent.futures
import hashlib
import json
import sys
import time
import os
import uuid

import httpx
from e2b import NotFoundException, Sandbox, SandboxException, SandboxQuery

# How long a call for a sandbox of a killed node may take to fail: it must not hang.
PROMPT_S = 10.0


def tag(sandbox_id):
    return sandbox_id.rsplit("-", 1)[1]


def tag_of(node):
    """The tag of a node's sandbox ids: eight hex digits of the SHA-256 of its name."""
    return hashlib.sha256(node.encode()).hexdigest()[:8]


def create_one(suite, i):
    sbx = Sandbox.create(metadata={"suite": suite, "n": str(i)}, envs={"N": str(i)}, timeout=600)
    r = sbx.commands.run('echo "$N $((N * 2))"')
    assert r.stdout == f"{i} {i * 2}\n", r
    sbx.files.write("/home/user/note.txt", f"sandbox {i} {sbx.sandbox_id}")
    assert sbx.files.read("/home/user/note.txt") == f"sandbox {i} {sbx.sandbox_id}"
    bg = sbx.commands.run("sleep 20; echo done", background=True)
    bg.disconnect()
    return {"id": sbx.sandbox_id, "n": i, "pid": bg.pid}


def streams_through(made):
    """Output and files pass through a forwarding node as they come, byte-exact: the first line of a command arrives
    while it still runs, and 4 MiB of random bytes go up and come back unchanged, by the SDK and by a signed download
    URL fetched without the SDK's headers from each node in turn, on a few sandboxes."""
    for m in made[:3]:
        sbx = Sandbox.connect(m["id"])
        seen = []
        t0 = time.monotonic()
        sbx.commands.run("echo first; sleep 1; echo second", on_stdout=lambda line: seen.append(time.monotonic() - t0))
        end = time.monotonic() - t0
        assert len(seen) == 2 and end - seen[0] >= 0.5, f"first line at {seen} s of {end:.2f} s: held back"
        data = os.urandom(4 << 20)
        sbx.files.write("/home/user/blob", data)
        assert sbx.files.read("/home/user/blob", format="bytes") == data
        # A signed download URL, fetched as a browser would (no SDK headers), through every node of the front.
        url = sbx.download_url("/home/user/blob")
        for _ in range(3):
            r = httpx.get(url)
            assert r.status_code == 200 and r.content == data, (r.status_code, r.text[:200])


def list_all(suite, limit):
    paginator = Sandbox.list(query=SandboxQuery(metadata={"suite": suite}), limit=limit)
    ids, pages = [], 0
    while paginator.has_next:
        page = paginator.next_items()
        pages += 1
        ids.extend(s.sandbox_id for s in page)
    return ids, pages


def create(n, state_path):
    suite = uuid.uuid4().hex
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        made = list(pool.map(lambda i: create_one(suite, i), range(n)))
    took = time.monotonic() - t0
    per_node = collections.Counter(tag(m["id"]) for m in made)
    assert len(per_node) == 3, f"not every node was given sandboxes: {per_node}"
    ratio = max(per_node.values()) / min(per_node.values())
    assert ratio <= 1.3, f"placement not balanced: {per_node} (max/min {ratio:.2f})"
    streams_through(made)
    ids, pages = list_all(suite, 7)
    assert sorted(ids) == sorted(m["id"] for m in made), (len(ids), len(made))
    assert len(set(ids)) == len(ids), "a sandbox listed twice"
    with open(state_path, "w") as f:
        json.dump({"suite": suite, "sandboxes": made}, f)
    print(json.dumps({"phase": "create", "sandboxes": n, "seconds": round(took, 2),
                      "per_node": dict(per_node), "max_over_min": round(ratio, 3),
                      "listed": len(ids), "pages": pages}))


def after_kill(state_path, node):
    state, dead = json.load(open(state_path)), tag_of(node)
    slowest, errors, waiting = 0.0, collections.Counter(), []
    for m in state["sandboxes"]:
        if tag(m["id"]) == dead:
            t0 = time.monotonic()
            try:
                sbx = Sandbox.connect(m["id"])
                sbx.commands.run("true")
            except (NotFoundException, SandboxException) as e:
                errors[type(e).__name__] += 1
            else:
                raise AssertionError(f"{m['id']} of the killed node still answered")
            slowest = max(slowest, time.monotonic() - t0)
            continue
        # Reattached to every other sandbox's background process first: they all end at about the same time.
        sbx = Sandbox.connect(m["id"])
        waiting.append((m, sbx, sbx.commands.connect(m["pid"])))
    for m, sbx, handle in waiting:
        result = handle.wait()
        assert result.stdout == "done\n", result
        assert sbx.commands.run("echo $N").stdout == f"{m['n']}\n"
    assert slowest < PROMPT_S, f"a call for a killed node's sandbox took {slowest:.1f} s"
    alive = [m["id"] for m in state["sandboxes"] if tag(m["id"]) != dead]
    ids, _ = list_all(state["suite"], 100)
    assert sorted(ids) == sorted(alive), (len(ids), len(alive))
    print(json.dumps({"phase": "after-kill", "lost": sum(errors.values()), "errors": dict(errors),
                      "slowest_failure_s": round(slowest, 3), "background_finished": len(waiting),
                      "listed": len(ids)}))


def after_restart(state_path, node):
    state, back = json.load(open(state_path)), tag_of(node)
    served = 0
    for m in state["sandboxes"]:
        if tag(m["id"]) != back:
            continue
        sbx = Sandbox.connect(m["id"])
        assert sbx.files.read("/home/user/note.txt") == f"sandbox {m['n']} {m['id']}"
        assert sbx.commands.run("echo $N").stdout == f"{m['n']}\n"
        served += 1
    ids, _ = list_all(state["suite"], 100)
    assert len(ids) == len(state["sandboxes"]), (len(ids), len(state["sandboxes"]))
    print(json.dumps({"phase": "after-restart", "served_again": served, "listed": len(ids)}))


def bad_input(state_path, nodes):
    state = json.load(open(state_path))
    front = os.environ["E2B_API_URL"]
    key = {"X-API-KEY": os.environ["E2B_API_KEY"]}
    forged = "i1deadbeefdeadbeef-0badc0de"
    t0 = time.monotonic()
    try:
        Sandbox.connect(forged)
        raise AssertionError("a forged id was connected to")
    except NotFoundException:
        pass  # the SDK words it itself ("Paused sandbox ... not found"); the answers below carry the reason
    r = httpx.get(f"{front}/sandboxes/{forged}", headers=key)
    assert r.status_code == 404 and "no node of the fleet" in r.text, (r.status_code, r.text)
    r = httpx.post(f"{front}/process.Process/List", json={},
                   headers={"E2b-Sandbox-Id": forged, "X-Access-Token": "x",
                            "Content-Type": "application/json"})
    assert r.status_code == 502 and "was not found" in r.text and "no node" in r.text, (r.status_code, r.text)
    forged_s = time.monotonic() - t0
    # A call marked as forwarded, on a node that does not hold its sandbox: refused, not sent on.
    secret = {"X-Sandboxd-Fleet": os.environ["FLEET_SECRET"]}
    names = {n: httpx.get(f"http://{n}/fleet/v1/node", headers=secret).json()["node"] for n in nodes}
    sandbox = state["sandboxes"][0]["id"]
    elsewhere = next(n for n in nodes if tag(sandbox) != tag_of(names[n]))
    r = httpx.get(f"http://{elsewhere}/sandboxes/{sandbox}", headers=secret)
    assert r.status_code == 508 and "not forwarded again" in r.text, (r.status_code, r.text)
    for headers in ({"X-Sandboxd-Fleet": "wrong-secret-0123456789"}, {}):
        r = httpx.get(f"http://{nodes[0]}/fleet/v1/node", headers=headers)
        assert r.status_code == 401, (headers, r.status_code, r.text)
        r = httpx.get(f"http://{nodes[0]}/sandboxes/{sandbox}", headers={**headers, **key})
        assert r.status_code in (200, 401), (r.status_code, r.text)
        if "X-Sandboxd-Fleet" in headers:
            assert r.status_code == 401, r.text
    # A wrong API key is refused where it lands, before any forwarding.
    r = httpx.get(f"{front}/sandboxes/{sandbox}", headers={"X-API-KEY": "wrong"})
    assert r.status_code == 401, (r.status_code, r.text)
    # And the fleet serves on.
    assert Sandbox.connect(sandbox).commands.run("echo ok").stdout == "ok\n"
    print(json.dumps({"phase": "bad-input", "forged_id_s": round(forged_s, 3), "nodes": sorted(names.values())}))


def cleanup(state_path):
    state = json.load(open(state_path))
    killed = sum(1 for m in state["sandboxes"] if Sandbox.kill(m["id"]))
    ids, _ = list_all(state["suite"], 100)
    assert ids == [], ids
    print(json.dumps({"phase": "cleanup", "killed": killed}))


if __name__ == "__main__":
    phase, args = sys.argv[1], sys.argv[2:]
    {"create": lambda: create(int(args[0]), args[1]),
     "after-kill": lambda: after_kill(args[0], args[1]),
     "after-restart": lambda: after_restart(args[0], args[1]),
     "bad-input": lambda: bad_input(args[0], args[1:]),
     "cleanup": lambda: cleanup(args[0])}[phase]()
