//! `fsp-conformance` (work in progress).

fn main() {}
