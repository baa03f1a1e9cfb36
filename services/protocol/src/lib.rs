//! gRPC messages and service stubs generated from `proto/` at build time.
//!
//! Owns: the wire types shared by the gateway, the engine and the expert workers.
//! Must not touch: any behaviour. This crate is generated code plus the descriptor set used for
//! server reflection; every other crate may depend on it, it depends on no crate of ours.

/// Version 1 of the NInfer control-plane API.
pub mod v1 {
    tonic::include_proto!("ninfer.v1");
}

/// Encoded `FileDescriptorSet` of every proto file, for `tonic-reflection`.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("ninfer_descriptor");
