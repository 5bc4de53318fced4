//! Checks that the committed gRPC code of the example, `examples/grpc/helloworld.rs`, is what
//! `proto/helloworld.proto` generates today — without protoc (protox parses the proto in Rust)
//! and without a build script (which would burden every user of the library).
//!
//! After changing the proto, or upgrading tonic / prost, refresh the committed file with:
//!
//! ```text
//! UPDATE_GENERATED=1 cargo test --test layers -- grpc_codegen::
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::path::Path;

/// The proto file, relative to the crate root.
const PROTO: &str = "proto/helloworld.proto";
/// Where the generated code is committed, relative to the crate root.
const COMMITTED: &str = "examples/grpc/helloworld.rs";
/// The variable that makes this test overwrite the committed file.
const UPDATE: &str = "UPDATE_GENERATED";

/// Generates the Rust code for `proto/helloworld.proto` into a temporary directory.
fn generate() -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let fds = protox::compile([root.join(PROTO)], [root.join("proto")])
        .unwrap_or_else(|e| panic!("{PROTO} does not compile: {e}"));
    let out = tempfile::tempdir().expect("temp dir");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .emit_rerun_if_changed(false)
        .out_dir(out.path())
        .compile_fds(fds)
        .expect("tonic-prost-build generates the code");
    // prost names the file after the proto package
    fs::read_to_string(out.path().join("helloworld.rs")).expect("generated helloworld.rs")
}

#[test]
fn committed_grpc_code_matches_the_proto() {
    let generated = generate();
    let committed_path = Path::new(env!("CARGO_MANIFEST_DIR")).join(COMMITTED);
    if std::env::var_os(UPDATE).is_some_and(|v| !v.is_empty() && v != "0") {
        fs::write(&committed_path, &generated)
            .unwrap_or_else(|e| panic!("cannot write {COMMITTED}: {e}"));
        eprintln!("{UPDATE} is set: wrote {COMMITTED} from {PROTO}");
        return;
    }
    let committed = fs::read_to_string(&committed_path).unwrap_or_default();
    if committed != generated {
        let first_difference = committed
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .map_or_else(
                || "one file is a prefix of the other".to_owned(),
                |i| format!("first difference on line {}", i + 1),
            );
        panic!(
            "{COMMITTED} is out of date with {PROTO} ({first_difference}; committed {} bytes, \
             generated {} bytes).\nRefresh it with:\n\n    {UPDATE}=1 cargo test --test layers -- \
             grpc_codegen::\n\n\
             and commit the result.",
            committed.len(),
            generated.len(),
        );
    }
}
