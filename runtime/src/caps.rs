//! Capabilities: the program starts with all five sets empty. libcontainer drops them as the spec says; the
//! container's init checks the result with the `caps` crate right before `execve`, so a runtime regression fails
//! the execution instead of running the program with privileges. On the other side, the daemon checks at start-up
//! that it holds what its container helper uses ([`ensure_held`]), so a service manager that took one away stops
//! the daemon with the reason instead of failing every container start.

use caps::{CapSet, Capability, CapsHashSet};

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

/// What the container helper uses in the host's user namespace for every container: `CAP_SYS_ADMIN` (namespaces,
/// mounts, cgroups), `CAP_SETGID` and `CAP_SETUID` (each container's namespaces are created under its own host
/// gid and uid, [`crate::direct`]).
pub const HELPER_NEEDS: [Capability; 3] = [
    Capability::CAP_SYS_ADMIN,
    Capability::CAP_SETGID,
    Capability::CAP_SETUID,
];

/// Fails unless the calling thread's effective set holds every capability in `needed`. The error names the missing
/// ones and whether the bounding set still has them (then something dropped them before the daemon started, and
/// `no_new_privs` kept `execve` from giving them back).
pub fn ensure_held(needed: &[Capability]) -> Result<()> {
    let read = |set| caps::read(None, set).map_err(|source| CapsError::Read { set, source });
    let effective = read(CapSet::Effective)?;
    let bounding = read(CapSet::Bounding)?;
    match missing(needed, &effective, &bounding) {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

fn missing(
    needed: &[Capability],
    effective: &CapsHashSet,
    bounding: &CapsHashSet,
) -> Option<CapsError> {
    let lacking: Vec<&Capability> = needed.iter().filter(|c| !effective.contains(c)).collect();
    if lacking.is_empty() {
        return None;
    }
    Some(CapsError::Missing {
        in_bounding: lacking.iter().all(|c| bounding.contains(c)),
        missing: lacking.iter().map(|c| c.to_string()).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(caps: &[Capability]) -> CapsHashSet {
        caps.iter().copied().collect()
    }

    #[test]
    fn a_capability_dropped_below_the_bounding_set_names_the_systemd_cause() {
        // What systemd 257 leaves a unit with User=root, ProtectKernelModules= and NoNewPrivileges=.
        let effective = set(&[Capability::CAP_SYS_ADMIN, Capability::CAP_SETGID]);
        let bounding = set(&HELPER_NEEDS);
        let e = missing(&HELPER_NEEDS, &effective, &bounding).expect("CAP_SETUID is missing");
        let text = e.to_string();
        assert!(text.contains("CAP_SETUID"), "{text}");
        assert!(!text.contains("CAP_SETGID"), "{text}");
        assert!(text.contains("User="), "{text}");
        assert!(
            matches!(
                e,
                CapsError::Missing {
                    in_bounding: true,
                    ..
                }
            ),
            "{e:?}"
        );
    }

    #[test]
    fn a_capability_outside_the_bounding_set_names_the_bounding_set() {
        let effective = set(&[Capability::CAP_SYS_ADMIN]);
        let bounding = set(&[Capability::CAP_SYS_ADMIN, Capability::CAP_SETUID]);
        let e = missing(&HELPER_NEEDS, &effective, &bounding).expect("two are missing");
        let text = e.to_string();
        assert!(text.contains("CAP_SETGID, CAP_SETUID"), "{text}");
        assert!(text.contains("CapabilityBoundingSet="), "{text}");
        assert!(missing(&HELPER_NEEDS, &bounding, &bounding).is_some());
        assert!(missing(&HELPER_NEEDS, &set(&HELPER_NEEDS), &set(&[])).is_none());
    }

    #[test]
    fn a_root_test_process_holds_what_the_helper_needs() {
        if !test_support::require_root(
            "a_root_test_process_holds_what_the_helper_needs",
            "the capabilities of root",
        ) {
            return;
        }
        ensure_held(&HELPER_NEEDS).expect("root holds the helper's capabilities");
    }

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
