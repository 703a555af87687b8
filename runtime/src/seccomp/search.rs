//! The allowlist as a binary search over syscall numbers instead of seccompiler's linear chain.
//!
//! Why: when a filter is installed, the kernel (5.11 and later) builds a per-filter cache of the syscalls it always
//! allows by running the filter in an emulator for every syscall number of the architecture, under the task's
//! `siglock` with interrupts off. seccompiler compiles an allowlist as one comparison per syscall (five instructions
//! each), so the emulation walks up to the whole chain for each of the ~450 numbers: the largest single cost of
//! starting a container's init in the profile of the throughput bench. A search tree answers each number in about
//! ten steps, and is half as long for the JIT.
//!
//! How, without a second source of truth: seccompiler still compiles the profile (names to numbers, validation);
//! [`relayout`] reads the set of allowed numbers back out of seccompiler's program by running it in [`emulate`], lays
//! the set out as a tree, and then checks the tree against seccompiler's program on every syscall number up to
//! [`CHECKED_UP_TO`] and on every constant either program compares with (and its neighbours), for the native
//! architecture and a foreign one. Both programs only compare the syscall number with constants, so agreeing on
//! those points is agreeing everywhere. A program of another shape (argument checks, other loads) is left as it
//! is; a tree that disagrees is an error, never installed.
//!
//! Written by hand because neither seccompiler nor any other pure-Rust crate lays filters out as a tree (libseccomp
//! does, but it is a C library the project does not otherwise need).

use std::collections::BTreeSet;

use seccompiler::{sock_filter, BpfProgram};

use crate::error::SeccompError;

/// Syscall numbers checked one by one (x86_64 and aarch64 use fewer than 500; x32 numbers are checked through
/// the constants).
pub const CHECKED_UP_TO: u32 = 4096;

/// Syscalls per leaf of the tree (a leaf compares one by one).
const LEAF: usize = 4;

// Classic BPF opcodes (linux/filter.h, linux/bpf_common.h).
const LD_W_ABS: u16 = 0x20;
pub(super) const JMP_JA: u16 = 0x05;
pub(super) const JMP_JEQ_K: u16 = 0x15;
pub(super) const JMP_JGT_K: u16 = 0x25;
pub(super) const JMP_JGE_K: u16 = 0x35;
pub(super) const JMP_JSET_K: u16 = 0x45;
pub(super) const RET_K: u16 = 0x06;
const ALU_AND_K: u16 = 0x54;
/// Offsets in `struct seccomp_data`.
const NR: u32 = 0;
const ARCH: u32 = 4;
const ARGS: u32 = 16;
/// The offset of the high half of `args[5]`.
const ARGS_END: u32 = ARGS + 8 * 5 + 4;

/// Why a relayout was not done (the original program is then kept as it is).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skip {
    /// The program is not a plain allowlist: it loads something else or compares otherwise.
    NotPlain(&'static str),
}

/// What a program does with one syscall: the return value, or `None` when the emulator cannot tell.
pub fn emulate(prog: &[sock_filter], arch: u32, nr: u32) -> Option<u32> {
    run(prog, arch, nr, &[0; 6]).map(|(ret, _)| ret)
}

#[cfg(test)]
/// What a program does with one syscall and its arguments (a program that loads them, like the denylist).
pub fn emulate_call(prog: &[sock_filter], arch: u32, nr: u32, args: &[u64; 6]) -> Option<u32> {
    run(prog, arch, nr, args).map(|(ret, _)| ret)
}

/// The return value and the number of instructions run.
fn run(prog: &[sock_filter], arch: u32, nr: u32, args: &[u64; 6]) -> Option<(u32, usize)> {
    let mut acc: u32 = 0;
    let mut pc: usize = 0;
    // Classic BPF only jumps forward, so a program ends within its length in steps.
    for step in 1..=prog.len() + 1 {
        let insn = prog.get(pc)?;
        let k = insn.k;
        pc += 1;
        match insn.code {
            LD_W_ABS => {
                acc = match k {
                    NR => nr,
                    ARCH => arch,
                    // `args[i]` at 16 + 8i, low half first (x86_64 and aarch64 are little-endian).
                    ARGS..=ARGS_END if k.is_multiple_of(4) => {
                        let i = ((k - ARGS) / 8) as usize;
                        let half = if (k - ARGS).is_multiple_of(8) { 0 } else { 32 };
                        (args[i] >> half) as u32
                    }
                    _ => return None,
                }
            }
            ALU_AND_K => acc &= k,
            JMP_JA => pc += k as usize,
            JMP_JEQ_K | JMP_JGT_K | JMP_JGE_K | JMP_JSET_K => {
                let taken = match insn.code {
                    JMP_JEQ_K => acc == k,
                    JMP_JGT_K => acc > k,
                    JMP_JGE_K => acc >= k,
                    _ => acc & k != 0,
                };
                pc += usize::from(if taken { insn.jt } else { insn.jf });
            }
            RET_K => return Some((k, step)),
            _ => return None,
        }
    }
    None
}

/// The tree version of `prog`, checked equal to it; `Ok(None)` when `prog` is not a plain allowlist (keep it as it
/// is); `Err` when the tree would differ (a bug here: fail closed).
pub fn relayout(prog: &[sock_filter]) -> Result<Option<BpfProgram>, SeccompError> {
    // The architecture seccompiler compiled for: the constant of its preamble's comparison.
    let arch = prog.get(1).map_or(0, |insn| insn.k);
    let shape = match shape(prog, arch) {
        Ok(s) => s,
        Err(Skip::NotPlain(_)) => return Ok(None),
    };
    let allowed: Vec<u32> = shape
        .constants
        .iter()
        .copied()
        .filter(|&nr| emulate(prog, arch, nr) == Some(shape.allow))
        .collect();
    let mut tree = prog[..PREAMBLE].to_vec();
    emit(&allowed, shape.allow, shape.mismatch, &mut tree);
    check_same(prog, &tree, arch, &shape.constants)?;
    Ok(Some(tree))
}

/// seccompiler's preamble: load the arch, compare, return on a foreign one, load the number.
const PREAMBLE: usize = 4;

struct Shape {
    /// Every constant the program compares the syscall number with.
    constants: BTreeSet<u32>,
    /// The return value of an allowed syscall.
    allow: u32,
    /// The return value of any other.
    mismatch: u32,
}

/// Checks that `prog` is seccompiler's allowlist shape: the arch preamble, then only equality tests of the syscall
/// number, jumps and returns, with exactly two outcomes for the native arch.
fn shape(prog: &[sock_filter], arch: u32) -> Result<Shape, Skip> {
    let pre = prog.get(..PREAMBLE).ok_or(Skip::NotPlain("too short"))?;
    let plain_preamble = pre[0].code == LD_W_ABS
        && pre[0].k == ARCH
        && pre[1].code == JMP_JEQ_K
        && pre[1].k == arch
        && pre[2].code == RET_K
        && pre[3].code == LD_W_ABS
        && pre[3].k == NR;
    if !plain_preamble {
        return Err(Skip::NotPlain("no arch preamble"));
    }
    let mut constants = BTreeSet::new();
    for insn in &prog[PREAMBLE..] {
        match insn.code {
            JMP_JEQ_K => {
                constants.insert(insn.k);
            }
            JMP_JA | RET_K => {}
            _ => return Err(Skip::NotPlain("not only equality tests")),
        }
    }
    let outcomes: BTreeSet<u32> = constants
        .iter()
        .map(|&nr| emulate(prog, arch, nr))
        .chain([emulate(prog, arch, u32::MAX)])
        .collect::<Option<_>>()
        .ok_or(Skip::NotPlain("cannot be emulated"))?;
    let mismatch = emulate(prog, arch, u32::MAX).ok_or(Skip::NotPlain("cannot be emulated"))?;
    let allow = match outcomes
        .iter()
        .copied()
        .filter(|&r| r != mismatch)
        .collect::<Vec<_>>()[..]
    {
        [allow] => allow,
        _ => return Err(Skip::NotPlain("not two outcomes")),
    };
    Ok(Shape {
        constants,
        allow,
        mismatch,
    })
}

/// Lays `allowed` (sorted) out as a search tree: an inner node sends numbers at or above its pivot to the right
/// subtree through a long jump and falls through to the left one; a leaf compares its few numbers one by one and
/// returns. No jump needs more than the 8 bits of `jt`/`jf` except the long ones (`JA`, 32 bits).
fn emit(allowed: &[u32], allow: u32, mismatch: u32, out: &mut Vec<sock_filter>) {
    let insn = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    if allowed.len() <= LEAF {
        for &nr in allowed {
            out.push(insn(JMP_JEQ_K, 0, 1, nr));
            out.push(insn(RET_K, 0, 0, allow));
        }
        out.push(insn(RET_K, 0, 0, mismatch));
        return;
    }
    let (left, right) = allowed.split_at(allowed.len() / 2);
    out.push(insn(JMP_JGE_K, 0, 1, right[0]));
    let jump = out.len();
    out.push(insn(JMP_JA, 0, 0, 0));
    emit(left, allow, mismatch, out);
    out[jump].k = (out.len() - jump - 1) as u32;
    emit(right, allow, mismatch, out);
}

/// Both programs give the same answer for every number up to [`CHECKED_UP_TO`], for every constant either compares
/// with and its neighbours, for `u32::MAX`, and for a foreign architecture.
fn check_same(
    prog: &[sock_filter],
    tree: &[sock_filter],
    arch: u32,
    constants: &BTreeSet<u32>,
) -> Result<(), SeccompError> {
    let around = constants
        .iter()
        .flat_map(|&k| [k.wrapping_sub(1), k, k.wrapping_add(1)]);
    let points = (0..=CHECKED_UP_TO).chain(around).chain([u32::MAX]);
    for nr in points {
        for a in [arch, !arch] {
            let (want, got) = (emulate(prog, a, nr), emulate(tree, a, nr));
            if want.is_none() || want != got {
                return Err(SeccompError::Relayout {
                    nr,
                    arch: a,
                    tree: got,
                    compiled: want,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const ARCH_X86_64: u32 = 0xc000_003e;

    fn linear(allowed: &[u32]) -> BpfProgram {
        // The shape seccompiler emits: arch preamble, then per syscall JEQ, JA allow, JA next, RET allow, RET errno.
        let insn = |code, jt, jf, k| sock_filter { code, jt, jf, k };
        let mut p = vec![
            insn(LD_W_ABS, 0, 0, ARCH),
            insn(JMP_JEQ_K, 1, 0, ARCH_X86_64),
            insn(RET_K, 0, 0, 0x8000_0000),
            insn(LD_W_ABS, 0, 0, NR),
        ];
        for &nr in allowed {
            p.push(insn(JMP_JEQ_K, 0, 1, nr));
            p.push(insn(JMP_JA, 0, 0, 1));
            p.push(insn(JMP_JA, 0, 0, 2));
            p.push(insn(RET_K, 0, 0, 0x7fff_0000));
            p.push(insn(RET_K, 0, 0, 0x0005_0026));
        }
        p.push(insn(RET_K, 0, 0, 0x0005_0026));
        p
    }

    #[test]
    fn a_tree_answers_like_the_chain_for_every_size() {
        // Nothing allowed: one outcome only, not an allowlist to rewrite.
        assert!(matches!(relayout(&linear(&[])), Ok(None)));
        for n in 1..40u32 {
            let allowed: Vec<u32> = (0..n).map(|i| i * 3 + (i % 2)).collect();
            let prog = linear(&allowed);
            let tree = relayout(&prog).unwrap().unwrap();
            for nr in 0..200 {
                assert_eq!(
                    emulate(&tree, ARCH_X86_64, nr),
                    emulate(&prog, ARCH_X86_64, nr),
                    "n {n} nr {nr}"
                );
            }
            assert_eq!(emulate(&tree, 0x4000_0003, 0), Some(0x8000_0000));
        }
    }

    #[test]
    fn the_real_allowlist_becomes_a_shorter_tree_with_short_paths() {
        let p =
            super::super::compile(super::super::X86_64, seccompiler::TargetArch::x86_64).unwrap();
        // `compile` installs the tree: its answers were checked against seccompiler's program there.
        let linear = seccompiler::compile_from_json(
            super::super::X86_64.as_bytes(),
            seccompiler::TargetArch::x86_64,
        )
        .unwrap()
        .remove("allowlist")
        .unwrap();
        let worst = |prog: &[sock_filter]| {
            (0..500)
                .map(|nr| run(prog, ARCH_X86_64, nr, &[0; 6]).unwrap().1)
                .max()
                .unwrap()
        };
        let (tree_worst, linear_worst) = (worst(&p.allow), worst(&linear));
        eprintln!(
            "allowlist: seccompiler {} instructions, worst path {linear_worst}; tree {} instructions, worst path {tree_worst}",
            linear.len(),
            p.allow.len()
        );
        assert!(tree_worst < 30, "worst path {tree_worst} instructions");
        assert!(linear_worst > 10 * tree_worst);
        assert!(p.allow.len() < 1000, "{} instructions", p.allow.len());
    }

    #[test]
    fn other_shapes_are_left_alone_and_a_wrong_tree_is_caught() {
        let mut prog = linear(&[1, 2, 3]);
        // An argument load: not a plain allowlist.
        prog.insert(
            5,
            sock_filter {
                code: LD_W_ABS,
                jt: 0,
                jf: 0,
                k: 16,
            },
        );
        assert!(matches!(relayout(&prog), Ok(None)));
        let prog = linear(&[1, 2, 3]);
        let mut wrong = prog.clone();
        wrong[4].k = 7;
        let constants = [1, 2, 3, 7].into_iter().collect();
        assert!(check_same(&prog, &wrong, ARCH_X86_64, &constants).is_err());
    }
}
