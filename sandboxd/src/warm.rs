//! Warm interpreters: a pooled python container's init starts the interpreter ahead of time, and the launch hands
//! it the code ([`runtime::init`] has the init's half, `warm/python.py` the interpreter's).
//!
//! The interpreter starts with the image's base environment (sandboxd's and the image's, without the request's),
//! imports `site` and the stub's few modules, and waits. At the launch it takes the request's stdio, environment
//! and arguments and runs the code file as `__main__`, as `python3 /sandbox/main.py` would. What the interpreter
//! reads only while it starts cannot change afterwards, so a request that sets such a variable
//! ([`STARTUP_VARIABLES`]) or asks for a plain start gets a freshly executed interpreter instead ([`wanted`]), and
//! so does one whose arguments and environment `execve` could refuse ([`fits_exec`]) and a container from the cold
//! path.
//!
//! An execution with tools runs in the waiting interpreter too: the stub runs the tool runner as the script, which
//! imports the SDK at the launch, as in a plain start. The runner's `PYTHONPATH` is put on `sys.path` where a plain
//! start has it, which the stub can do only when the interpreter started without one: with an image that sets
//! `PYTHONPATH`, an execution with tools gets a plain start ([`takes_tools`]). (Importing the SDK ahead as well
//! made tool executions 15 ms instead of 32 ms in the latency bench, but every waiting interpreter 1.8 MiB larger
//! and executions without tools about 8 ms slower there, so it is not done.)

use protocol::{ExecuteRequest, Language};
use runtime::launch::Launch;

use crate::images::LanguageRuntime;

/// The python stub, run with `-c`.
pub const PYTHON: &str = include_str!("../warm/python.py");

/// Environment variables (names, or prefixes ending in `*`) the interpreter reads while it starts: a request
/// setting one gets a plain start.
pub const STARTUP_VARIABLES: [&str; 6] = ["PYTHON*", "LANG", "LANGUAGE", "LC_*", "HOME", "TZ"];

/// The warm interpreter of `lang`, if it has one: the language's command with the stub, the command's length (the
/// stub finds the script's path after it in the launch's arguments) and the base environment.
pub fn interpreter(lang: Language, rt: &LanguageRuntime) -> Option<Launch> {
    let stub = match lang {
        Language::Python => PYTHON,
        Language::Javascript | Language::Shell | Language::Elixir => return None,
    };
    let mut args = rt.command.clone();
    let skip = args.len();
    args.extend(["-c".to_owned(), stub.to_owned(), skip.to_string()]);
    args.extend(rt.image.preload.iter().cloned());
    let env = crate::images::base_environment(&rt.image)
        .into_iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    Some(Launch {
        args,
        env,
        warm: false,
    })
}

/// Gives every language that has one its warm interpreter (`enabled`: `pool.warm`).
pub fn enable(languages: &mut crate::images::Languages, enabled: bool) {
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
    req.warm != Some(false) && !req.env.keys().any(|k| read_at_startup(k))
}

/// Whether an execution with tools may run in `rt`'s waiting interpreter: its image sets no `PYTHONPATH` (the
/// runner's would replace it, which a started interpreter cannot undo).
pub fn takes_tools(rt: &LanguageRuntime) -> bool {
    // sandboxd's own base environment sets no PYTHONPATH: only the image's can.
    !rt.image.env.iter().any(|(k, _)| k == "PYTHONPATH")
}

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

fn read_at_startup(key: &str) -> bool {
    STARTUP_VARIABLES.iter().any(|v| match v.strip_suffix('*') {
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
    }

    #[test]
    fn a_launch_execve_would_refuse_gets_a_plain_interpreter() {
        let mut l = Launch {
            args: vec!["/usr/bin/python3".into(), "/sandbox/main.py".into()],
            env: vec!["A=1".into()],
            warm: true,
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
    fn only_python_has_an_interpreter_and_its_stub_finds_the_script() {
        let mut rt = crate::containers::fake::shell();
        assert!(interpreter(Language::Shell, &rt).is_none());
        rt.command = vec!["/usr/bin/python3".into()];
        let l = interpreter(Language::Python, &rt).unwrap();
        assert_eq!(l.args[0], "/usr/bin/python3");
        assert_eq!(l.args[1], "-c");
        assert_eq!(l.args[3], "1");
        assert!(l.env.iter().any(|e| e == "PYTHONUNBUFFERED=1"));
        assert_eq!(l.args.len(), 4, "no preload");
        assert!(takes_tools(&rt));
        std::sync::Arc::get_mut(&mut rt.image)
            .unwrap()
            .env
            .push(("PYTHONPATH".into(), "/opt/lib".into()));
        assert!(!takes_tools(&rt), "the image's PYTHONPATH");
    }
}
