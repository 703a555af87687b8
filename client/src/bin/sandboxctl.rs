//! `sandboxctl` (work in progress).

fn main() {}
