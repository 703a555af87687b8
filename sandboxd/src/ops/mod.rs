//! Start-up and operations: the start-up [`selftest`], what a previous daemon left ([`live_restore`]), systemd
//! [`notify`], [`doctor`], and the `images` subcommands ([`images_cli`]).

pub mod doctor;
pub mod images_cli;
pub mod live_restore;
pub mod notify;
pub mod selftest;
