//! The few raw system calls nix does not wrap, each checked and with its `SAFETY` argument.

use std::os::fd::RawFd;

use crate::error::{Error, Result};

/// Closes every descriptor in `first..=last` (`close_range(2)`).
pub fn close_range(first: RawFd, last: RawFd) -> Result<()> {
    if first > last {
        return Ok(());
    }
    // SAFETY: close_range takes plain integers and touches only this process's descriptor table; closing
    // descriptors that Rust objects still own is avoided by the callers, which only call it in the container's
    // init right before it stops using anything but the descriptors it keeps.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            first as libc::c_uint,
            last as libc::c_uint,
            0u32,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::sys("close_range", nix::Error::last()))
    }
}

/// Asks the kernel to send `signal` to this process when its parent dies (`PR_SET_PDEATHSIG`).
pub fn set_parent_death_signal(signal: nix::sys::signal::Signal) -> Result<()> {
    nix::sys::prctl::set_pdeathsig(signal).map_err(|e| Error::sys("prctl(PR_SET_PDEATHSIG)", e))
}

/// Marks this process non-dumpable, so processes of the same uid cannot ptrace it or read its `/proc` files.
pub fn set_not_dumpable() -> Result<()> {
    nix::sys::prctl::set_dumpable(false).map_err(|e| Error::sys("prctl(PR_SET_DUMPABLE)", e))
}
