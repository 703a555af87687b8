//! What outlives an execution on disk: the artifact [`store`] and its [`upload`]s, [`volumes`], and the
//! copy-on-write store of agent workspaces ([`cow`]).

pub mod cow;
pub mod store;
pub mod upload;
pub mod volumes;
