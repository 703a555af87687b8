//! The README's client example is `examples/quickstart.rs` (which `cargo test` builds), word for word.

#[test]
fn the_readme_example_is_the_quickstart_example() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("../README.md")).unwrap();
    let example = std::fs::read_to_string(root.join("examples/quickstart.rs")).unwrap();
    let section = readme
        .split("\n## sandboxctl and the client\n")
        .nth(1)
        .expect("README has a `## sandboxctl and the client` section");
    let section = section.split("\n## ").next().unwrap();
    let block = section
        .split("```rust\n")
        .nth(1)
        .and_then(|rest| rest.split("\n```").next())
        .expect("the section has a rust code block");
    assert_eq!(
        block.trim(),
        example.trim(),
        "README.md's rust block and client/examples/quickstart.rs differ"
    );
    let next = readme
        .split("\n## sandboxctl and the client\n")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").nth(1))
        .unwrap_or("");
    assert!(
        next.starts_with("Configuration reference"),
        "the section sits right before `## Configuration reference`"
    );
}
