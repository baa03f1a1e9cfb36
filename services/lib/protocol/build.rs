//! Compiles `proto/` with the pure-Rust `protox` compiler, so no system `protoc` is needed.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../proto");
    let files = [
        "ninfer/v1/engine.proto",
        "ninfer/v1/experts.proto",
        "ninfer/v1/gateway.proto",
    ];
    for file in files {
        println!("cargo:rerun-if-changed={}", proto_root.join(file).display());
    }
    let file_descriptors = protox::compile(files, [&proto_root])?;
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    // The descriptor set also feeds gRPC server reflection (grpcurl without proto files).
    std::fs::write(
        out_dir.join("ninfer_descriptor.bin"),
        prost::Message::encode_to_vec(&file_descriptors),
    )?;
    tonic_prost_build::configure().compile_fds(file_descriptors)?;
    Ok(())
}
