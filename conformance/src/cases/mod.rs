//! Every case of the suite, by spec section (`P.*`), isolation posture (`I.*`), resources and lifecycle (`R.*`)
//! extension (`E.*`), agent sandboxes (`A.*`), volumes (`V.*`) and snapshots (`S.*`); the helpers they share are in [`common`]. Ids are stable: a case is never renumbered,
//! a retired id is not reused.

use crate::framework::Case;

pub mod agents;
pub mod capacity;
pub mod common;
pub mod envelope;
pub mod isolation;
pub mod messages;
pub mod network;
pub mod requests;
pub mod resources;
pub mod sequences;
pub mod snapshots;
pub mod tools;
pub mod transport;
pub mod volumes;

/// Every case, in run order: the groups' tables one after the other.
pub fn all() -> Vec<Case> {
    [
        transport::CASES,
        envelope::CASES,
        requests::CASES,
        messages::CASES,
        sequences::CASES,
        capacity::CASES,
        resources::CASES,
        isolation::CASES,
        tools::CASES,
        network::CASES,
        agents::CASES,
        volumes::CASES,
        snapshots::CASES,
    ]
    .concat()
}
