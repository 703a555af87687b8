//! The protocol's extensions an execution can ask for: [`tools`] (calls from the sandboxed code to the client's
//! tools) and [`egress`] (the `network` extension's proxy).

pub mod egress;
pub mod tools;
