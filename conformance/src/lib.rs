//! FSP/1 conformance suite (work in progress).
