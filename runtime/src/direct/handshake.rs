//! The words the helper and a cloned init exchange over their socket during set-up: the helper's go, and the
//! init's report (`ok`, or the text of the step that failed, cut to [`REPORT_MAX`] bytes).

/// The go message (helper to init).
pub const GO: &[u8] = b"go";
/// The success report (init to helper).
pub const OK: &[u8] = b"ok";
/// The longest set-up report the init sends (a failed step's text is cut to this).
pub const REPORT_MAX: usize = 4096;
