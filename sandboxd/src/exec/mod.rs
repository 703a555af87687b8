//! An execution from admission to its result: admission ([`capacity`]), the executions of each connection
//! ([`registry`]), the [`engine`] (one task per execution: output streams, how it ended, artifacts), the warm
//! [`pool`] of started containers and their interpreters ([`warm`]), and the [`images`] each language runs on.

pub mod capacity;
pub mod engine;
pub mod images;
pub mod pool;
pub mod registry;
pub mod warm;
