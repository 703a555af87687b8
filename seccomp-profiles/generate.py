#!/usr/bin/env python3
"""Writes seccomp-profiles/default.<arch>.json from the tables below.

The JSON files are the source of truth that sandboxd compiles (seccompiler's JSON format, one comment per rule);
this script only keeps the two architectures consistent. Usage: generate.py X86_TABLE ARM_TABLE, each a file with
one syscall name per line (seccompiler's syscall tables). Names missing from an architecture are left out there.
"""
import json, sys

# Syscalls a program may call with any arguments: (name, why it is safe to allow).
ALLOW = [
    # files and descriptors
    ("read", "read from a descriptor"), ("write", "write to a descriptor"), ("readv", "vectored read"),
    ("writev", "vectored write"), ("pread64", "positional read"), ("pwrite64", "positional write"),
    ("preadv", "vectored positional read"), ("pwritev", "vectored positional write"),
    ("preadv2", "vectored positional read with flags"), ("pwritev2", "vectored positional write with flags"),
    ("open", "open a file (landlock limits which)"), ("openat", "open relative to a directory fd (landlock limits which)"),
    ("openat2", "openat with resolve flags (landlock limits which)"), ("creat", "create a file (landlock limits where)"),
    ("close", "close a descriptor"), ("close_range", "close a range of descriptors"),
    ("lseek", "reposition a file offset"), ("dup", "duplicate a descriptor"), ("dup2", "duplicate onto a number"),
    ("dup3", "duplicate onto a number with flags"), ("fcntl", "descriptor flags and locks"),
    ("flock", "advisory file lock"), ("fsync", "flush a file"), ("fdatasync", "flush file data"),
    ("sync_file_range", "flush part of a file"), ("ftruncate", "truncate an open file (RLIMIT_FSIZE and tmpfs size bound it)"),
    ("truncate", "truncate a file by path (landlock limits which)"), ("fallocate", "allocate file space (tmpfs size bounds it)"),
    ("fadvise64", "file access pattern advice"), ("readahead", "page-cache readahead"),
    ("sendfile", "copy between descriptors in the kernel"), ("copy_file_range", "copy between files in the kernel"),
    ("splice", "move data between a pipe and a descriptor"), ("tee", "duplicate pipe content"),
    ("vmsplice", "map user pages into a pipe"), ("pipe", "create a pipe"), ("pipe2", "create a pipe with flags"),
    ("ioctl", "device control (TIOCSTI, TIOCLINUX and TIOCSETD are denied separately)"),
    # file metadata and directories
    ("stat", "file status by path"), ("fstat", "file status of a descriptor"), ("lstat", "file status, not following links"),
    ("newfstatat", "file status relative to a directory fd"), ("statx", "extended file status"),
    ("statfs", "filesystem statistics by path"), ("fstatfs", "filesystem statistics of a descriptor"),
    ("access", "check permissions by path"), ("faccessat", "check permissions relative to a directory fd"),
    ("faccessat2", "faccessat with flags"), ("getdents", "read directory entries"), ("getdents64", "read directory entries"),
    ("getcwd", "current directory"), ("chdir", "change directory"), ("fchdir", "change directory to a descriptor"),
    ("mkdir", "create a directory (landlock limits where)"), ("mkdirat", "create a directory relative to a fd"),
    ("rmdir", "remove a directory (landlock limits where)"), ("rename", "rename a file"), ("renameat", "rename relative to fds"),
    ("renameat2", "rename with flags"), ("link", "hard link (landlock refuses links out of writable trees)"),
    ("linkat", "hard link relative to fds"), ("unlink", "remove a file"), ("unlinkat", "remove relative to a fd"),
    ("symlink", "create a symlink"), ("symlinkat", "create a symlink relative to a fd"), ("readlink", "read a symlink"),
    ("readlinkat", "read a symlink relative to a fd"), ("chmod", "change mode (nosuid mounts void setuid bits)"),
    ("fchmod", "change mode of a descriptor"), ("fchmodat", "change mode relative to a fd"), ("fchmodat2", "fchmodat with flags"),
    ("chown", "change owner (only the one mapped uid exists)"), ("fchown", "change owner of a descriptor"),
    ("lchown", "change owner of a link"), ("fchownat", "change owner relative to a fd"), ("umask", "file creation mask"),
    ("utime", "set file times"), ("utimes", "set file times"), ("utimensat", "set file times with ns precision"),
    ("futimesat", "set file times relative to a fd"), ("getxattr", "read an extended attribute"),
    ("lgetxattr", "read an extended attribute of a link"), ("fgetxattr", "read an extended attribute of a fd"),
    ("listxattr", "list extended attributes"), ("llistxattr", "list extended attributes of a link"),
    ("flistxattr", "list extended attributes of a fd"), ("setxattr", "set an extended attribute (user namespace rules apply)"),
    ("lsetxattr", "set an extended attribute of a link"), ("fsetxattr", "set an extended attribute of a fd"),
    ("removexattr", "remove an extended attribute"), ("lremovexattr", "remove an extended attribute of a link"),
    ("fremovexattr", "remove an extended attribute of a fd"), ("inotify_init", "file change notification"),
    ("inotify_init1", "file change notification with flags"), ("inotify_add_watch", "watch a path"),
    ("inotify_rm_watch", "stop watching a path"), ("mknod", "create a fifo or socket file (devices: no CAP_MKNOD, landlock)"),
    ("mknodat", "mknod relative to a fd"), ("sync", "flush all filesystems"), ("syncfs", "flush one filesystem"),
    # memory
    ("brk", "grow the heap"), ("mmap", "map memory"), ("munmap", "unmap memory"), ("mremap", "remap memory"),
    ("mprotect", "change memory protection"), ("madvise", "memory usage advice"), ("msync", "flush a mapping"),
    ("mincore", "page residency"), ("mlock", "lock pages (RLIMIT_MEMLOCK bounds it)"), ("mlock2", "lock pages with flags"),
    ("munlock", "unlock pages"), ("mlockall", "lock all pages (RLIMIT_MEMLOCK bounds it)"), ("munlockall", "unlock all pages"),
    ("membarrier", "memory barrier across threads (used by runtimes)"), ("memfd_create", "anonymous file"),
    ("get_mempolicy", "NUMA policy"), ("set_mempolicy", "NUMA policy"), ("mbind", "NUMA binding"),
    ("pkey_alloc", "memory protection keys"), ("pkey_free", "memory protection keys"), ("pkey_mprotect", "mprotect with a key"),
    ("map_shadow_stack", "CET shadow stacks (glibc)"), ("mseal", "seal mappings (glibc hardening)"),
    # processes and threads
    ("clone", "create threads and processes (namespace flags are denied separately)"),
    ("fork", "create a process"), ("vfork", "create a process sharing memory until exec"),
    ("execve", "run a program"), ("execveat", "run a program relative to a fd"), ("exit", "end a thread"),
    ("exit_group", "end a process"), ("wait4", "wait for a child"), ("waitid", "wait for a child"),
    ("kill", "signal a process (the pid namespace limits whom)"), ("tkill", "signal a thread"), ("tgkill", "signal a thread"),
    ("getpid", "own pid"), ("getppid", "parent pid"), ("gettid", "own thread id"), ("getpgid", "process group"),
    ("setpgid", "set process group"), ("getpgrp", "process group"), ("getsid", "session"), ("setsid", "new session"),
    ("getuid", "own uid"), ("geteuid", "own effective uid"), ("getgid", "own gid"), ("getegid", "own effective gid"),
    ("getresuid", "own uids"), ("getresgid", "own gids"), ("getgroups", "supplementary groups"),
    ("setuid", "set uid (only uid 0 is mapped)"), ("setgid", "set gid (only gid 0 is mapped)"),
    ("setreuid", "set uids"), ("setregid", "set gids"), ("setresuid", "set uids"), ("setresgid", "set gids"),
    ("setfsuid", "set filesystem uid"), ("setfsgid", "set filesystem gid"), ("setgroups", "set groups (unmapped ids fail)"),
    ("capget", "read capabilities (all empty)"), ("capset", "set capabilities (cannot raise above empty)"),
    ("prctl", "process attributes (PR_SET_NO_NEW_PRIVS cannot be undone)"), ("arch_prctl", "thread-local storage setup"),
    ("set_tid_address", "thread exit notification"), ("set_robust_list", "robust futexes"), ("get_robust_list", "robust futexes"),
    ("rseq", "restartable sequences (glibc)"), ("futex", "fast userspace locks"), ("futex_waitv", "wait on several futexes"),
    ("sched_yield", "yield the cpu"), ("sched_getaffinity", "cpu affinity"), ("sched_setaffinity", "cpu affinity (cpuset bounds it)"),
    ("sched_getparam", "scheduling parameters"), ("sched_setparam", "scheduling parameters"),
    ("sched_getscheduler", "scheduling policy"), ("sched_setscheduler", "scheduling policy (no CAP_SYS_NICE: no realtime)"),
    ("sched_get_priority_max", "priority range"), ("sched_get_priority_min", "priority range"),
    ("sched_rr_get_interval", "round-robin interval"), ("sched_getattr", "scheduling attributes"),
    ("sched_setattr", "scheduling attributes"), ("getpriority", "nice value"), ("setpriority", "nice value (raise only)"),
    ("getrlimit", "resource limits"), ("setrlimit", "resource limits (lower only without caps; RLIMIT_CORE denied separately)"),
    ("prlimit64", "resource limits of a process (setting RLIMIT_CORE denied separately)"), ("getrusage", "resource usage"), ("times", "process times"),
    ("personality", "execution domain: querying, PER_LINUX and PER_LINUX32 only (the rest denied separately)"), ("pidfd_open", "descriptor for a process"),
    ("pidfd_send_signal", "signal through a process descriptor"), ("pidfd_getfd", "copy a descriptor (ptrace rules apply)"),
    ("ioprio_get", "I/O priority"), ("ioprio_set", "I/O priority"), ("getcpu", "current cpu"),
    # signals
    ("rt_sigaction", "install a signal handler"), ("rt_sigprocmask", "signal mask"), ("rt_sigreturn", "return from a handler"),
    ("rt_sigpending", "pending signals"), ("rt_sigtimedwait", "wait for a signal"), ("rt_sigsuspend", "wait for a signal"),
    ("rt_sigqueueinfo", "queue a signal"), ("rt_tgsigqueueinfo", "queue a signal to a thread"),
    ("sigaltstack", "alternate signal stack"), ("signalfd", "signals as a descriptor"), ("signalfd4", "signals as a descriptor"),
    ("pause", "wait for a signal"), ("alarm", "alarm signal"),
    # time
    ("clock_gettime", "read a clock"), ("clock_getres", "clock resolution"), ("clock_nanosleep", "sleep on a clock"),
    ("gettimeofday", "read the time"), ("time", "read the time"), ("nanosleep", "sleep"),
    ("timer_create", "POSIX timer"), ("timer_settime", "POSIX timer"), ("timer_gettime", "POSIX timer"),
    ("timer_getoverrun", "POSIX timer"), ("timer_delete", "POSIX timer"), ("timerfd_create", "timer descriptor"),
    ("timerfd_settime", "timer descriptor"), ("timerfd_gettime", "timer descriptor"),
    ("getitimer", "interval timer"), ("setitimer", "interval timer"),
    # polling and events
    ("poll", "wait for descriptors"), ("ppoll", "wait for descriptors"), ("select", "wait for descriptors"),
    ("pselect6", "wait for descriptors"), ("epoll_create", "event poll"), ("epoll_create1", "event poll"),
    ("epoll_ctl", "event poll"), ("epoll_wait", "event poll"), ("epoll_pwait", "event poll"), ("epoll_pwait2", "event poll"),
    ("eventfd", "event counter"), ("eventfd2", "event counter"),
    # sockets (the network namespace has only loopback)
    ("socket", "create a socket (families but AF_UNIX, AF_INET, AF_INET6 and NETLINK_ROUTE, and SOCK_RAW IP, are denied separately)"),
    ("socketpair", "connected unix socket pair (other families are denied separately)"), ("bind", "bind a socket"), ("listen", "listen on a socket"),
    ("accept", "accept a connection"), ("accept4", "accept a connection with flags"), ("connect", "connect a socket"),
    ("getsockname", "socket address"), ("getpeername", "peer address"), ("sendto", "send"), ("recvfrom", "receive"),
    ("sendmsg", "send a message"), ("recvmsg", "receive a message"), ("sendmmsg", "send messages"),
    ("recvmmsg", "receive messages"), ("shutdown", "shut down a socket"), ("setsockopt", "socket options"),
    ("getsockopt", "socket options"),
    # system information
    ("uname", "kernel name (the uts namespace has its own hostname)"), ("sysinfo", "memory and load figures"),
    ("getrandom", "random bytes"), ("sethostname", "hostname of the uts namespace only"),
    ("setdomainname", "domain name of the uts namespace only"),
    # IPC (the ipc namespace is private)
    ("shmget", "System V shared memory"), ("shmat", "System V shared memory"), ("shmdt", "System V shared memory"),
    ("shmctl", "System V shared memory"), ("semget", "System V semaphores"), ("semop", "System V semaphores"),
    ("semtimedop", "System V semaphores"), ("semctl", "System V semaphores"), ("msgget", "System V messages"),
    ("msgsnd", "System V messages"), ("msgrcv", "System V messages"), ("msgctl", "System V messages"),
    ("mq_open", "POSIX message queues"), ("mq_unlink", "POSIX message queues"), ("mq_timedsend", "POSIX message queues"),
    ("mq_timedreceive", "POSIX message queues"), ("mq_notify", "POSIX message queues"), ("mq_getsetattr", "POSIX message queues"),
    # landlock: a program may restrict itself further
    ("landlock_create_ruleset", "further self-restriction only"), ("landlock_add_rule", "further self-restriction only"),
    ("landlock_restrict_self", "further self-restriction only"),
    ("seccomp", "add a stricter filter of its own (no_new_privs is set)"),
    # kernel plumbing
    ("restart_syscall", "the kernel resumes interrupted calls with it"),
    ("futex_wait", "futex2 wait"), ("futex_wake", "futex2 wake"), ("futex_requeue", "futex2 requeue"),
    ("cachestat", "page-cache statistics of an open file"),
]

CLONE_NEW = [
    ("CLONE_NEWNS", 0x00020000), ("CLONE_NEWCGROUP", 0x02000000), ("CLONE_NEWUTS", 0x04000000),
    ("CLONE_NEWIPC", 0x08000000), ("CLONE_NEWUSER", 0x10000000), ("CLONE_NEWPID", 0x20000000),
    ("CLONE_NEWNET", 0x40000000), ("CLONE_NEWTIME", 0x00000080),
]

# Syscalls that fail with EPERM whatever the arguments: (name, the danger).
DENY = [
    ("ptrace", "inspect and control other processes"), ("process_vm_readv", "read another process's memory"),
    ("process_vm_writev", "write another process's memory"), ("mount", "change the mount tree"),
    ("umount2", "unmount and reveal what is below"), ("umount", "unmount"), ("fsopen", "new mount API"),
    ("fsconfig", "new mount API"), ("fsmount", "new mount API"), ("fspick", "new mount API"),
    ("move_mount", "new mount API"), ("open_tree", "new mount API: clone a mount tree"),
    ("mount_setattr", "change mount attributes"), ("pivot_root", "change the root mount"), ("chroot", "change the root directory"),
    ("unshare", "new namespaces"), ("setns", "enter other namespaces"), ("keyctl", "kernel keyrings (not namespaced)"),
    ("add_key", "kernel keyrings"), ("request_key", "kernel keyrings"), ("bpf", "load BPF programs"),
    ("perf_event_open", "performance counters: kernel attack surface and side channels"),
    ("userfaultfd", "stall the kernel on page faults (exploit primitive)"), ("io_uring_setup", "io_uring: large attack surface, bypasses seccomp per operation"),
    ("io_uring_enter", "io_uring"), ("io_uring_register", "io_uring"),
    ("io_setup", "Linux AIO: events come from the host-wide fs.aio-max-nr, which one execution could exhaust (no cgroup limits it); glibc's POSIX aio uses threads instead"),
    ("io_submit", "Linux AIO"), ("io_cancel", "Linux AIO"), ("io_getevents", "Linux AIO"), ("io_pgetevents", "Linux AIO"),
    ("io_destroy", "Linux AIO"), ("init_module", "load kernel modules"),
    ("finit_module", "load kernel modules"), ("delete_module", "unload kernel modules"), ("kexec_load", "replace the kernel"),
    ("kexec_file_load", "replace the kernel"), ("reboot", "reboot"), ("swapon", "enable swap"), ("swapoff", "disable swap"),
    ("acct", "process accounting"), ("open_by_handle_at", "open files by handle, bypassing paths (CVE-2014-3519 style escapes)"),
    ("name_to_handle_at", "file handles"), ("quotactl", "disk quotas"), ("quotactl_fd", "disk quotas"),
    ("settimeofday", "set the system clock"), ("clock_settime", "set the system clock"), ("clock_adjtime", "adjust the system clock"),
    ("adjtimex", "adjust the system clock"), ("syslog", "read the kernel log"), ("iopl", "raw I/O port access"),
    ("ioperm", "raw I/O port access"), ("lookup_dcookie", "kernel profiling"), ("nfsservctl", "kernel NFS server"),
    ("vhangup", "hang up terminals"), ("uselib", "obsolete loader"), ("ustat", "obsolete"), ("sysfs", "obsolete"),
    ("_sysctl", "obsolete sysctl"), ("get_kernel_syms", "obsolete"), ("query_module", "obsolete"),
    ("create_module", "obsolete"), ("kcmp", "compare kernel objects of processes"), ("fanotify_init", "filesystem-wide monitoring"),
    ("migrate_pages", "move other processes' pages"), ("move_pages", "move other processes' pages"),
    ("set_mempolicy_home_node", "NUMA policy of ranges"),
]

AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
NETLINK_ROUTE = 0
SOCK_RAW, SOCK_PACKET, SOCK_TYPE_MASK = 3, 10, 0xF
TIOCSTI, TIOCLINUX, TIOCSETD = 0x5412, 0x541C, 0x5423
PERSONALITY_QUERY, PER_LINUX, PER_LINUX32 = 0xFFFFFFFF, 0x0000, 0x0008
# btrfs subvolume and snapshot creation (_IOW(0x94, n, 4096 bytes)): a subvolume made inside a workspace of the
# btrfs workspace store would have no quota of its own (agents.workspace_store: btrfs); needs no capability.
BTRFS_CREATE = [(name, cmd, "make a btrfs subvolume, which no quota limits (the btrfs workspace store)")
                for name, cmd in (("BTRFS_IOC_SNAP_CREATE", 0x50009401), ("BTRFS_IOC_SUBVOL_CREATE", 0x5000940E),
                                  ("BTRFS_IOC_SNAP_CREATE_V2", 0x50009417), ("BTRFS_IOC_SUBVOL_CREATE_V2", 0x50009418))]
RLIMIT_CORE = 4

def cond(index, typ, op, val, comment):
    return {"index": index, "type": typ, "op": op, "val": val, "comment": comment}

def socket_rules():
    """AF_UNIX, AF_INET, AF_INET6 and, of netlink, NETLINK_ROUTE only (getifaddrs(3), if_nameindex(3), node's
    os.networkInterfaces(), `ip` read the loopback-only namespace through it; changes need CAP_NET_ADMIN, which no
    program has). Family, type and protocol are ints to the kernel: compared as 32-bit values."""
    return [
        {"syscall": "socket", "comment": "socket families other than AF_UNIX, AF_INET, AF_INET6, AF_NETLINK (AF_PACKET, AF_VSOCK, AF_ALG, ...)",
         "args": [cond(0, "dword", "ne", AF_UNIX, "not AF_UNIX"), cond(0, "dword", "ne", AF_INET, "not AF_INET"),
                  cond(0, "dword", "ne", AF_INET6, "not AF_INET6"), cond(0, "dword", "ne", AF_NETLINK, "not AF_NETLINK")]},
        {"syscall": "socket", "comment": "netlink protocols other than NETLINK_ROUTE (audit, sock_diag, uevents, generic, netfilter, ...)",
         "args": [cond(0, "dword", "eq", AF_NETLINK, "AF_NETLINK"), cond(2, "dword", "ne", NETLINK_ROUTE, "not NETLINK_ROUTE")]},
        {"syscall": "socketpair", "comment": "socket pairs of any family but AF_UNIX (the family code would be reached)",
         "args": [cond(0, "dword", "ne", AF_UNIX, "not AF_UNIX")]},
        # Netlink sockets are SOCK_RAW (or SOCK_DGRAM) by definition: the raw-socket rule is for the IP families.
        {"syscall": "socket", "comment": "SOCK_RAW IP sockets: forge packets",
         "args": [cond(0, "dword", "ne", AF_NETLINK, "not AF_NETLINK"),
                  cond(1, "dword", {"masked_eq": SOCK_TYPE_MASK}, SOCK_RAW, "type is SOCK_RAW (flags masked off)")]},
        {"syscall": "socket", "comment": "SOCK_PACKET sockets: forge packets",
         "args": [cond(1, "dword", {"masked_eq": SOCK_TYPE_MASK}, SOCK_PACKET, "type is SOCK_PACKET (flags masked off)")]},
    ]

def build(names, arch):
    have = set(names)
    allow = [{"syscall": n, "comment": c} for n, c in ALLOW if n in have]
    deny = [{"syscall": n, "comment": c} for n, c in DENY if n in have]
    for flag, bit in CLONE_NEW:
        deny.append({"syscall": "clone", "comment": f"clone with {flag}: no new namespaces",
                     "args": [cond(0, "qword", {"masked_eq": bit}, bit, f"flags & {flag}")]})
    deny.extend(socket_rules())
    for name, cmd, why in (("TIOCSTI", TIOCSTI, "inject input into a terminal"),
                           ("TIOCLINUX", TIOCLINUX, "inject input into a terminal"),
                           ("TIOCSETD", TIOCSETD, "attach another line discipline (n_gsm, n_hdlc, ...: kernel code with a history of bugs)"),
                           *BTRFS_CREATE):
        deny.append({"syscall": "ioctl", "comment": f"{name}: {why}; compared as a 32-bit value so the high-bits variants match too",
                     "args": [cond(1, "dword", "eq", cmd, f"request == {name}")]})
    deny.append({"syscall": "personality", "comment": "personality flags (ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC, UNAME26, ...): only querying, PER_LINUX and PER_LINUX32 (uname's machine only); the kernel reads an unsigned int",
                 "args": [cond(0, "dword", "ne", PERSONALITY_QUERY, "not a query (0xffffffff)"),
                          cond(0, "dword", "ne", PER_LINUX, "not PER_LINUX"), cond(0, "dword", "ne", PER_LINUX32, "not PER_LINUX32")]})
    # RLIMIT_CORE is 1: below a page, so no core file is written, and the value the kernel reads as "no piped
    # dump" when core_pattern is a pipe (0 is ignored there). A program must not set 0 (nor anything else).
    deny.append({"syscall": "setrlimit", "comment": "setting RLIMIT_CORE: its value 1 stops piped core dumps (0 would not)",
                 "args": [cond(0, "dword", "eq", RLIMIT_CORE, "resource == RLIMIT_CORE")]})
    deny.append({"syscall": "prlimit64", "comment": "setting RLIMIT_CORE (reading it, with a NULL new limit, stays allowed)",
                 "args": [cond(1, "dword", "eq", RLIMIT_CORE, "resource == RLIMIT_CORE"),
                          cond(2, "qword", "ne", 0, "new limit is not NULL")]})
    return {
        "allowlist": {
            "mismatch_action": {"errno": 38},
            "match_action": "allow",
            "filter": allow,
        },
        "denylist": {
            "mismatch_action": "allow",
            "match_action": {"errno": 1},
            "filter": deny,
        },
    }

if __name__ == "__main__":
    for arch, table in (("x86_64", sys.argv[1]), ("aarch64", sys.argv[2])):
        names = [l.strip() for l in open(table) if l.strip()]
        out = build(names, arch)
        with open(f"default.{arch}.json", "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        print(arch, len(out["allowlist"]["filter"]), "allow rules,", len(out["denylist"]["filter"]), "deny rules")
