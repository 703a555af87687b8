//! Warm interpreters: a program run in the interpreter a pooled container started ahead of time behaves as the
//! same program in a freshly started one. Every program of the corpus runs both ways (warm from a full pool,
//! plain with `"warm": false`) and the two runs must agree on stdout, stderr, exit code and signal (and, for the
//! programs with tools, the tool calls and the return value).

use std::time::Duration;

use serde_json::{json, Value};

use super::harness::{
    cannot_run, cgroup_children, cgroup_parent_dirs, exec_json, free_port, privileged,
    run_until_exit, wait_until, with, CgroupParentGuard, Client, Collected, Daemon, DaemonOpts,
};

/// One program of the corpus: a name, the code, and what else its `execute` carries (stdin, env, files).
pub(super) struct Case {
    pub(super) name: &'static str,
    pub(super) code: &'static str,
    pub(super) extra: Value,
}

pub(super) fn case(name: &'static str, code: &'static str) -> Case {
    Case {
        name,
        code,
        extra: json!({}),
    }
}

fn corpus() -> Vec<Case> {
    vec![
        case(
            "main_module",
            "import sys\nprint(__name__, __file__, sys.argv, sys.path[0])\nprint(sorted(globals()))\n\
             print(type(__loader__).__name__, __spec__, __package__, __doc__, __cached__, __annotations__)\n\
             import __main__\nprint(__main__.__dict__ is globals())",
        ),
        case(
            "uncaught_exception",
            "def inner():\n    raise ValueError('boom')\n\ndef outer():\n    inner()\n\nprint('before')\nouter()",
        ),
        case("syntax_error", "print('never')\nx = (\n"),
        case("sys_exit_code", "import sys\nprint('a')\nsys.exit(7)"),
        case("sys_exit_message", "import sys\nsys.exit('bye')"),
        case("builtin_exit", "exit(4)"),
        case("os_exit", "import os\nprint('x', flush=True)\nos._exit(5)"),
        case(
            "atexit",
            "import atexit\natexit.register(lambda: print('bye'))\nprint('hi')\nraise RuntimeError('late')",
        ),
        Case {
            name: "stdin_input",
            code: "a = input()\nimport sys\nprint(repr(a), repr(sys.stdin.read()), sys.stdin.seekable())",
            extra: json!({"stdin": "alpha\nbeta\ngamma"}),
        },
        case(
            "sigterm",
            "import os, signal\nprint('up', flush=True)\nos.kill(os.getpid(), signal.SIGTERM)\nimport time\ntime.sleep(5)",
        ),
        case(
            "sigint_keyboard_interrupt",
            "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(5)",
        ),
        case(
            "sigint_handled",
            "import os, signal, time\nsignal.signal(signal.SIGINT, lambda s, f: print('caught', s))\n\
             os.kill(os.getpid(), signal.SIGINT)\nprint('after')",
        ),
        case("keyboard_interrupt_raised", "raise KeyboardInterrupt"),
        case(
            "threads",
            "import threading\nout = []\nts = [threading.Thread(target=out.append, args=(i,)) for i in range(8)]\n\
             [t.start() for t in ts]\n[t.join() for t in ts]\nprint(sorted(out), threading.active_count())\n\
             def bad():\n    raise KeyError('in thread')\nt = threading.Thread(target=bad, name='w')\nt.start()\nt.join()",
        ),
        Case {
            name: "subprocess_and_environ",
            code: "import subprocess, sys, os\n\
                   print(subprocess.run([sys.executable, '-c', 'import sys, os; print(sys.argv, os.environ[\"FOO\"])', 'x'], \
                   capture_output=True, text=True).stdout, end='')\n\
                   print(subprocess.run(['/bin/sh', '-c', 'echo $FOO $PYTHONUNBUFFERED'], capture_output=True, text=True).stdout, end='')\n\
                   print(sorted(os.environ.items()))",
            extra: json!({"env": {"FOO": "bar baz", "EMPTY": ""}}),
        },
        // The stub imports nothing a plain start does not (it used to leave json, socket, re and enum loaded).
        case(
            "loaded_modules",
            "import sys\nprint(sorted(m for m in ('json', 're', 'enum', 'socket', 'selectors', 'types', 'weakref', \
             'collections', 'functools', 'importlib.machinery') if m in sys.modules))",
        ),
        // The launch's strings travel NUL-terminated: UTF-8, `=` in a value, and arguments as a plain start has them.
        Case {
            name: "environ_strings",
            code: "import os, sys\nprint(repr(os.environ['UNI']), repr(os.environ['EQ']), repr(os.environ['SP']), \
                   sys.argv[1:], len(sys.orig_argv))",
            extra: json!({"env": {"UNI": "é ü ✓ 日本", "EQ": "a=b==c", "SP": " lead\ttab\nline "}}),
        },
        case(
            "stdout_stderr_ordering",
            "import sys\nfor i in range(50):\n    print('out', i)\n    print('err', i, file=sys.stderr)\n\
             sys.stdout.write('no newline')\nsys.stderr.write('tail')",
        ),
        case(
            "streams",
            "import sys\nfor s in (sys.stdin, sys.stdout, sys.stderr):\n\
             \x20   print(s.encoding, s.errors, s.line_buffering, s.write_through, s.isatty(), s.fileno(), file=sys.stderr)\n\
             print(sys.stdout.seekable(), sys.stderr.seekable(), sys.flags.unbuffered)",
        ),
        case(
            "rlimits",
            "import resource as r\nfor n in ('NOFILE', 'FSIZE', 'NPROC', 'AS', 'CORE', 'STACK', 'MEMLOCK', 'CPU'):\n\
             \x20   print(n, r.getrlimit(getattr(r, 'RLIMIT_' + n)))",
        ),
        Case {
            name: "own_files",
            code: "import os, sys\nprint(os.getcwd(), sorted(os.listdir('.')))\nsys.path.insert(0, os.getcwd())\n\
                   import helper\nprint(helper.f(), helper.__file__)\nprint(open('data.txt').read())",
            extra: json!({"files": [
                {"path": "helper.py", "content": "def f():\n    return 42\n"},
                {"path": "data.txt", "content": "payload"},
            ]}),
        },
        case(
            "pickle_main_class",
            "import pickle\nclass A:\n    x = 1\nprint(type(pickle.loads(pickle.dumps(A()))).__module__)",
        ),
        case("warning", "import warnings\nwarnings.warn('careful')\nprint('done')"),
        case(
            "excepthook",
            "import sys\nsys.excepthook = lambda t, v, tb: print('hook', t.__name__, v, tb.tb_frame.f_code.co_filename, tb.tb_next)\n\
             raise OSError('x')",
        ),
        case("unicode_output", "print('h\\u00e9llo \\u2713')\nimport sys\nsys.stdout.buffer.write(b'\\xff\\n')"),
        case(
            "memory_limit",
            "x = bytearray(256 << 20)\nprint('allocated')",
        ),
        Case {
            name: "small_memory_limit",
            code: "print(sum(range(10)))",
            extra: json!({"limits": {"memory_mb": 16}}),
        },
        case("large_output", "for i in range(20000):\n    print(i)"),
        case(
            "cwd_and_ids",
            "import os\nprint(os.getcwd(), os.getuid(), os.getgid(), os.getppid(), os.getpgrp() == os.getsid(0), sorted(os.listdir('/proc/self/fd')))",
        ),
    ]
}

/// What runs after the program's last line: the warm interpreter ends itself the way the interpreter's exit does
/// (threads, atexit, finalizers, stdio), then without the rest of the tear-down.
fn exit_corpus() -> Vec<Case> {
    vec![
        case(
            "exit_finalizers",
            "import json, weakref\nclass A:\n    def __del__(self):\n        print('del', self.n, json.dumps([1]))\n\
             a = A(); a.n = 'global'\nc = A(); c.n = 'cycle'; c.me = c\nweakref.finalize(a, print, 'finalized')\n\
             def f():\n    x = A(); x.n = 'local'\n    raise SystemExit(3)\nprint('end')\nf()",
        ),
        case(
            "exit_threads",
            "import threading, time, atexit, sys\natexit.register(lambda: print('atexit', sys.exc_info()))\n\
             def late():\n    time.sleep(0.05)\n    print('late thread')\ndef forever():\n    while True:\n        time.sleep(0.001)\n\
             threading.Thread(target=late).start()\nthreading.Thread(target=forever, daemon=True).start()\nprint('main done')",
        ),
        case(
            "exit_streams",
            "import sys, io\nprint('x')\nsys.stdout = io.StringIO()\nprint('hidden')\n\
             class A:\n    def __del__(self):\n        print('at exit to', sys.stdout is sys.__stdout__)\na = A()\nsys.stderr.close()",
        ),
        case("exit_codes", "import sys\nprint('n')\nsys.exit(300)"),
        case("exit_huge_code", "import sys\nsys.exit(2**70)"),
        case("exit_no_newline", "import sys\nsys.stdout.write('no newline')\nsys.exit()"),
        case(
            "exit_kept_stdout_copy",
            "import os\nfd = os.dup(1)\nprint('print', flush=True)\nos.write(fd, b'dup\\n')\nos.set_inheritable(fd, True)",
        ),
        case(
            "exit_socket_audited_and_replaced",
            "import socket, sys\ndef hook(event, args):\n    if event.startswith('socket.'):\n        \
             raise RuntimeError('no sockets here')\nsys.addaudithook(hook)\nsocket.socket = None\nprint('x')\nsys.exit(3)",
        ),
        case(
            "exit_child_still_running",
            "import subprocess, sys\nsubprocess.Popen(['sleep', '0.3'], stdout=sys.stdout)\nprint('left running')\nsys.exit(6)",
        ),
        case(
            "exit_module_from_workspace",
            "import os, sys\nsys.path.insert(0, os.getcwd())\nopen('mod.py', 'w').write(\n\
             'class B:\\n    def __del__(self):\\n        print(\"module object finalized\")\\nb = B()\\n')\nimport mod\nprint('imported')",
        ),
    ]
}

/// Programs with tools: the tool SDK is imported ahead in the waiting interpreter. `echo` answers with its
/// arguments, any other tool with an error.
fn tool_corpus() -> Vec<Case> {
    vec![
        case(
            "tools_module",
            "import sys, sandbox_tools\nprint(__name__, __file__, sys.argv, sys.path[:3], sandbox_tools.__file__)\n\
             print(sorted(k for k in vars(sandbox_tools) if not k.startswith('__')), sandbox_tools.__all__)\n\
             print(sandbox_tools.__spec__.name, type(sandbox_tools.__loader__).__name__, sandbox_tools.__cached__)\n\
             from sandbox_tools import echo as e2\nprint(e2 is echo, echo(x=1), call('echo', {'y': [2]}))\n\
             {'done': True}",
        ),
        case(
            "tools_error",
            "try:\n    fail(a=1)\nexcept ToolError as e:\n    print('caught', e.code, e.message)\nfail()",
        ),
        case(
            "tools_exception_after_a_call",
            "echo(x=1)\nraise ValueError('after a call')",
        ),
        case(
            "tools_threads",
            "import threading\nout = []\n\
             ts = [threading.Thread(target=lambda i=i: out.append(echo(i=i)['i'])) for i in range(12)]\n\
             [t.start() for t in ts]\n[t.join() for t in ts]\nprint(sorted(out))\nlen(out)",
        ),
        case("tools_sys_exit", "import sys\necho(x=1)\nsys.exit(3)"),
        case(
            "tools_fork",
            "import os\npid = os.fork()\nif pid == 0:\n    print('child', echo(c=1), flush=True)\n    os._exit(0)\n\
             os.waitpid(pid, 0)\nprint('parent', echo(p=1))",
        ),
        case("tools_syntax_error", "echo(x=1)\nx = (\n"),
    ]
}

/// stdout, stderr, exit code, signal, tool calls and return value of one run.
pub(super) type Observed = (
    String,
    String,
    Option<i32>,
    Option<String>,
    Option<u64>,
    Option<String>,
);

pub(super) fn observed(r: &Collected) -> Observed {
    let res = r.result();
    (
        String::from_utf8_lossy(&r.stdout()).into_owned(),
        String::from_utf8_lossy(&r.stderr()).into_owned(),
        res.exit_code,
        res.signal.clone(),
        res.tool_calls,
        res.return_value.as_ref().map(|v| v.to_string()),
    )
}

/// A daemon serving python alone, with two ready containers (so `/healthz`'s `ready` counts python's).
async fn python_daemon() -> Daemon {
    host_daemon("python", "/usr/bin/python3").await
}

/// A daemon serving `lang` alone with the host's `command`, with two ready containers.
pub(super) async fn host_daemon(lang: &str, command: &str) -> Daemon {
    Daemon::start(DaemonOpts {
        pool_size: 2,
        extra_config: Some(json!({
            "languages": {lang: {"image": "host", "command": [command]}}
        })),
        ..DaemonOpts::default()
    })
    .await
}

/// `/healthz`'s pool counters: (ready, hits).
pub(super) async fn pool(d: &Daemon) -> (u64, u64) {
    let (_, h) = d.healthz().await;
    let n = |k: &str| h["pool"][k].as_u64().unwrap_or(u64::MAX);
    (n("ready"), n("hits"))
}

/// Runs `code` from a ready pooled container (`warm`) or in a plain interpreter.
async fn run(
    c: &mut Client,
    d: &Daemon,
    id: &str,
    code: &str,
    extra: &Value,
    warm: bool,
) -> Collected {
    let exec = with(exec_json(id, "python", code, 20_000, 128), extra.clone());
    run_exec(c, d, exec, warm).await
}

/// Runs `exec` from a ready pooled container (`warm`) or in a plain interpreter, answering its tool calls (see
/// [`tool_corpus`]).
pub(super) async fn run_exec(c: &mut Client, d: &Daemon, mut exec: Value, warm: bool) -> Collected {
    let id = exec["id"].as_str().unwrap_or("?").to_owned();
    if warm {
        wait_until(
            "a ready pooled container",
            Duration::from_secs(30),
            || async {
                match pool(d).await {
                    (0, _) => Err("none ready".to_owned()),
                    _ => Ok(()),
                }
            },
        )
        .await;
    } else {
        exec = with(exec, json!({"warm": false}));
    }
    let hits = pool(d).await.1;
    let (r, _) = super::tools::run_answering(c, exec, |call| {
        Some(match call.name.as_str() {
            "echo" => Ok(call.args.clone()),
            other => Err(format!("{other} refuses")),
        })
    })
    .await;
    if warm {
        assert_eq!(pool(d).await.1, hits + 1, "{id} took a pooled container");
    }
    r
}

/// Whether the program ran in the warm interpreter: its command line is the stub's (`python3 -c ...`,
/// `node -e ...`).
pub(super) async fn ran_warm(c: &mut Client, d: &Daemon, id: &str, lang: &str, warm: bool) -> bool {
    let code = match lang {
        "javascript" => {
            "console.log(require('fs').readFileSync('/proc/self/cmdline', 'utf8').split('\\0').includes('-e'))"
        }
        _ => "print(b'-c' in open('/proc/self/cmdline', 'rb').read().split(b'\\0'))",
    };
    let exec = with(exec_json(id, lang, code, 20_000, 128), json!({}));
    let r = run_exec(c, d, exec, warm).await;
    match r.stdout_text().trim().to_ascii_lowercase().as_str() {
        "true" => true,
        "false" => false,
        other => panic!("probe {id}: {other:?}: {}", r.dump()),
    }
}

/// Runs every case of `cases` in `lang` warm and plain; returns the cases whose runs differ once `normalise`d.
pub(super) async fn differential(
    c: &mut Client,
    d: &Daemon,
    lang: &str,
    cases: &[Case],
    normalise: fn(Observed) -> Observed,
) -> Vec<String> {
    let mut differ = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let mut both = Vec::new();
        for (tag, warm) in [("w", true), ("p", false)] {
            let id = format!("{tag}{i}-{}", case.name);
            let exec = with(
                exec_json(&id, lang, case.code, 20_000, 128),
                case.extra.clone(),
            );
            both.push(normalise(observed(&run_exec(c, d, exec, warm).await)));
        }
        let (w, p) = (&both[0], &both[1]);
        if w != p {
            differ.push(format!("{}:\n  warm:  {w:?}\n  plain: {p:?}", case.name));
        }
    }
    differ
}

#[tokio::test]
async fn a_program_behaves_the_same_in_a_warm_and_in_a_plain_interpreter() {
    let Some(_g) =
        privileged("a_program_behaves_the_same_in_a_warm_and_in_a_plain_interpreter").await
    else {
        return;
    };
    let d = python_daemon().await;
    let mut c = Client::connect(&d).await;
    assert!(
        ran_warm(&mut c, &d, "probe-warm-first", "python", true).await,
        "the pooled interpreter ran the code"
    );
    assert!(
        !ran_warm(&mut c, &d, "probe-plain", "python", false).await,
        "warm: false starts a new interpreter"
    );
    let cases: Vec<Case> = corpus().into_iter().chain(exit_corpus()).collect();
    let mut differ = differential(&mut c, &d, "python", &cases, |o| o).await;
    // With tools: the probe's program runs in the waiting interpreter too.
    let probe = super::tools::exec_tools(
        "probe-tools",
        "python",
        "print(b'-c' in open('/proc/self/cmdline', 'rb').read().split(b'\\0'), echo(x=1))",
        &["echo"],
    );
    let r = run_exec(&mut c, &d, probe, true).await;
    assert_eq!(
        r.stdout_text(),
        "True {'x': 1}\n",
        "an execution with tools ran in the waiting interpreter: {}",
        r.dump()
    );
    let tool_cases = tool_corpus();
    for (i, case) in tool_cases.iter().enumerate() {
        let mut both = Vec::new();
        for (tag, warm) in [("tw", true), ("tp", false)] {
            let id = format!("{tag}{i}-{}", case.name);
            let exec = super::tools::exec_tools(&id, "python", case.code, &["echo", "fail"]);
            both.push(observed(&run_exec(&mut c, &d, exec, warm).await));
        }
        let (w, p) = (&both[0], &both[1]);
        if w != p {
            differ.push(format!("{}:\n  warm:  {w:?}\n  plain: {p:?}", case.name));
        }
    }
    assert!(
        ran_warm(&mut c, &d, "probe-warm-last", "python", true).await,
        "the pooled interpreter ran the code"
    );
    println!(
        "warm/plain differential: {} programs ({} with tools), {} differ",
        cases.len() + tool_cases.len(),
        tool_cases.len(),
        differ.len()
    );
    assert!(differ.is_empty(), "{}", differ.join("\n"));
}

#[tokio::test]
async fn a_request_that_sets_a_start_up_variable_gets_a_plain_interpreter() {
    let Some(_g) =
        privileged("a_request_that_sets_a_start_up_variable_gets_a_plain_interpreter").await
    else {
        return;
    };
    let d = python_daemon().await;
    let mut c = Client::connect(&d).await;
    let code = "import sys\nprint(b'-c' in open('/proc/self/cmdline', 'rb').read().split(b'\\0'), sys.flags.optimize)";
    let r = run(
        &mut c,
        &d,
        "optimize",
        code,
        &json!({"env": {"PYTHONOPTIMIZE": "1"}}),
        true,
    )
    .await;
    assert_eq!(r.stdout_text(), "False 1\n", "{}", r.dump());
}

/// A warm interpreter reports its program's end before its exit (`runtime::init`'s ending), and only the
/// interpreter's own report counts: python's goes in a datagram to the init's socket, and one that a child of the
/// program sends is dropped (the program ends as it would). (Node's: `warm_node`.)
#[tokio::test]
async fn only_the_interpreters_own_report_ends_the_program() {
    let Some(_g) = privileged("only_the_interpreters_own_report_ends_the_program").await else {
        return;
    };
    let d = python_daemon().await;
    let mut c = Client::connect(&d).await;
    let forged = "import os, socket, time\npid = os.fork()\nif pid == 0:\n    \
                  with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:\n        \
                  s.sendto(b'exit 9\\n', b'\\0sandboxd-warm-end')\n    os._exit(0)\n\
                  os.waitpid(pid, 0)\ntime.sleep(0.2)\nprint('parent')";
    let r = run(&mut c, &d, "forged", forged, &json!({}), true).await;
    assert_eq!(
        (r.stdout_text().as_str(), r.result().exit_code),
        ("parent\n", Some(0)),
        "a child's report is not the interpreter's: {}",
        r.dump()
    );
}

/// The documented differences of the warm interpreter's exit, which also show it is the one taken: the objects of
/// the start-up are frozen, and finalizers at exit run before the interpreter is finalizing (it never is).
#[tokio::test]
async fn the_warm_exit_skips_the_interpreter_tear_down() {
    let Some(_g) = privileged("the_warm_exit_skips_the_interpreter_tear_down").await else {
        return;
    };
    let d = python_daemon().await;
    let mut c = Client::connect(&d).await;
    let code = "import gc, sys\nclass A:\n    def __del__(self):\n        print('finalizing', sys.is_finalizing())\n\
                a = A()\nprint('frozen', gc.get_freeze_count() > 0)";
    for (id, warm, want) in [
        ("exit-warm", true, "frozen True\nfinalizing False\n"),
        ("exit-plain", false, "frozen False\nfinalizing True\n"),
    ] {
        let r = run(&mut c, &d, id, code, &json!({}), warm).await;
        assert_eq!(
            (r.stdout_text().as_str(), r.result().exit_code),
            (want, Some(0)),
            "{id}: {}",
            r.dump()
        );
    }
}

/// `cpu_time_ms` counts from the launch: what a pooled container used before (its init's set-up and the waiting
/// interpreter's start, done before the request arrived) is not the execution's. `pass` in a waiting interpreter
/// reports less than any ready container had used while it waited; counted from the container's creation, it
/// reported more.
#[tokio::test]
async fn cpu_time_counts_from_the_launch() {
    let Some(_g) = privileged("cpu_time_counts_from_the_launch").await else {
        return;
    };
    let d = python_daemon().await;
    let mut c = Client::connect(&d).await;
    wait_until("two ready containers", Duration::from_secs(30), || async {
        match pool(&d).await {
            (2, _) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    // The interpreters finish their start and wait.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let before: Vec<u64> = cgroup_children(&d.cgroup_parent)
        .iter()
        .filter_map(|dir| {
            let v1 = std::fs::read_to_string(dir.join("cpuacct.usage")).ok();
            let v2 = std::fs::read_to_string(dir.join("cpu.stat"))
                .ok()
                .and_then(|s| {
                    let usec = s.lines().find_map(|l| l.strip_prefix("usage_usec "))?;
                    Some((usec.trim().parse::<u64>().ok()? * 1000).to_string())
                });
            v1.or(v2)?.trim().parse().ok()
        })
        .collect();
    assert_eq!(before.len(), 2, "the ready containers' usage: {before:?}");
    let least = *before.iter().min().unwrap();
    let r = run(&mut c, &d, "cpu-warm", "pass", &json!({}), true).await;
    assert_eq!(r.result().exit_code, Some(0), "{}", r.dump());
    let cpu_ms = r.result().resource_usage.cpu_time_ms;
    assert!(
        cpu_ms * 1_000_000 < least,
        "cpu_time_ms {cpu_ms}: a ready container had used {least} ns before its launch"
    );
}

/// An image `images/build.sh` makes (`python`, `javascript`), from `SANDBOXD_TEST_IMAGES` (`.ci/run` sets it).
fn test_image(name: &str) -> Option<std::path::PathBuf> {
    let spec = std::env::var("SANDBOXD_TEST_IMAGES").ok()?;
    let layout = spec
        .split(',')
        .find_map(|item| item.strip_prefix(name)?.strip_prefix('='))?;
    Some(std::fs::canonicalize(layout).unwrap())
}

/// A preload test of one language's image: a list with a module that does not load stops the daemon, naming the
/// key and the module (`named`); a list that loads is loaded by the waiting interpreter before the program, whose
/// `code` prints `warm` then, and `plain` in a plain interpreter.
pub(super) struct Preload {
    pub(super) test: &'static str,
    pub(super) lang: &'static str,
    pub(super) command: &'static str,
    pub(super) bad: &'static [&'static str],
    pub(super) named: &'static str,
    pub(super) good: &'static [&'static str],
    pub(super) code: &'static str,
    pub(super) warm: &'static str,
    pub(super) plain: &'static str,
    pub(super) uid_base: u32,
}

/// Runs a [`Preload`] test against the image of `p.lang` (named after the language).
pub(super) async fn preload_test(p: Preload) {
    let Some(_g) = privileged(p.test).await else {
        return;
    };
    let Some(layout) = test_image(p.lang) else {
        // On CI this fails: .ci/run builds the images and sets it.
        return cannot_run(
            p.test,
            "SANDBOXD_TEST_IMAGES names no image of the language (images/build.sh LANG; then SANDBOXD_TEST_IMAGES=LANG=images/out/LANG/oci)",
        );
    };
    let languages = json!({p.lang: {"image": p.lang, "command": [p.command]}});

    // Refused at start: the module is named with the key, and nothing is left behind.
    let dir = tempfile::tempdir().unwrap();
    let parent = format!("sandboxd-test-{}-preload-{}", std::process::id(), p.lang);
    let _cg = CgroupParentGuard(parent.clone());
    let config = dir.path().join("c.yaml");
    let bad = json!({
        "listen": format!("127.0.0.1:{}", free_port()),
        "state_dir": dir.path().join("state"),
        "auth": {"tokens": ["a-token-of-enough-length"]},
        "sandbox": {"cgroup_parent": parent, "uid_base": p.uid_base},
        "images": {p.lang: {"layout": layout, "preload": p.bad}},
        "languages": languages,
    });
    std::fs::write(&config, bad.to_string()).unwrap();
    let (status, stderr) = run_until_exit(&config, Duration::from_secs(120)).await;
    assert!(!status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("images.{}.preload", p.lang)) && stderr.contains(p.named),
        "names the key and the module: {stderr}"
    );
    assert!(
        cgroup_parent_dirs(&parent).is_empty(),
        "a refused start leaves no cgroup parent"
    );

    // Modules that load: in the warm interpreter before the program, not in a plain one.
    let d = Daemon::start(DaemonOpts {
        pool_size: 2,
        extra_config: Some(json!({
            "images": {p.lang: {"layout": layout, "preload": p.good}},
            "languages": languages,
        })),
        ..DaemonOpts::default()
    })
    .await;
    let mut c = Client::connect(&d).await;
    for (id, warm, want) in [
        ("preload-warm", true, p.warm),
        ("preload-plain", false, p.plain),
    ] {
        let r = run_exec(&mut c, &d, exec_json(id, p.lang, p.code, 20_000, 128), warm).await;
        assert_eq!(r.stdout_text(), want, "{id}: {}", r.dump());
    }
}

/// An image's `preload` modules are imported by the waiting interpreter before the program runs (a warm program
/// finds them in `sys.modules`, a plain one does not), and checked at start: a module that does not import on the
/// image stops the daemon, which names the key and the module, instead of being skipped by every warm interpreter.
#[tokio::test]
async fn preload_modules_are_imported_ahead_and_checked_at_start() {
    preload_test(Preload {
        test: "preload_modules_are_imported_ahead_and_checked_at_start",
        lang: "python",
        command: "/usr/bin/python3",
        bad: &["json", "sandboxd_no_such_module"],
        named: "No module named 'sandboxd_no_such_module'",
        good: &["sqlite3", "xml.dom.minidom"],
        code: "import sys\nprint('sqlite3' in sys.modules, 'xml.dom.minidom' in sys.modules)",
        warm: "True True\n",
        plain: "False False\n",
        uid_base: 925_000,
    })
    .await;
}
