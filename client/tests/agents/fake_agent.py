#!/usr/bin/python3
"""A scripted fake agent for sandboxd's agent-sandbox tests.

It connects to the control socket ($SANDBOXD_CONTROL_SOCKET), reads its brief, then follows the script in
brief.providerConfig.script: a list of steps, each one of
  {"emit": EVENT}                  write an AgentEvent (agentId filled in)
  {"emit_many": N, "every_ms": M, "pad": B}  N status events, M ms apart ("every_ms": 0 for a burst), each
                                   message padded with B bytes (0 by default)
  {"mkfifo": P}                    make a FIFO at /workspace/P
  {"big_line": N}                  write a line of N bytes (not JSON)
  {"write": {"path": P, "content": C}}   write a file under /workspace
  {"artifact": {"path": P, "artifactId": A}}  write nothing, emit an ArtifactEvent with uri /workspace/P
  {"fill": {"path": P, "bytes": N}}  write N bytes to /workspace/P in 1 MiB chunks; status "fill P: wrote W: R",
                                   R "ok" or the errno's name (ENOSPC, EROFS, ...)
  {"read": P}                      status "read P: CONTENT uid U" (or "read P: ERRNO")
  {"sparse": {"path": P, "bytes": N}}  make /workspace/P a sparse file of N bytes (no block written); status
                                   "sparse P: ok" or the errno's name
  {"subvolume": P}                 make a btrfs subvolume /workspace/P (BTRFS_IOC_SUBVOL_CREATE_V2, then the v1
                                   call); status "subvolume P: R R1", each "ok" or the errno's name
  {"wait": "resolve"|"inject_context"|"update_brief"|"shutdown"}  wait for that command, echo it as a status event
  {"busy": true}                   spin forever (CPU)
  {"sleep_ms": N}
  {"raw": TEXT}                    write TEXT as a line (malformed input)
  {"exit": CODE}
  {"close_socket": true}           close the control connection and keep running
After the script it echoes every command it gets as a status event, runs the step an "update_brief" carries as
changes.step (any step above), answers "shutdown" with its state and exits 0.
FAKE_AGENT_SIGTERM=1 does the same on SIGTERM (otherwise SIGTERM, which a kill with grace sends together with the
"shutdown" line, is ignored); FAKE_AGENT_IGNORE_SHUTDOWN=1 ignores the "shutdown" line.
"""
import errno
import json
import os
import signal
import socket
import sys
import time

sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(os.environ["SANDBOXD_CONTROL_SOCKET"])
rfile = sock.makefile("rb")
agent_id = os.environ.get("SANDBOXD_AGENT_ID", "agent")
position = 0


def send(obj):
    sock.sendall((json.dumps(obj) + "\n").encode())


def emit(ev):
    ev = dict(ev)
    ev.setdefault("agentId", agent_id)
    send(ev)


def status(msg):
    emit({"type": "status", "message": msg})


def read_cmd():
    line = rfile.readline()
    if not line:
        sys.exit(3)
    return json.loads(line)


def shutdown(_signum=None, _frame=None):
    send({"type": "state", "state": {"scriptPosition": position, "via": "sigterm" if _signum else "shutdown"}})
    status("shutting down")
    sys.exit(0)


if os.environ.get("FAKE_AGENT_SIGTERM") == "1":
    signal.signal(signal.SIGTERM, shutdown)
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

brief = read_cmd()
assert brief["type"] == "brief", brief
script = (brief["brief"].get("providerConfig") or {}).get("script", [])
status("brief received run=%s" % brief["runId"])
if brief.get("resume") is not None:
    status("resuming from " + json.dumps(brief["resume"], sort_keys=True))


def handle(cmd):
    if cmd["type"] == "shutdown" and os.environ.get("FAKE_AGENT_IGNORE_SHUTDOWN") != "1":
        shutdown()
    status("command " + json.dumps(cmd, sort_keys=True))
    if cmd["type"] == "update_brief" and "step" in cmd["changes"]:
        run_step(cmd["changes"]["step"])


def run_step(step):
    if "emit" in step:
        emit(step["emit"])
    elif "emit_many" in step:
        pad = "p" * step.get("pad", 0)
        for i in range(step["emit_many"]):
            status("tick %d%s" % (i, pad))
            if step.get("every_ms"):
                time.sleep(step["every_ms"] / 1000.0)
    elif "write" in step:
        path = os.path.join("/workspace", step["write"]["path"])
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(step["write"]["content"])
    elif "fill" in step:
        path, left, wrote, result = os.path.join("/workspace", step["fill"]["path"]), step["fill"]["bytes"], 0, "ok"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                while left > 0:
                    k = f.write(b"\0" * min(left, 1 << 20))
                    f.flush()
                    wrote, left = wrote + k, left - k
                os.fsync(f.fileno())
        except OSError as e:
            result = errno.errorcode.get(e.errno, str(e.errno))
        status("fill %s: wrote %d: %s" % (step["fill"]["path"], wrote, result))
    elif "sparse" in step:
        result = "ok"
        try:
            with open(os.path.join("/workspace", step["sparse"]["path"]), "wb") as f:
                f.truncate(step["sparse"]["bytes"])
        except OSError as e:
            result = errno.errorcode.get(e.errno, str(e.errno))
        status("sparse %s: %s" % (step["sparse"]["path"], result))
    elif "subvolume" in step:
        import fcntl, struct
        results = []
        for request, name_at, size in ((0x50009418, 56, 4096), (0x5000940E, 8, 4096)):
            args = bytearray(size)
            name = step["subvolume"].encode()
            args[name_at:name_at + len(name)] = name
            fd = os.open("/workspace", os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.ioctl(fd, request, args)
                results.append("ok")
            except OSError as e:
                results.append(errno.errorcode.get(e.errno, str(e.errno)))
            finally:
                os.close(fd)
        status("subvolume %s: %s" % (step["subvolume"], " ".join(results)))
    elif "read" in step:
        path = os.path.join("/workspace", step["read"])
        try:
            with open(path) as f:
                status("read %s: %s uid %d" % (step["read"], f.read(), os.stat(path).st_uid))
        except OSError as e:
            status("read %s: %s" % (step["read"], errno.errorcode.get(e.errno, str(e.errno))))
    elif "artifact" in step:
        a = step["artifact"]
        emit({"type": "artifact", "artifactId": a["artifactId"], "name": a["path"], "kind": "document",
              "workstream": "w", "status": "draft", "qualityScore": 1,
              "provenance": {"createdBy": agent_id, "createdAt": "2026-01-01T00:00:00Z"},
              "uri": "/workspace/" + a["path"]})
    elif "wait" in step:
        while True:
            cmd = read_cmd()
            handle(cmd)
            if cmd["type"] == step["wait"]:
                break
    elif "busy" in step:
        status("busy")
        n = 0
        while True:
            n += 1
    elif "sleep_ms" in step:
        time.sleep(step["sleep_ms"] / 1000.0)
    elif "symlink" in step:
        os.symlink(step["symlink"]["target"], os.path.join("/workspace", step["symlink"]["path"]))
    elif "mkfifo" in step:
        os.mkfifo(os.path.join("/workspace", step["mkfifo"]))
    elif "big_line" in step:
        sock.sendall(b"x" * step["big_line"] + b"\n")
    elif "raw" in step:
        sock.sendall((step["raw"] + "\n").encode())
    elif "exit" in step:
        sys.exit(step["exit"])
    elif "close_socket" in step:
        sock.shutdown(socket.SHUT_RDWR)
        rfile.close()
        sock.close()
        time.sleep(60)


for position, step in enumerate(script):
    run_step(step)

while True:
    handle(read_cmd())
