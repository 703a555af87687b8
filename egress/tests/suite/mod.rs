mod common;
mod connect;
mod limits;
mod plain;
