//! The start-up self-test: one real execution per configured language before the daemon serves, checked from
//! inside the container (seccomp filter installed, no capability held, `no_new_privs` set). A daemon that cannot
//! run them (a state directory the container user cannot traverse, a broken image, an interpreter that does not
//! start) refuses to start instead of reporting healthy and failing every execution.

use std::sync::Arc;

use protocol::{Language, Reason, ServerMessage};
use tokio::sync::mpsc;

use crate::exec::engine::Engine;
use crate::exec::registry::Registry;

/// Why the self-test failed.
#[derive(Debug, thiserror::Error)]
pub enum SelfTestError {
    /// One language's execution failed.
    #[error("{language}")]
    Language {
        /// The language.
        language: Language,
        /// What went wrong.
        #[source]
        source: Box<SelfTestError>,
    },
    /// The execution id is already registered (cannot happen with a fresh registry).
    #[error("self-test id in use")]
    IdInUse,
    /// The self-test's limits are refused by the configured maxima.
    #[error("the self-test's limits are refused")]
    Limits(#[source] protocol::RequestError),
    /// The execution's messages ended without a `result` or an `error`.
    #[error("the self-test execution ended without a result")]
    NoResult,
    /// The program ran but did not confirm the isolation layers.
    #[error("the self-test execution ended {reason:?} (exit {exit_code:?}): an isolation layer is not in effect or the interpreter does not run; output: {output:?}")]
    Unconfirmed {
        /// The result's reason.
        reason: Reason,
        /// The result's exit code.
        exit_code: Option<i32>,
        /// The first 400 characters of stdout and stderr.
        output: String,
    },
    /// The execution ended with an `error` message.
    #[error("the self-test execution failed: {0}")]
    Failed(String),
    /// A module of the image's preload list does not import on the image.
    #[error("images.{image}.preload: {detail}: the module does not import on the image (install it in the image or take it off the list)")]
    Preload {
        /// The image's name.
        image: String,
        /// The module and the exception it raised.
        detail: String,
    },
}

/// What the self-test prints before the module and the reason when a preload module does not load.
const PRELOAD_FAILED: &str = "preload-failed ";

/// The self-test program per language: from inside the container, check that the seccomp filter is installed, no
/// capability is held and `no_new_privs` is set, then print `self-test-ok`. Only the language's own interpreter is
/// used (an image may have no grep). A python or javascript program first loads the image's `preload` modules: the
/// warm interpreter loads them before it waits and skips one that fails, so one that cannot be loaded is refused
/// here, at start, rather than found by the first program that uses it.
fn self_test_program(lang: Language, preload: &[String]) -> String {
    let checks = isolation_check(lang);
    if preload.is_empty() {
        return checks.to_owned();
    }
    // Module names are checked by the config, and written as a JSON (and so python and javascript) list.
    let modules = serde_json::to_string(preload).unwrap_or_default();
    match lang {
        Language::Python => format!(
            "import importlib\nfor _m in {modules}:\n    try:\n        importlib.import_module(_m)\n    \
             except BaseException as _e:\n        print(\"{PRELOAD_FAILED}\" + _m + \": \" + type(_e).__name__ + \": \" + str(_e))\n        \
             raise SystemExit(3)\n{checks}"
        ),
        Language::Javascript => format!(
            "for (const m of {modules}) {{\n  try {{\n    require(m);\n  }} catch (e) {{\n    \
             console.log(\"{PRELOAD_FAILED}\" + m + \": \" + String(e && e.message).split(\"\\n\")[0]);\n    \
             process.exit(3);\n  }}\n}}\n{checks}"
        ),
        Language::Shell | Language::Elixir => checks.to_owned(),
    }
}

/// The isolation check of [`self_test_program`] in `lang`.
fn isolation_check(lang: Language) -> &'static str {
    match lang {
        Language::Shell => {
            r#"ok=0
while IFS=: read -r k v; do
  v=$(echo $v)
  case "$k" in
    Seccomp) [ "$v" = 2 ] && ok=$((ok+1)) ;;
    CapEff|CapBnd) [ "$v" = 0000000000000000 ] && ok=$((ok+1)) ;;
    NoNewPrivs) [ "$v" = 1 ] && ok=$((ok+1)) ;;
  esac
done < /proc/self/status
[ "$ok" = 4 ] && echo self-test-ok"#
        }
        Language::Python => {
            r#"s = {k: v.strip() for k, v in (l.split(":", 1) for l in open("/proc/self/status"))}
z = "0" * 16
ok = s["Seccomp"] == "2" and s["CapEff"] == z and s["CapBnd"] == z and s["NoNewPrivs"] == "1"
print("self-test-ok" if ok else s)"#
        }
        Language::Javascript => {
            r#"const s = Object.fromEntries(require("fs").readFileSync("/proc/self/status", "utf8").trim().split("\n")
  .map((l) => { const i = l.indexOf(":"); return [l.slice(0, i), l.slice(i + 1).trim()]; }));
const z = "0".repeat(16);
const ok = s.Seccomp === "2" && s.CapEff === z && s.CapBnd === z && s.NoNewPrivs === "1";
console.log(ok ? "self-test-ok" : JSON.stringify(s));"#
        }
        Language::Elixir => {
            r#"s = File.read!("/proc/self/status") |> String.split("\n", trim: true) |> Map.new(fn l -> [k, v] = String.split(l, ":", parts: 2); {k, String.trim(v)} end)
z = String.duplicate("0", 16)
IO.puts(if s["Seccomp"] == "2" and s["CapEff"] == z and s["CapBnd"] == z and s["NoNewPrivs"] == "1", do: "self-test-ok", else: inspect(s))"#
        }
    }
}

/// Runs one real execution per configured language before the daemon serves (see [`self_test_program`]).
pub async fn self_test(engine: Arc<Engine>) -> Result<(), SelfTestError> {
    let languages: Vec<Language> = engine.languages().keys().copied().collect();
    for language in languages {
        self_test_one(engine.clone(), language)
            .await
            .map_err(|e| SelfTestError::Language {
                language,
                source: Box::new(e),
            })?;
    }
    Ok(())
}

async fn self_test_one(engine: Arc<Engine>, lang: Language) -> Result<(), SelfTestError> {
    let registry = Registry::default();
    let id = format!("sandboxd-self-test-{lang}");
    let (registration, control) = registry.register(&id).ok_or(SelfTestError::IdInUse)?;
    let max = engine.max_limits();
    // Interpreters like the BEAM need more than the default 64 MiB to start.
    let image = engine.languages().get(&lang).map(|rt| rt.image.clone());
    let preload = image.as_ref().map_or(&[][..], |i| &i.preload[..]);
    let req = protocol::ExecuteRequest::new(
        &id,
        lang,
        self_test_program(lang, preload),
        protocol::RequestedLimits::new(max.timeout_ms.min(60_000), max.memory_mb.min(512)),
    );
    let limits = req.resolve_limits(&max).map_err(SelfTestError::Limits)?;
    let admission = engine.admit();
    let (tx, mut rx) = mpsc::channel(16);
    let task = tokio::spawn(
        engine
            .clone()
            .run(req, limits, admission, tx, control, registration),
    );
    let (mut stdout, mut stderr) = (String::new(), String::new());
    let mut outcome = Err(SelfTestError::NoResult);
    while let Some(m) = rx.recv().await {
        match m {
            ServerMessage::Stdout(c) => stdout.push_str(&c.data),
            ServerMessage::Stderr(c) => stderr.push_str(&c.data),
            ServerMessage::Result(r)
                if r.exit_code == Some(0) && stdout.contains("self-test-ok") =>
            {
                outcome = Ok(());
                break;
            }
            ServerMessage::Result(_) if stdout.contains(PRELOAD_FAILED) => {
                let detail = stdout.split_once(PRELOAD_FAILED).map_or("", |(_, d)| d);
                outcome = Err(SelfTestError::Preload {
                    image: image.as_ref().map_or_else(String::new, |i| i.name.clone()),
                    detail: detail.trim().chars().take(400).collect(),
                });
                break;
            }
            ServerMessage::Result(r) => {
                outcome = Err(SelfTestError::Unconfirmed {
                    reason: r.reason,
                    exit_code: r.exit_code,
                    output: format!("{stdout}{stderr}").chars().take(400).collect(),
                });
                break;
            }
            ServerMessage::Error(e) => {
                outcome = Err(SelfTestError::Failed(e.message));
                break;
            }
            _ => {}
        }
    }
    // The execution frees its slot only after its container is removed: wait for that, so the next self-test
    // finds a free slot even with `max_concurrent: 1` and no queue. The control sender (the registry) stays alive
    // until then so the execution is not seen as disconnected.
    drop(rx);
    let _ = task.await;
    drop(registry);
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The language's program, run by the host's interpreter (outside a container its isolation check prints the
    /// status instead of `self-test-ok`): a module that loads passes on to the check, one that does not is named.
    fn run(lang: Language, preload: &[&str]) -> (Option<i32>, String) {
        let preload: Vec<String> = preload.iter().map(|s| (*s).to_owned()).collect();
        let (interpreter, flag) = match lang {
            Language::Javascript => ("node", "-e"),
            _ => ("python3", "-c"),
        };
        let out = std::process::Command::new(interpreter)
            .args([flag, &self_test_program(lang, &preload)])
            .output()
            .expect("the interpreter runs");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into(),
        )
    }

    #[test]
    fn a_preload_module_that_does_not_import_is_named() {
        let (code, out) = run(Language::Python, &["json", "sandboxd_no_such_module", "os"]);
        assert_eq!(code, Some(3), "{out}");
        assert_eq!(
            out.trim(),
            "preload-failed sandboxd_no_such_module: ModuleNotFoundError: No module named 'sandboxd_no_such_module'"
        );
    }

    #[test]
    fn preload_modules_that_import_go_on_to_the_isolation_check() {
        let (code, out) = run(Language::Python, &["json", "os.path"]);
        assert_eq!(code, Some(0), "{out}");
        assert!(
            !out.contains(PRELOAD_FAILED) && out.contains("Seccomp"),
            "{out}"
        );
        // Without a preload list the program is the isolation check alone.
        assert_eq!(
            self_test_program(Language::Python, &[]),
            isolation_check(Language::Python)
        );
        assert_eq!(
            self_test_program(Language::Shell, &["json".into()]),
            isolation_check(Language::Shell)
        );
    }

    /// The javascript program: a module that loads goes on to the isolation check, one that does not is named with
    /// node's reason.
    #[test]
    fn a_node_preload_module_that_does_not_load_is_named() {
        let (code, out) = run(
            Language::Javascript,
            &["zlib", "sandboxd-no-such-module", "fs"],
        );
        assert_eq!(code, Some(3), "{out}");
        assert_eq!(
            out.trim(),
            "preload-failed sandboxd-no-such-module: Cannot find module 'sandboxd-no-such-module'"
        );
        let (code, out) = run(Language::Javascript, &["zlib", "node:path"]);
        assert_eq!(code, Some(0), "{out}");
        assert!(
            !out.contains(PRELOAD_FAILED) && out.contains("Seccomp"),
            "{out}"
        );
    }
}
