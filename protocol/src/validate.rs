//! Checks on the strings of an `execute` that must not let a request escape its working directory or corrupt
//! the program's environment.

/// The longest file path or artifact glob, in bytes (Linux `PATH_MAX`).
pub const MAX_PATH_LEN: usize = 4096;

/// Why a relative path (a file of `files` or a glob of `artifacts.paths`) is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// The path is empty.
    #[error("Path is empty")]
    Empty,
    /// The path is longer than [`MAX_PATH_LEN`] bytes.
    #[error("Path is longer than {MAX_PATH_LEN} bytes")]
    TooLong,
    /// The path contains a NUL byte.
    #[error("Path contains a NUL byte")]
    Nul,
    /// The path starts with `/`.
    #[error("Path is absolute; it must be relative to the working directory")]
    Absolute,
    /// A component is `..`.
    #[error("Path contains a `..` component and could escape the working directory")]
    ParentDir,
    /// A component is `.`.
    #[error("Path contains a `.` component")]
    CurDir,
    /// Two `/` in a row, or a trailing `/`.
    #[error("Path contains an empty component (`//` or a trailing `/`)")]
    EmptyComponent,
}

/// Whether relative path `a` is `b` or lies under it, or `b` under `a` (component-wise; the empty path is the
/// root, under which everything lies): two mounts there would hide one another.
pub fn paths_overlap(a: &str, b: &str) -> bool {
    let under = |x: &str, y: &str| y.is_empty() || x == y || x.starts_with(&format!("{y}/"));
    under(a, b) || under(b, a)
}

/// Checks that `path` is a normalized path relative to the working directory: non-empty, at most
/// [`MAX_PATH_LEN`] bytes, no NUL, not absolute, and no `..`, `.` or empty component.
pub fn validate_relative_path(path: &str) -> Result<(), PathError> {
    if path.is_empty() {
        return Err(PathError::Empty);
    }
    if path.len() > MAX_PATH_LEN {
        return Err(PathError::TooLong);
    }
    if path.contains('\0') {
        return Err(PathError::Nul);
    }
    if path.starts_with('/') {
        return Err(PathError::Absolute);
    }
    for component in path.split('/') {
        match component {
            ".." => return Err(PathError::ParentDir),
            "." => return Err(PathError::CurDir),
            "" => return Err(PathError::EmptyComponent),
            _ => {}
        }
    }
    Ok(())
}

/// Why an environment variable of `execute.env` is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    /// The name is empty.
    #[error("Variable name is empty")]
    EmptyKey,
    /// The name contains `=`.
    #[error("Variable name contains '='")]
    KeyHasEquals,
    /// The name contains a NUL byte.
    #[error("Variable name contains a NUL byte")]
    KeyHasNul,
    /// The value contains a NUL byte.
    #[error("Variable value contains a NUL byte")]
    ValueHasNul,
}

/// Checks that `key=value` can be passed to `execve`: a non-empty name without `=` or NUL, a value without NUL.
pub fn validate_env_var(key: &str, value: &str) -> Result<(), EnvError> {
    if key.is_empty() {
        Err(EnvError::EmptyKey)
    } else if key.contains('=') {
        Err(EnvError::KeyHasEquals)
    } else if key.contains('\0') {
        Err(EnvError::KeyHasNul)
    } else if value.contains('\0') {
        Err(EnvError::ValueHasNul)
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths() {
        for ok in [
            "a",
            "data/in.csv",
            "a/b/c",
            ".hidden",
            "a..b",
            "...",
            "out/**",
            "*.txt",
            "a\\b",
        ] {
            assert_eq!(validate_relative_path(ok), Ok(()), "{ok:?}");
        }
        let cases = [
            ("", PathError::Empty),
            ("/etc/passwd", PathError::Absolute),
            ("/", PathError::Absolute),
            ("..", PathError::ParentDir),
            ("../x", PathError::ParentDir),
            ("a/../../b", PathError::ParentDir),
            ("a/..", PathError::ParentDir),
            (".", PathError::CurDir),
            ("./a", PathError::CurDir),
            ("a/./b", PathError::CurDir),
            ("a//b", PathError::EmptyComponent),
            ("a/", PathError::EmptyComponent),
            ("a\0b", PathError::Nul),
        ];
        for (path, want) in cases {
            assert_eq!(validate_relative_path(path), Err(want), "{path:?}");
        }
        assert_eq!(validate_relative_path(&"a".repeat(MAX_PATH_LEN)), Ok(()));
        assert_eq!(
            validate_relative_path(&"a".repeat(MAX_PATH_LEN + 1)),
            Err(PathError::TooLong)
        );
    }

    #[test]
    fn env_vars() {
        assert_eq!(validate_env_var("K", "V"), Ok(()));
        assert_eq!(validate_env_var("K", ""), Ok(()));
        assert_eq!(validate_env_var("K", "a=b"), Ok(()));
        assert_eq!(validate_env_var("", "V"), Err(EnvError::EmptyKey));
        assert_eq!(validate_env_var("A=B", "V"), Err(EnvError::KeyHasEquals));
        assert_eq!(validate_env_var("A\0", "V"), Err(EnvError::KeyHasNul));
        assert_eq!(validate_env_var("A", "V\0"), Err(EnvError::ValueHasNul));
    }
}
