//! The host's processes as `/proc` shows them, for the harnesses' checks that nothing of an execution or a
//! daemon is left behind.

/// One host process, as `/proc` shows it.
#[derive(Debug, Clone)]
pub struct ProcInfo {
    /// Process id (host pid namespace).
    pub pid: i32,
    /// Parent process id.
    pub ppid: i32,
    /// Real uid.
    pub uid: u32,
    /// `State:` letter, e.g. `S`, `Z`.
    pub state: char,
    /// Command line, arguments joined by spaces (empty for zombies and kernel threads).
    pub cmdline: String,
}

impl ProcInfo {
    /// Not a zombie.
    pub fn is_alive(&self) -> bool {
        self.state != 'Z'
    }
}

/// Reads one process; `None` if it is gone.
pub fn proc_info(pid: i32) -> Option<ProcInfo> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(str::trim)
            .unwrap_or("")
            .to_owned()
    };
    let uid = field("Uid:").split_whitespace().next()?.parse().ok()?;
    let ppid = field("PPid:").parse().ok()?;
    let state = field("State:").chars().next().unwrap_or('?');
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            String::from_utf8_lossy(&b)
                .split('\0')
                .filter(|s| !s.is_empty())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default();
    Some(ProcInfo {
        pid,
        ppid,
        uid,
        state,
        cmdline,
    })
}

/// Whether `pid` exists and is not a zombie.
pub fn is_alive(pid: i32) -> bool {
    proc_info(pid).is_some_and(|p| p.is_alive())
}

/// Every process on the host.
pub fn processes() -> Vec<ProcInfo> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for e in entries.flatten() {
            if let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) {
                if let Some(p) = proc_info(pid) {
                    out.push(p);
                }
            }
        }
    }
    out
}

/// Live (non-zombie) processes whose command line contains `needle`.
pub fn processes_with_arg(needle: &str) -> Vec<ProcInfo> {
    processes()
        .into_iter()
        .filter(|p| p.is_alive() && p.cmdline.contains(needle))
        .collect()
}

/// Processes (zombies included) whose real uid is in `uids`.
pub fn processes_with_uid(uids: std::ops::Range<u32>) -> Vec<ProcInfo> {
    processes()
        .into_iter()
        .filter(|p| uids.contains(&p.uid))
        .collect()
}

/// Direct children of `pid` (a ppid scan, zombies included).
pub fn children_of(pid: i32) -> Vec<ProcInfo> {
    processes().into_iter().filter(|p| p.ppid == pid).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_and_its_child() {
        let me = proc_info(std::process::id() as i32).expect("this process");
        assert!(me.is_alive());
        assert_eq!(me.uid, nix::unistd::getuid().as_raw());
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        let pid = child.id() as i32;
        // Between fork and exec the child has no command line yet.
        let start = std::time::Instant::now();
        let (found, kids) = loop {
            let kids = children_of(me.pid);
            let found = kids
                .iter()
                .find(|p| p.pid == pid)
                .map(|p| p.cmdline.clone());
            if found.as_deref() != Some("") || start.elapsed().as_secs() > 5 {
                break (found, kids);
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        child.kill().expect("kill sleep");
        child.wait().expect("reap sleep");
        assert_eq!(found.as_deref(), Some("sleep 30"), "{kids:?}");
        assert!(!is_alive(pid));
    }
}
