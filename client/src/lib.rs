//! Orchestrator client for sandboxd (work in progress).
