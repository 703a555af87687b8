//! The two filters of a profile as one program: the denylist, whose every `RET ALLOW` jumps on to the allowlist.
//!
//! Why: the kernel runs every installed filter on every system call, each run with its own call and set-up, and
//! installs each with an allocation, a conversion, a JIT and a cache of its own. One program answers the same
//! with one run per system call and one install. (The conversion and the JIT grow with the program's length, which
//! chaining does not shorten: measured, the gain is small, 1-2 % of a shell execution's CPU.)
//!
//! The same answers: with the allowlist installed first and the denylist second, the kernel runs both and keeps the
//! answer of highest precedence (`KILL` over `ERRNO` over `ALLOW`), the denylist's on a tie (the newest filter is
//! run first and kept unless an older one is strictly higher). The denylist answers only `ALLOW`, `ERRNO(EPERM)`
//! and its foreign-architecture `KILL`, so: its `EPERM` or `KILL` stands whatever the allowlist says (the
//! allowlist's `ERRNO(ENOSYS)` ties with `EPERM` and loses, its `ALLOW` is lower), and where it allows, the answer
//! is the allowlist's. That is the chained program, instruction for instruction: the denylist with each `RET ALLOW`
//! replaced by a jump to the allowlist's first instruction (classic BPF jumps forward only; `JA` takes a 32-bit
//! offset), then the allowlist unchanged. [`chain`] checks it against both programs on every syscall number up to
//! [`super::search::CHECKED_UP_TO`], for the native architecture and a foreign one, before it is used; a
//! difference is an error and nothing is installed.

use seccompiler::{sock_filter, BpfProgram};

use super::search::{emulate, CHECKED_UP_TO, JMP_JA, RET_K};
use crate::error::SeccompError;

/// The kernel's `SECCOMP_RET_ALLOW`.
const RET_ALLOW: u32 = 0x7fff_0000;
/// The longest program the kernel takes (`BPF_MAXINSNS`).
const MAX_INSNS: usize = 4096;

/// What the kernel answers with `older` installed, then `newer` (`seccomp_run_filters`: actions compare as signed
/// values of their top 16 bits, the lowest wins; on a tie the newer filter's answer stays).
pub fn installed_in_turn(older: u32, newer: u32) -> u32 {
    let action = |ret: u32| (ret & 0xffff_0000) as i32;
    if action(older) < action(newer) {
        older
    } else {
        newer
    }
}

/// `deny` then `allow` as one program that answers as the two installed allowlist first (see the module's
/// documentation), checked by emulation on every syscall number.
pub fn chain(deny: &[sock_filter], allow: &[sock_filter]) -> Result<BpfProgram, SeccompError> {
    if deny.len() + allow.len() > MAX_INSNS {
        return Err(SeccompError::ChainTooLong(deny.len() + allow.len()));
    }
    let start = deny.len();
    let mut prog: BpfProgram = deny
        .iter()
        .enumerate()
        .map(|(i, insn)| {
            if insn.code == RET_K && insn.k == RET_ALLOW {
                sock_filter {
                    code: JMP_JA,
                    jt: 0,
                    jf: 0,
                    // From the next instruction to the allowlist's first: fits, both are under MAX_INSNS.
                    k: (start - i - 1) as u32,
                }
            } else {
                insn.clone()
            }
        })
        .collect();
    prog.extend_from_slice(allow);
    // The architecture the profile was compiled for (its preamble's comparison), and one it was not.
    let native = deny.get(1).map_or(0, |insn| insn.k);
    for arch in [native, native ^ 0x0100_0000] {
        for nr in 0..CHECKED_UP_TO {
            let separate = emulate(deny, arch, nr)
                .zip(emulate(allow, arch, nr))
                .map(|(d, a)| installed_in_turn(a, d));
            let chained = emulate(&prog, arch, nr);
            // An answer the emulator cannot tell is a difference too: nothing unchecked is installed.
            if separate.is_none() || chained != separate {
                return Err(SeccompError::Chain {
                    nr,
                    arch,
                    chained,
                    separate,
                });
            }
        }
    }
    Ok(prog)
}

#[cfg(test)]
mod tests {
    use super::super::search::{emulate_call, JMP_JEQ_K, JMP_JGE_K, JMP_JGT_K, JMP_JSET_K};
    use super::*;

    const KILL_PROCESS: u32 = 0x8000_0000;
    const ENOSYS: u32 = 0x0005_0026;
    const EPERM: u32 = 0x0005_0001;

    #[test]
    fn two_filters_answer_by_precedence_and_the_newer_on_a_tie() {
        assert_eq!(installed_in_turn(ENOSYS, EPERM), EPERM, "a tie: the newer");
        assert_eq!(installed_in_turn(EPERM, ENOSYS), ENOSYS, "a tie: the newer");
        assert_eq!(installed_in_turn(ENOSYS, RET_ALLOW), ENOSYS);
        assert_eq!(installed_in_turn(RET_ALLOW, EPERM), EPERM);
        assert_eq!(installed_in_turn(RET_ALLOW, RET_ALLOW), RET_ALLOW);
        assert_eq!(installed_in_turn(KILL_PROCESS, EPERM), KILL_PROCESS);
        assert_eq!(installed_in_turn(EPERM, KILL_PROCESS), KILL_PROCESS);
    }

    /// Beyond the syscall numbers [`chain`] checks at compile time: arguments equal to every constant the denylist
    /// compares with, and its neighbours, in all six positions.
    #[test]
    fn the_chained_program_answers_as_both_filters_by_argument() {
        for (text, arch) in [
            (crate::seccomp::X86_64, seccompiler::TargetArch::x86_64),
            (crate::seccomp::AARCH64, seccompiler::TargetArch::aarch64),
        ] {
            let p = crate::seccomp::compile(text, arch).unwrap();
            let audit = p.deny[1].k;
            let constants: std::collections::BTreeSet<u32> = p
                .deny
                .iter()
                .filter(|i| [JMP_JEQ_K, JMP_JGT_K, JMP_JGE_K, JMP_JSET_K].contains(&i.code))
                .map(|i| i.k)
                .collect();
            let mut vectors = vec![[0u64; 6]];
            for c in &constants {
                for v in [c.wrapping_sub(1), *c, c.wrapping_add(1)] {
                    vectors.push([u64::from(v); 6]);
                }
            }
            let mut eperm = 0;
            for nr in 0..512 {
                for a in &vectors {
                    let deny = emulate_call(&p.deny, audit, nr, a).unwrap();
                    let allow = emulate_call(&p.allow, audit, nr, a).unwrap();
                    let chained = emulate_call(&p.program, audit, nr, a).unwrap();
                    assert_eq!(chained, installed_in_turn(allow, deny), "{nr} {a:?}");
                    eperm += usize::from(chained == EPERM);
                }
            }
            assert!(eperm > 0, "the cases reach the denylist's refusals");
            assert_eq!(p.program.len(), p.deny.len() + p.allow.len());
        }
    }
}
