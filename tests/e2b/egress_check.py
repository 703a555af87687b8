"""E2B's `network.allowOut` on sandboxd's per-sandbox egress proxy, driven by the unchanged Python `e2b` SDK (2.63.0,
pinned by tests/e2b/setup.sh). sandboxd/tests/suite/e2b_egress.rs runs it against a fresh daemon whose `network:`
block reaches the test's origins (`origin.test` and `denied.test` resolve to them) and checks the lines it prints.

Configured as a user's program is, by the environment alone: E2B_API_KEY, E2B_API_URL and E2B_SANDBOX_URL.

    egress_check.py reach CA_FILE ORIGIN_IP HTTP_PORT HTTPS_PORT
        A sandbox created with network={"allow_out": ["origin.test:HTTP_PORT", "origin.test:HTTPS_PORT"]} (the CA
        written into it with files.write) fetches each URL below with python's urllib in `commands.run`, through
        the proxy its environment names; then one created without `network` fetches from the origin by name and by
        address. One line per fetch: `<tag> reached <url> <body>` or `<tag> refused <url> exit=<code> <last stderr
        line>`, and `<tag> proxy <HTTP_PROXY or None>` per sandbox.
    egress_check.py refuse ENTRY
        Sandbox.create with allow_internet_access=True alone, then with network={"allow_out": [ENTRY]}: one line
        each, `refused <what> <exception class> <message>` or `created <what> <id>` (then killed).

Every sandbox it creates is killed before it exits, whatever the outcome.
"""

import sys

from e2b import CommandExitException, Sandbox

HOME = "/home/user"

# Run inside the sandbox: GET argv[1] with urllib (the proxy from the environment, the CA from argv[2] for https),
# print the body; any failure is a traceback and a non-zero exit.
FETCH = """
import ssl, sys, urllib.request
ctx = ssl.create_default_context(cafile=sys.argv[2])
with urllib.request.urlopen(sys.argv[1], context=ctx, timeout=20) as r:
    print(r.status, r.read().decode().strip())
"""

_made = []


def create(**kwargs):
    sbx = Sandbox.create(**kwargs)
    _made.append(sbx)
    return sbx


def fetch(sbx, tag, url):
    try:
        r = sbx.commands.run(f"python3 {HOME}/fetch.py {url} {HOME}/ca.pem", timeout=60)
        print(tag, "reached", url, r.stdout.strip(), flush=True)
    except CommandExitException as e:
        last = (e.stderr.strip().splitlines() or [""])[-1]
        print(tag, "refused", url, f"exit={e.exit_code}", last[:200], flush=True)


def proxy(sbx, tag):
    r = sbx.commands.run('echo "${HTTP_PROXY:-None} ${HTTPS_PROXY:-None}"')
    print(tag, "proxy", r.stdout.strip(), flush=True)


def reach(ca_file, ip, http_port, https_port):
    with open(ca_file) as f:
        ca = f.read()
    listed = [f"origin.test:{http_port}", f"origin.test:{https_port}"]
    sbx = create(network={"allow_out": listed})
    sbx.files.write(f"{HOME}/fetch.py", FETCH)
    sbx.files.write(f"{HOME}/ca.pem", ca)
    proxy(sbx, "listed")
    fetch(sbx, "listed", f"http://origin.test:{http_port}/hello")
    fetch(sbx, "listed", f"https://origin.test:{https_port}/hello")
    fetch(sbx, "listed", f"http://denied.test:{http_port}/hello")
    fetch(sbx, "listed", f"https://denied.test:{https_port}/hello")

    bare = create()
    bare.files.write(f"{HOME}/fetch.py", FETCH)
    bare.files.write(f"{HOME}/ca.pem", ca)
    proxy(bare, "bare")
    fetch(bare, "bare", f"http://origin.test:{http_port}/hello")
    fetch(bare, "bare", f"http://{ip}:{http_port}/hello")


def refuse(entry):
    for what, kwargs in [
        ("allow_internet_access", {"allow_internet_access": True}),
        ("allow_out", {"network": {"allow_out": [entry]}}),
    ]:
        try:
            sbx = create(**kwargs)
            print("created", what, sbx.sandbox_id, flush=True)
        except Exception as e:
            print("refused", what, type(e).__name__, str(e).replace("\n", " ")[:300], flush=True)


def main():
    try:
        if sys.argv[1] == "reach":
            reach(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
        elif sys.argv[1] == "refuse":
            refuse(sys.argv[2])
        else:
            sys.exit(f"unknown mode {sys.argv[1]!r}")
    finally:
        for sbx in _made:
            try:
                sbx.kill()
            except Exception as e:  # every sandbox must be tried
                print(f"cleanup: kill {sbx.sandbox_id}: {e!r}", flush=True)


if __name__ == "__main__":
    main()
