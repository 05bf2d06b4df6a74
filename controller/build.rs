//! Compiles the Kubernetes device-plugin API (`proto/deviceplugin_v1beta1.proto`) into
//! its messages, the `DevicePlugin` client and server, and the `Registration` client and
//! server, with protox: a protobuf compiler in Rust, so no system `protoc` is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/deviceplugin_v1beta1.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
