//! Warm interpreters: a pooled python or javascript container's init starts the interpreter ahead of time, and the
//! launch hands it the code ([`runtime::init`] has the init's half, `warm/python.py` and `warm/node.js` the
//! interpreters').
//!
//! The interpreter starts with the image's base environment (sandboxd's and the image's, without the request's),
//! imports `site` (python) and the stub's few modules, and the image's `preload` modules, and waits. At the launch
//! it takes the request's stdio, environment and arguments and runs the code file as the main module, as
//! `python3 /sandbox/main.py` or `node /sandbox/main.js` would. Node cannot take descriptors over a socket, so its
//! init copies the request's stdin into the interpreter's own and relays its stdout and stderr ([`Launch::relay`]).
//! What the interpreter reads only while it starts cannot change afterwards, so a request that sets such a
//! variable ([`startup_variables`]) or asks for a plain start gets a freshly executed interpreter instead
//! ([`wanted`]), and so does one whose arguments and environment `execve` could refuse ([`fits_exec`]) and a
//! container from the cold path.
//!
//! An execution with tools runs in the waiting interpreter too: the stub runs the tool runner as the script, which
//! imports the SDK at the launch, as in a plain start. Python's runner `PYTHONPATH` is put on `sys.path` where a
//! plain start has it, which the stub can do only when the interpreter started without one: with an image that
//! sets `PYTHONPATH`, a python execution with tools gets a plain start ([`takes_tools`]); node computes its module
//! paths again from the launch's environment. (Importing the python SDK ahead as well made tool executions 15 ms
//! instead of 32 ms in the latency bench, but every waiting interpreter 1.8 MiB larger and executions without tools
//! about 8 ms slower there, so it is not done.)

use protocol::{ExecuteRequest, Language};
use runtime::launch::Launch;

use containers::image::LanguageRuntime;

/// The python stub, run with `-c`.
pub const PYTHON: &str = include_str!("../../warm/python.py");
/// The node stub, run with `-e`.
pub const NODE: &str = include_str!("../../warm/node.js");

/// Environment variables (names, or prefixes ending in `*`) python reads while it starts: a request setting one
/// gets a plain start.
pub const PYTHON_STARTUP_VARIABLES: [&str; 6] =
    ["PYTHON*", "LANG", "LANGUAGE", "LC_*", "HOME", "TZ"];
/// The same for node (its options and paths, libuv's, ICU's locale, OpenSSL's).
pub const NODE_STARTUP_VARIABLES: [&str; 9] = [
    "NODE_*",
    "UV_*",
    "LANG",
    "LANGUAGE",
    "LC_*",
    "HOME",
    "TZ",
    "OPENSSL_*",
    "SSL_CERT_*",
];

/// The variables `lang`'s interpreter reads while it starts.
pub fn startup_variables(lang: Language) -> &'static [&'static str] {
    match lang {
        Language::Python => &PYTHON_STARTUP_VARIABLES,
        Language::Javascript => &NODE_STARTUP_VARIABLES,
        Language::Shell | Language::Elixir => &[],
    }
}

/// The warm interpreter of `lang`, if it has one: the language's command with the stub, the command's length (the
/// stub finds the script's path after it in the launch's arguments) and the base environment.
pub fn interpreter(lang: Language, rt: &LanguageRuntime) -> Option<Launch> {
    let (flag, stub, relay) = match lang {
        Language::Python => ("-c", PYTHON, false),
        Language::Javascript => ("-e", NODE, true),
        Language::Shell | Language::Elixir => return None,
    };
    let mut args = rt.command.clone();
    let skip = args.len();
    args.extend([flag.to_owned(), stub.to_owned(), skip.to_string()]);
    // `images.<name>.preload`: python or node module names, for the one interpreter on the image (the config checks).
    args.extend(rt.image.preload.iter().cloned());
    let env = containers::image::base_environment(&rt.image)
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    Some(Launch {
        relay,
        ..Launch::program(args, env)
    })
}

/// Gives every language that has one its warm interpreter (`enabled`: `pool.warm`).
pub fn enable(languages: &mut crate::exec::images::Languages, enabled: bool) {
    for (lang, rt) in languages.iter_mut() {
        rt.warm = if enabled {
            interpreter(*lang, rt)
        } else {
            None
        };
    }
}

/// Whether `req` may run in the waiting interpreter: it asks for no plain start and sets no variable the
/// interpreter reads while it starts (with tools, [`takes_tools`] too).
pub fn wanted(req: &ExecuteRequest) -> bool {
    let startup = startup_variables(req.language);
    req.warm != Some(false) && !req.env.keys().any(|k| read_at_startup(startup, k))
}

/// Whether an execution with tools may run in `rt`'s waiting interpreter: python's image sets no `PYTHONPATH` (the
/// runner's would replace it, which a started interpreter cannot undo); node's stub recomputes its paths.
pub fn takes_tools(lang: Language, rt: &LanguageRuntime) -> bool {
    // sandboxd's own base environment sets no PYTHONPATH: only the image's can.
    lang != Language::Python || !rt.image.env.iter().any(|(k, _)| k == "PYTHONPATH")
}

/// The smallest memory limit (MiB) an execution may have to run in a pooled container with a waiting interpreter,
/// which already holds memory of its own (python about 5 MiB, node about 7 MiB charged to the container). Below it,
/// the execution gets a container of its own from the cold path, with a plain start.
pub const MIN_MEMORY_MB: u64 = 16;

/// The most bytes of arguments and environment a launch may hand to the waiting interpreter, and the longest
/// single string (the kernel's `MAX_ARG_STRLEN`). A plain interpreter gets them through `execve`, which refuses
/// more (`E2BIG`, from a quarter of the stack limit on); a warm one would not, so a larger launch gets a plain
/// interpreter and the same refusal.
pub const MAX_HANDED_BYTES: usize = 256 << 10;
const MAX_ARG_STRLEN: usize = 32 * 4096;

/// Whether `launch`'s arguments and environment are well within what `execve` takes (see [`MAX_HANDED_BYTES`]).
pub fn fits_exec(launch: &Launch) -> bool {
    let strings = launch.args.iter().chain(&launch.env);
    let mut total = 0usize;
    for s in strings {
        if s.len() >= MAX_ARG_STRLEN {
            return false;
        }
        // The string, its NUL and its pointer.
        total += s.len() + 1 + std::mem::size_of::<usize>();
    }
    total <= MAX_HANDED_BYTES
}

fn read_at_startup(startup: &[&str], key: &str) -> bool {
    startup.iter().any(|v| match v.strip_suffix('*') {
        Some(prefix) => key.starts_with(prefix),
        None => key == *v,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_up_variables_ask_for_a_plain_start() {
        let mut req = ExecuteRequest::new(
            "a",
            Language::Python,
            "print(1)",
            protocol::RequestedLimits::new(1000, 64),
        );
        assert!(wanted(&req));
        req.tools
            .push(serde_json::from_value(serde_json::json!({"name": "read_file"})).unwrap());
        assert!(wanted(&req), "tools run warm too");
        req.env.insert("API_KEY".into(), "x".into());
        assert!(wanted(&req));
        for key in ["PYTHONPATH", "LC_ALL", "LANG", "HOME"] {
            let mut r = req.clone();
            r.env.insert(key.into(), "x".into());
            assert!(!wanted(&r), "{key}");
        }
        req.warm = Some(false);
        assert!(!wanted(&req));
        let mut js = ExecuteRequest::new(
            "b",
            Language::Javascript,
            "1",
            protocol::RequestedLimits::new(1000, 64),
        );
        js.env.insert("PYTHONPATH".into(), "x".into());
        assert!(wanted(&js), "python's variables are not node's");
        for key in [
            "NODE_OPTIONS",
            "UV_THREADPOOL_SIZE",
            "LC_ALL",
            "SSL_CERT_FILE",
        ] {
            let mut r = js.clone();
            r.env.insert(key.into(), "x".into());
            assert!(!wanted(&r), "{key}");
        }
    }

    #[test]
    fn a_launch_execve_would_refuse_gets_a_plain_interpreter() {
        let mut l = Launch {
            warm: true,
            ..Launch::program(
                vec!["/usr/bin/python3".into(), "/sandbox/main.py".into()],
                vec!["A=1".into()],
            )
        };
        assert!(fits_exec(&l));
        l.env.push(format!("HUGE={}", "e".repeat(MAX_ARG_STRLEN)));
        assert!(!fits_exec(&l), "one string over MAX_ARG_STRLEN");
        l.env.pop();
        l.env
            .extend((0..200).map(|i| format!("V{i}={}", "v".repeat(2048))));
        assert!(!fits_exec(&l), "over MAX_HANDED_BYTES in all");
    }

    #[test]
    fn python_and_node_have_an_interpreter_and_its_stub_finds_the_script() {
        let mut rt = containers::fake::shell();
        assert!(interpreter(Language::Shell, &rt).is_none());
        rt.command = vec!["/usr/bin/node".into()];
        let l = interpreter(Language::Javascript, &rt).unwrap();
        assert_eq!((l.args[1].as_str(), l.args[3].as_str()), ("-e", "1"));
        assert!(l.relay, "node takes no descriptors: its output is relayed");
        rt.command = vec!["/usr/bin/python3".into()];
        let l = interpreter(Language::Python, &rt).unwrap();
        assert!(!l.relay);
        assert_eq!(l.args[0], "/usr/bin/python3");
        assert_eq!(l.args[1], "-c");
        assert_eq!(l.args[3], "1");
        assert!(l.env.iter().any(|e| e == "PYTHONUNBUFFERED=1"));
        assert_eq!(l.args.len(), 4, "no preload");
        assert!(takes_tools(Language::Python, &rt));
        std::sync::Arc::get_mut(&mut rt.image)
            .unwrap()
            .env
            .push(("PYTHONPATH".into(), "/opt/lib".into()));
        assert!(
            !takes_tools(Language::Python, &rt),
            "the image's PYTHONPATH"
        );
        assert!(
            takes_tools(Language::Javascript, &rt),
            "node recomputes its paths"
        );
    }
}
