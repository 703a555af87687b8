//! The probe programs the isolation-posture cases run through `execute`. Each reads a JSON configuration from
//! stdin and prints one JSON object describing what the execution can see and do: credentials and capabilities
//! (from `/proc/self/status`), `no_new_privs`, the seccomp mode, namespace ids, network reachability, writable
//! paths and resource limits. They only observe: a write test creates a uniquely named file and removes it at
//! once, and system paths are only tried when the server claims they are protected.

/// The Python probe. Input: `{"host", "port", "network": bool, "system_writes": bool, "hold_ms"}`.
pub const PYTHON: &str = r#"
import json, os, socket, sys, time
cfg = json.loads(sys.stdin.read() or "{}")
out = {"probe": "python"}
st = {}
with open("/proc/self/status") as f:
    for line in f:
        k, _, v = line.partition(":")
        st[k] = v.strip()
for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp"):
    out[k] = st.get(k)
out["uid"] = os.getuid()
ns = {}
for n in ("pid", "mnt", "net", "ipc", "uts", "user", "cgroup"):
    try:
        ns[n] = os.readlink("/proc/self/ns/" + n)
    except OSError:
        ns[n] = None
out["ns"] = ns
try:
    out["uid_map"] = open("/proc/self/uid_map").read().split()
except OSError:
    out["uid_map"] = None
out["pid"] = os.getpid()
out["visible_processes"] = len([p for p in os.listdir("/proc") if p.isdigit()])
out["hostname"] = socket.gethostname()
out["cwd"] = os.getcwd()
out["tmpdir"] = os.environ.get("TMPDIR")

def reach(host, port):
    try:
        infos = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    except OSError as e:
        return "unresolved"
    last = "none"
    for fam, typ, proto, _, addr in infos[:2]:
        s = socket.socket(fam, typ, proto)
        s.settimeout(2.0)
        try:
            s.connect(addr)
            return "connected"
        except socket.timeout:
            last = "timeout"
        except OSError as e:
            last = "errno %s" % e.errno
        finally:
            s.close()
    return last

if cfg.get("network"):
    out["reach_public"] = reach("1.1.1.1", 53)
    out["reach_endpoint"] = reach(cfg.get("host", "127.0.0.1"), cfg.get("port", 80))
try:
    with open("/proc/net/dev") as f:
        out["interfaces"] = sorted(l.split(":")[0].strip() for l in f.readlines()[2:] if ":" in l)
except OSError:
    out["interfaces"] = None
paths = [".", os.environ.get("TMPDIR") or "/tmp"]
if cfg.get("system_writes"):
    paths += ["/", "/usr", "/etc", "/bin", "/usr/bin", "/var"]
writable = {}
for d in paths:
    p = os.path.join(d, ".fsp-probe-%d" % os.getpid())
    try:
        with open(p, "w") as h:
            h.write("x")
        os.unlink(p)
        writable[d] = True
    except OSError:
        writable[d] = False
out["writable"] = writable
try:
    import resource
    lim = {}
    for name in ("RLIMIT_NOFILE", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_AS", "RLIMIT_CORE"):
        r = getattr(resource, name, None)
        if r is not None:
            lim[name] = [-1 if x == resource.RLIM_INFINITY else x for x in resource.getrlimit(r)]
    out["rlimits"] = lim
except Exception as e:
    out["rlimits"] = str(e)
try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    out["landlock_kernel_abi"] = abi if abi >= 0 else None
except Exception:
    out["landlock_kernel_abi"] = None
print(json.dumps(out), flush=True)
time.sleep(cfg.get("hold_ms", 0) / 1000.0)
"#;

/// The shell probe (POSIX sh). Input: the same JSON on stdin; only `hold_ms` is used.
pub const SHELL: &str = r#"
cfg=$(cat)
hold=$(printf '%s' "$cfg" | sed -n 's/.*"hold_ms": *\([0-9]*\).*/\1/p')
printf '{"probe":"shell"'
while IFS=: read -r k v; do
  case "$k" in
    CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp) v=$(echo $v); printf ',"%s":"%s"' "$k" "$v";;
  esac
done < /proc/$$/status
printf ',"uid":%s' "$(id -u 2>/dev/null || echo null)"
printf ',"ns":{'
sep=
for n in pid mnt net ipc uts user cgroup; do
  l=$(readlink /proc/$$/ns/$n 2>/dev/null)
  printf '%s"%s":"%s"' "$sep" "$n" "$l"
  sep=,
done
printf '},"tmpdir":"%s","writable":{' "${TMPDIR:-/tmp}"
sep=
for d in . "${TMPDIR:-/tmp}"; do
  if ( : > "$d/.fsp-probe-$$" ) 2>/dev/null; then rm -f "$d/.fsp-probe-$$"; w=true; else w=false; fi
  printf '%s"%s":%s' "$sep" "$d" "$w"
  sep=,
done
printf '},"nofile":"%s"}\n' "$(ulimit -n)"
if [ -n "$hold" ]; then sleep "$(awk "BEGIN{print $hold/1000}" 2>/dev/null || echo 1)"; fi
"#;

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::process::{Command, Stdio};

    fn run(program: &str, args: &[&str], input: &str) -> Option<serde_json::Value> {
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .ok()?;
        child.stdin.take()?.write_all(input.as_bytes()).ok()?;
        let out = child.wait_with_output().ok()?;
        Some(serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
            panic!(
                "{program} probe printed no JSON ({e}): {}",
                String::from_utf8_lossy(&out.stdout)
            )
        }))
    }

    #[test]
    fn probes_print_json_here() {
        if let Some(v) = run("/bin/sh", &["-c", super::SHELL], r#"{"hold_ms": 0}"#) {
            assert_eq!(v["probe"], "shell");
            assert!(v["CapEff"].is_string(), "{v}");
            assert_eq!(v["writable"]["."], true, "{v}");
        }
        if std::path::Path::new("/usr/bin/python3").exists() {
            let v = run(
                "/usr/bin/python3",
                &["-c", super::PYTHON],
                r#"{"hold_ms": 0}"#,
            )
            .unwrap();
            assert_eq!(v["probe"], "python");
            assert!(v["ns"]["pid"].is_string(), "{v}");
        }
    }
}
