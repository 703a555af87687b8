//! Warm node: a program run in the node interpreter a pooled container started ahead of time behaves as the same
//! program in a freshly started node. Every program of the corpus runs both ways and the two runs must agree on
//! stdout, stderr, exit code and signal. Node cannot take descriptors, so the init relays its output: the corpus
//! covers the streams, ordering, children that inherit them, and exits of every kind.
//!
//! One difference is documented and removed before comparing: a stack trace printed for an uncaught error ends,
//! below node's entry point (`executeUserEntryPoint`), in the stub's frames (`[eval]`, `runScriptInThisContext`)
//! where a plain start has `node:internal/main/run_main_module`.

use serde_json::json;

use super::harness::{exec_json, privileged, with, Client, Daemon};
use super::warm::{
    case, differential, observed, preload_test, ran_warm, run_exec, Case, Observed, Preload,
};

/// Names, globals, exits and errors.
fn corpus() -> Vec<Case> {
    vec![
        case(
            "main_module",
            "console.log(process.argv, process.argv0, process.execArgv, __filename, __dirname, require.main === module,\n\
             module.id, typeof globalThis.require, typeof globalThis.module, typeof globalThis.__filename,\n\
             typeof process._eval, Object.keys(require.cache).length, module.paths.length, process.title)",
        ),
        case(
            "uncaught_exception",
            "function inner() { throw new Error('boom'); }\nfunction outer() { inner(); }\nconsole.log('before');\nouter();",
        ),
        case("syntax_error", "console.log('never');\nlet x = (;\n"),
        case(
            "globals",
            "console.log(Object.getOwnPropertyNames(globalThis).sort().join(' '));\n\
             console.log(typeof fs, typeof http, typeof crypto.subtle, typeof console.log);\n\
             process.nextTick(() => console.log('tick', typeof globalThis.module));\n\
             setTimeout(() => console.log('later', Object.getOwnPropertyNames(globalThis).length), 1);",
        ),
        case("process_exit", "console.log('a');\nprocess.exit(7);"),
        case("exit_code", "process.exitCode = 4;\nconsole.log('x');"),
        case(
            "exit_events",
            "process.on('exit', (c) => console.log('exit', c));\nprocess.on('beforeExit', () => console.log('beforeExit'));\nconsole.log('main');",
        ),
        case("unhandled_rejection", "Promise.reject(new Error('rejected'));"),
        case(
            "error_in_a_timer",
            "setTimeout(() => { throw new TypeError('late'); }, 1);\nconsole.log('scheduled');",
        ),
    ]
}

/// Stdio, children, files, modules, the event loop, limits.
fn io_corpus() -> Vec<Case> {
    vec![
        // Within a pipe's buffer: beyond it node itself drops what it queued at process.exit, warm or not.
        case(
            "output_then_exit",
            "process.stdout.write('y'.repeat(30000) + '\\n');\nconsole.error('e'.repeat(20000));\nprocess.exit(3);",
        ),
        case(
            "really_exit_replaced",
            "const really = process.reallyExit;\nprocess.reallyExit = (code) => {\n  \
             require('fs').writeSync(1, `bye ${code}\\n`);\n  really(code);\n};\nprocess.exit(2);",
        ),
        case(
            "child_still_running_at_exit",
            "require('child_process').spawn('sleep', ['0.3'], { stdio: 'inherit' }).unref();\nconsole.log('left running');",
        ),
        Case {
            name: "stdin_read",
            code: "const fs = require('fs');\nconsole.log(JSON.stringify(fs.readFileSync(0, 'utf8')), fs.fstatSync(0).isFile());",
            extra: json!({"stdin": "alpha\nbeta\ngamma"}),
        },
        Case {
            name: "stdin_stream",
            code: "let d = '';\nprocess.stdin.setEncoding('utf8');\nprocess.stdin.on('data', (c) => { d += c; });\n\
                   process.stdin.on('end', () => console.log(JSON.stringify(d), process.stdin.constructor.name));",
            extra: json!({"stdin": "one\ntwo\n"}),
        },
        case(
            "sigterm",
            "console.log('up');\nprocess.kill(process.pid, 'SIGTERM');\nsetTimeout(() => {}, 5000);",
        ),
        case(
            "sigint_handled",
            "process.on('SIGINT', (s) => console.log('caught', s));\nprocess.kill(process.pid, 'SIGINT');\n\
             setTimeout(() => console.log('after'), 50);",
        ),
        Case {
            name: "children_and_environ",
            code: "const cp = require('child_process');\n\
                   process.stdout.write(cp.execFileSync(process.execPath, ['-e', 'console.log(process.argv.length, process.env.FOO, process.execArgv)']));\n\
                   process.stdout.write(cp.execSync('echo \"$FOO\"'));\n\
                   console.log(JSON.stringify(Object.entries(process.env).sort()));",
            extra: json!({"env": {"FOO": "bar baz", "EMPTY": ""}}),
        },
        case(
            "fork_inherits_the_streams",
            "const cp = require('child_process');\nif (process.argv[2] === 'child') {\n\
             \x20 console.log('child', process.argv.slice(2), process.execArgv);\n\
             \x20 console.error('child err');\n} else {\n\
             \x20 cp.fork(__filename, ['child']).on('exit', (code) => console.log('parent saw', code));\n}",
        ),
        case(
            "stdout_stderr_ordering",
            "for (let i = 0; i < 50; i++) { console.log('out', i); console.error('err', i); }\n\
             process.stdout.write('no newline');\nprocess.stderr.write('tail');",
        ),
        case(
            "streams",
            "console.log([process.stdout, process.stderr].map((s) => [s._type, s.isTTY, s.writableHighWaterMark]),\n\
             process.stdin.constructor.name, require('fs').fstatSync(1).isFIFO());",
        ),
        case(
            "limits",
            "console.log(require('fs').readFileSync('/proc/self/limits', 'utf8'));",
        ),
        Case {
            name: "own_files",
            code: "const fs = require('fs');\nconsole.log(process.cwd(), fs.readdirSync('.').sort());\n\
                   const h = require(process.cwd() + '/helper.js');\nconsole.log(h.f(), fs.readFileSync('data.txt', 'utf8'));\n\
                   import(process.cwd() + '/mod.mjs').then((m) => console.log('esm', m.x));",
            extra: json!({"files": [
                {"path": "helper.js", "content": "exports.f = () => 42;\n"},
                {"path": "mod.mjs", "content": "export const x = 'from an ES module';\n"},
                {"path": "data.txt", "content": "payload"},
            ]}),
        },
        case(
            "es_module_syntax",
            "import fs from 'fs';\nconsole.log(typeof require, typeof module, typeof fs.readFileSync);",
        ),
        case(
            "async_order",
            "setTimeout(() => console.log('timeout'), 100);\nsetImmediate(() => console.log('immediate'));\n\
             Promise.resolve().then(() => console.log('microtask'));\nprocess.nextTick(() => console.log('tick'));\nconsole.log('sync');",
        ),
        case(
            "worker_thread",
            "const { Worker } = require('worker_threads');\n\
             new Worker('console.log(\"worker\", require(\"worker_threads\").isMainThread)', { eval: true })\n\
             \x20 .on('exit', (c) => console.log('worker exit', c));",
        ),
        case("unicode_output", "console.log('h\\u00e9llo \\u2713');\nprocess.stdout.write(Buffer.from([0xff, 0x0a]));"),
        case("large_output", "for (let i = 0; i < 20000; i++) console.log(i);"),
        case(
            "memory_limit",
            "const b = Buffer.alloc(256 << 20, 1);\nconsole.log('allocated', b.length);",
        ),
        Case {
            name: "small_memory_limit",
            code: "console.log([1, 2, 3].reduce((a, b) => a + b));",
            extra: json!({"limits": {"memory_mb": 24}}),
        },
        case(
            "cwd_and_ids",
            // The descriptors are counted in `only_the_interpreters_own_report_ends_the_program` (warm node has
            // one more, its channel).
            "console.log(process.cwd(), process.getuid(), process.getgid(), process.ppid);",
        ),
    ]
}

/// Removes the frames below node's entry point from stack traces (the documented difference).
fn normalise((stdout, stderr, exit, signal, calls, value): Observed) -> Observed {
    let stderr = stderr
        .lines()
        .filter(|l| {
            let frame = l.trim_start();
            !(frame.starts_with("at [eval]")
                || frame.starts_with("at runScriptInThisContext (node:internal/vm")
                || frame.starts_with("at node:internal/process/execution")
                || frame.starts_with("at node:internal/main/run_main_module"))
        })
        .collect::<Vec<_>>()
        .join("\n");
    (stdout, stderr, exit, signal, calls, value)
}

#[tokio::test]
async fn a_node_program_behaves_the_same_in_a_warm_and_in_a_plain_interpreter() {
    let Some(_g) =
        privileged("a_node_program_behaves_the_same_in_a_warm_and_in_a_plain_interpreter").await
    else {
        return;
    };
    let d = node_daemon().await;
    let mut c = Client::connect(&d).await;
    assert!(
        ran_warm(&mut c, &d, "probe-warm-first", "javascript", true).await,
        "the pooled interpreter ran the code"
    );
    assert!(
        !ran_warm(&mut c, &d, "probe-plain", "javascript", false).await,
        "warm: false starts a new interpreter"
    );
    let cases: Vec<Case> = corpus().into_iter().chain(io_corpus()).collect();
    let differ = differential(&mut c, &d, "javascript", &cases, normalise).await;
    // A memory limit below what a waiting interpreter holds: a container of its own (the pool's would refuse the
    // limit), and the same outcome as a plain start.
    let mut tiny = Vec::new();
    for (id, warm) in [("tiny-w", json!({})), ("tiny-p", json!({"warm": false}))] {
        let exec = with(
            exec_json(id, "javascript", "console.log('fits');", 20_000, 4),
            warm,
        );
        c.send_json(&exec).await;
        tiny.push(normalise(observed(&c.collect(id).await)));
    }
    assert_eq!(tiny[0], tiny[1], "a 4 MiB limit");
    assert!(
        ran_warm(&mut c, &d, "probe-warm-last", "javascript", true).await,
        "the pooled interpreter ran the code"
    );
    println!(
        "node warm/plain differential: {} programs, {} differ",
        cases.len(),
        differ.len()
    );
    assert!(differ.is_empty(), "{}", differ.join("\n"));
}

/// Node reports its program's end on its channel, a descriptor it keeps (the one documented difference: one
/// descriptor more than a plain start), and only there: a program that closed the channel and opened a file that
/// took its number finds the file as it left it (the file is an artifact). (Its children do not inherit the channel:
/// libuv starts them with the standard descriptors alone.)
#[tokio::test]
async fn node_reports_its_end_on_its_channel_only() {
    let Some(_g) = privileged("node_reports_its_end_on_its_channel_only").await else {
        return;
    };
    let d = node_daemon().await;
    let mut c = Client::connect(&d).await;
    // The channel's number is the stub's last argument.
    let reused = "const fs = require('fs');\n\
                  const fd = Number(fs.readFileSync('/proc/self/cmdline', 'utf8').split('\\0').filter(Boolean).pop());\n\
                  fs.closeSync(fd);\nfs.mkdirSync('out', { recursive: true });\nconst f = fs.openSync('out/f', 'w');\n\
                  console.log('same fd', f === fd);";
    let exec = with(
        exec_json("reused", "javascript", reused, 20_000, 128),
        json!({"artifacts": {"paths": ["out/*"]}}),
    );
    let r = run_exec(&mut c, &d, exec, true).await;
    assert_eq!(
        (r.stdout_text().as_str(), r.result().exit_code),
        ("same fd true\n", Some(0)),
        "{}",
        r.dump()
    );
    let artifacts = r.result_raw()["artifacts"]["artifacts"].clone();
    assert_eq!(
        artifacts[0]["size_bytes"], 0,
        "the file under the channel's number is left empty: {artifacts:#}"
    );
    // The program's own descriptors and a child's.
    let count = "const fs = require('fs');\n\
                 const child = require('child_process').execFileSync('/bin/ls', ['/proc/self/fd'], { encoding: 'utf8' });\n\
                 console.log(fs.readdirSync('/proc/self/fd').length, child.trim().split('\\n').length);";
    let mut counts = Vec::new();
    for warm in [true, false] {
        let exec = exec_json(&format!("fds-{warm}"), "javascript", count, 20_000, 128);
        let r = run_exec(&mut c, &d, exec, warm).await;
        let n: Vec<i64> = r
            .stdout_text()
            .split_whitespace()
            .map(|n| n.parse().unwrap_or(-1))
            .collect();
        counts.push(n);
    }
    assert_eq!(
        (counts[0][0], counts[0][1]),
        (counts[1][0] + 1, counts[1][1]),
        "warm, plain: {counts:?}"
    );
}

/// A daemon serving javascript alone (host node), with two ready containers.
async fn node_daemon() -> Daemon {
    super::warm::host_daemon("javascript", "/usr/bin/node").await
}

/// The javascript image's `preload` modules are loaded by the waiting node before the program runs (a warm program
/// finds them in `process.moduleLoadList`, a plain one does not), and checked at start: one that does not load stops
/// the daemon, which names the key and the module.
#[tokio::test]
async fn node_preload_modules_are_loaded_ahead_and_checked_at_start() {
    preload_test(Preload {
        test: "node_preload_modules_are_loaded_ahead_and_checked_at_start",
        lang: "javascript",
        command: "/usr/bin/node",
        bad: &["zlib", "sandboxd-no-such-module"],
        named: "Cannot find module 'sandboxd-no-such-module'",
        good: &["zlib", "node:dns"],
        code: "const l = process.moduleLoadList;\n\
               console.log(l.includes('NativeModule zlib'), l.includes('NativeModule dns'));",
        warm: "true true\n",
        plain: "false false\n",
        uid_base: 926_000,
    })
    .await;
}
