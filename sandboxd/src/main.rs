//! The `sandboxd` binary: everything is in the library ([`sandboxd::main`]).

fn main() -> std::process::ExitCode {
    sandboxd::main()
}
