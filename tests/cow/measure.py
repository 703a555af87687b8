#!/usr/bin/env python3
# What a copy-on-write workspace would make of a snapshot (the goal: a fork of a 1 000-file, 100 MB workspace in at
# most 100 ms, no copy of the data). A snapshot now copies the workspace (it lives on a tmpfs) to the state
# disk. This measures, on 2 GiB loop-mounted filesystems in /var/tmp, for 1 000 files of 100 KiB, five times each:
#   - cp -a of the tree and a sync (what a snapshot costs now, the digest aside), on XFS and btrfs;
#   - FICLONE (reflink) of each file into a new tree and a sync, on XFS;
#   - a read-only btrfs snapshot of the subvolume holding the tree.
# Prints the medians. Needs root, mkfs.xfs (xfsprogs) and mkfs.btrfs/btrfs (btrfs-progs); not part of CI.
import fcntl
import os
import statistics
import subprocess
import time

FICLONE = 0x40049409
WORK = os.environ.get("COW_EVAL_DIR", "/var/tmp/sandboxd-cow-eval")


def fill(d):
    """1 000 files of 100 KiB in ten directories."""
    data = os.urandom(100 << 10)
    for i in range(1000):
        sub = os.path.join(d, "d%02d" % (i // 100))
        os.makedirs(sub, exist_ok=True)
        with open(os.path.join(sub, "f%04d" % i), "wb") as f:
            f.write(data[i % 97:] + data[: i % 97])


def clone_tree(src, dst):
    """The tree at src again at dst, each file a reflink (FICLONE) of the original."""
    for root, _dirs, files in os.walk(src):
        out = os.path.join(dst, os.path.relpath(root, src))
        os.makedirs(out, exist_ok=True)
        for n in files:
            with open(os.path.join(root, n), "rb") as s, open(os.path.join(out, n), "wb") as d:
                fcntl.ioctl(d.fileno(), FICLONE, s.fileno())


def sh(*args):
    subprocess.run(args, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def ms(f):
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1000


def measure(fs):
    img, mnt = os.path.join(WORK, fs + ".img"), os.path.join(WORK, fs)
    os.makedirs(mnt, exist_ok=True)
    with open(img, "wb") as f:
        f.truncate(2 << 30)
    sh("mkfs." + fs, "-f", "-q", img)
    sh("mount", "-o", "loop", img, mnt)
    try:
        ws = os.path.join(mnt, "ws")
        if fs == "btrfs":
            sh("btrfs", "subvolume", "create", ws)
        else:
            os.makedirs(ws)
        fill(ws)
        os.sync()
        runs = {"cp -a + sync": [], "snapshot": []}
        for r in range(5):
            copy = lambda: (sh("cp", "-a", ws, "%s/cp%d" % (mnt, r)), sh("sync", "-f", mnt))
            runs["cp -a + sync"].append(ms(copy))
            if fs == "xfs":
                clone = lambda: (clone_tree(ws, "%s/cl%d" % (mnt, r)), sh("sync", "-f", mnt))
            else:
                clone = lambda: sh("btrfs", "subvolume", "snapshot", "-r", ws, "%s/sn%d" % (mnt, r))
            runs["snapshot"].append(ms(clone))
        how = {"xfs": "FICLONE each file + sync", "btrfs": "subvolume snapshot"}[fs]
        for k, v in runs.items():
            name = k if k != "snapshot" else how
            print("%-6s %-26s median %6.1f ms  (%s)" % (fs, name, statistics.median(v), ", ".join("%.0f" % x for x in v)))
    finally:
        sh("umount", mnt)
        os.remove(img)


os.makedirs(WORK, exist_ok=True)
for fs in ["xfs", "btrfs"]:
    measure(fs)
