//! The client quick start in `docs/clients.md` is `examples/quickstart.rs` (which `cargo test` builds), word for
//! word, and the README points there.

#[test]
fn the_documented_example_is_the_quickstart_example() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let guide = std::fs::read_to_string(root.join("../docs/clients.md")).unwrap();
    let example = std::fs::read_to_string(root.join("examples/quickstart.rs")).unwrap();
    let section = guide
        .split("\n## sandboxctl and the client\n")
        .nth(1)
        .expect("docs/clients.md has a `## sandboxctl and the client` section");
    let block = section
        .split("```rust\n")
        .nth(1)
        .and_then(|rest| rest.split("\n```").next())
        .expect("the section has a rust code block");
    assert_eq!(
        block.trim(),
        example.trim(),
        "docs/clients.md's rust block and client/examples/quickstart.rs differ"
    );
    let readme = std::fs::read_to_string(root.join("../README.md")).unwrap();
    let next = readme
        .split("\n## sandboxctl and the client\n")
        .nth(1)
        .expect("README has a `## sandboxctl and the client` section");
    assert!(
        next.split("\n## ")
            .next()
            .unwrap()
            .contains("(docs/clients.md)"),
        "the README's client section points at docs/clients.md"
    );
}
