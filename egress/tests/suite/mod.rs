mod common;
mod connect;
mod limits;
mod logs;
mod plain;
mod resolver;
