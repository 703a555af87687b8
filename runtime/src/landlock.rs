//! Landlock: which paths a program may read, write and execute, enforced by the kernel below the mount namespace.
//!
//! The image (`/usr`, `/etc`, the code) is read-only, any directory may be listed, `/workspace`, `/tmp` and `/dev/shm` are read-write, the
//! device nodes of `/dev` are readable and writable but no device can be created anywhere, `/proc` is read-only.
//! The ruleset handles every filesystem right the kernel's ABI knows; anything short of `FullyEnforced` is an
//! error, never a warning.

use std::path::PathBuf;

use ::landlock::{
    path_beneath_rules, Access, AccessFs, CompatLevel, Compatible, Ruleset, RulesetAttr,
    RulesetCreatedAttr, RulesetStatus, ABI,
};

use crate::error::Result;

pub use crate::error::LandlockError;

/// The highest ABI this build knows how to use.
pub const MAX_ABI: i32 = 7;

/// Paths and the ABI, fixed when the daemon starts.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Policy {
    /// ABI to handle (the kernel's, capped at [`MAX_ABI`]).
    pub abi: i32,
    /// Read and execute.
    pub read_only: Vec<PathBuf>,
    /// Read, write, create, remove, execute (no device nodes).
    pub read_write: Vec<PathBuf>,
    /// Device nodes: read, write, ioctl; nothing created.
    pub devices: Vec<PathBuf>,
}

impl Policy {
    /// The policy of an execution in the host image: `read_only` are the image's bind mounts.
    pub fn for_execution(abi: i32, read_only: Vec<PathBuf>) -> Self {
        Self {
            abi,
            read_only,
            read_write: vec!["/workspace".into(), "/tmp".into(), "/dev/shm".into()],
            devices: vec!["/dev".into()],
        }
    }

    /// The policy of an execution on an OCI image's overlay root: everything is readable; the image's own top-level
    /// directories (`image_dirs`, e.g. `/usr`, `/var`) are writable as far as file permissions allow, since every
    /// write there lands in the execution's throw-away overlay upper layer. `/proc`, `/sys`, `/dev` (but for its
    /// device nodes and `/dev/shm`) and the code directory stay read-only.
    pub fn for_image(abi: i32, image_dirs: Vec<PathBuf>) -> Self {
        let mut p = Self::for_execution(abi, vec!["/".into()]);
        p.read_write.extend(image_dirs);
        p
    }

    /// Restricts the calling thread (and what it execs). Fails unless the ruleset is fully enforced.
    pub fn restrict_self(&self) -> Result<()> {
        let abi = ABI::from(self.abi.min(MAX_ABI));
        if abi == ABI::Unsupported {
            return Err(LandlockError::Abi(self.abi).into());
        }
        let all = AccessFs::from_all(abi);
        let no_devices = all & !(AccessFs::MakeChar | AccessFs::MakeBlock);
        let devices = AccessFs::from_read(abi) | AccessFs::WriteFile | (all & AccessFs::IoctlDev);
        let fail = LandlockError::Ruleset;
        let status = Ruleset::default()
            .set_compatibility(CompatLevel::HardRequirement)
            .handle_access(all)
            .map_err(fail)?
            .create()
            .map_err(fail)?
            .add_rules(path_beneath_rules(
                &self.read_only,
                AccessFs::from_read(abi),
            ))
            .map_err(fail)?
            .add_rules(path_beneath_rules(&self.read_write, no_devices))
            .map_err(fail)?
            .add_rules(path_beneath_rules(&self.devices, devices))
            .map_err(fail)?
            // Listing directories (not reading files) anywhere: `ls /` and directory walks keep working.
            .add_rules(path_beneath_rules(["/"], AccessFs::ReadDir))
            .map_err(fail)?
            .restrict_self()
            .map_err(fail)?;
        match status.ruleset {
            RulesetStatus::FullyEnforced if status.no_new_privs => Ok(()),
            other => Err(LandlockError::NotEnforced {
                status: other,
                no_new_privs: status.no_new_privs,
            }
            .into()),
        }
    }
}
