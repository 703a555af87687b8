//! Capabilities: the program starts with all five sets empty. libcontainer drops them as the spec says; the
//! container's init checks the result with the `caps` crate right before `execve`, so a runtime regression fails
//! the execution instead of running the program with privileges.

use caps::CapSet;

use crate::error::Result;

pub use crate::error::CapsError;

/// The sets checked, in the order `/proc/self/status` lists them.
pub const SETS: [CapSet; 5] = [
    CapSet::Inheritable,
    CapSet::Permitted,
    CapSet::Effective,
    CapSet::Bounding,
    CapSet::Ambient,
];

/// Fails unless every capability set of the calling thread is empty.
pub fn ensure_none() -> Result<()> {
    for set in SETS {
        let held = caps::read(None, set).map_err(|source| CapsError::Read { set, source })?;
        if !held.is_empty() {
            let mut held: Vec<String> = held.iter().map(|c| c.to_string()).collect();
            held.sort();
            return Err(CapsError::Held { set, held }.into());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_privileged_test_process_is_refused() {
        // The test runner is not a sandboxed program: as root it holds capabilities and must be refused; as an
        // unprivileged user it holds none (or only a bounding set) and the check names what it found.
        match ensure_none() {
            Ok(()) => assert!(
                !test_support::is_root(),
                "root with no capabilities at all?"
            ),
            Err(e) => assert!(e.to_string().contains("capability set"), "{e}"),
        }
    }
}
