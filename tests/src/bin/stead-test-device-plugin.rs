//! A device plugin for the `k8s` plugin kind's tests, speaking the Kubernetes
//! device-plugin API (v1beta1) over a real unix socket:
//!
//! `stead-test-device-plugin SOCKET_DIR ENDPOINT RESOURCE IDS STATE_DIR [register] [prestart]`
//!
//! serves `DevicePlugin` at `SOCKET_DIR/ENDPOINT` with the devices `IDS` (comma-separated),
//! and with `register` registers on `SOCKET_DIR/kubelet.sock` first. A test drives it
//! through `STATE_DIR`: `ENDPOINT.health` lists unhealthy ids, one per line (read every
//! 50 ms; every change is a new full list on `ListAndWatch`); each `Allocate` appends its
//! ids to `ENDPOINT.allocs`. An answer gives `FAKE_DEVICE_IDS` and `NVIDIA_VISIBLE_DEVICES`
//! set to the ids, and mounts `STATE_DIR/ENDPOINT.mnt` read-only where it is. With
//! `prestart` its options ask for `PreStartContainer`, whose every call appends its ids
//! to `ENDPOINT.prestarts`.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::Duration;

use stead_controller::deviceplugin::api;
use stead_controller::deviceplugin::api::device_plugin_server::{DevicePlugin, DevicePluginServer};
use stead_controller::deviceplugin::api::registration_client::RegistrationClient;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

struct Fake {
    ids: Vec<String>,
    prestart: Option<PathBuf>,
    health: PathBuf,
    allocs: PathBuf,
    mount: PathBuf,
}

/// Each id with its health now.
fn devices(ids: &[String], health: &Path) -> Vec<api::Device> {
    let unhealthy = std::fs::read_to_string(health).unwrap_or_default();
    ids.iter()
        .map(|id| api::Device {
            id: id.clone(),
            health: if unhealthy.lines().any(|line| line.trim() == id) {
                "Unhealthy".to_owned()
            } else {
                "Healthy".to_owned()
            },
            topology: None,
        })
        .collect()
}

/// Appends `line` to the file `log`.
fn append(log: &Path, line: &str) -> Result<(), Status> {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| Status::internal(e.to_string()))?;
    writeln!(file, "{line}").map_err(|e| Status::internal(e.to_string()))
}

type Stream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<api::ListAndWatchResponse, Status>> + Send>>;

#[tonic::async_trait]
impl DevicePlugin for Fake {
    type ListAndWatchStream = Stream;

    async fn get_device_plugin_options(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<api::DevicePluginOptions>, Status> {
        Ok(Response::new(api::DevicePluginOptions {
            pre_start_required: self.prestart.is_some(),
            ..Default::default()
        }))
    }

    async fn list_and_watch(
        &self,
        _: Request<api::Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        let (tx, rx) = mpsc::channel(4);
        let ids = self.ids.clone();
        let health = self.health.clone();
        tokio::spawn(async move {
            let mut last = None;
            loop {
                let now = devices(&ids, &health);
                if last.as_ref() != Some(&now) {
                    let list = api::ListAndWatchResponse {
                        devices: now.clone(),
                    };
                    if tx.send(Ok(list)).await.is_err() {
                        return;
                    }
                    last = Some(now);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<api::PreferredAllocationRequest>,
    ) -> Result<Response<api::PreferredAllocationResponse>, Status> {
        Err(Status::unimplemented("not offered"))
    }

    async fn allocate(
        &self,
        request: Request<api::AllocateRequest>,
    ) -> Result<Response<api::AllocateResponse>, Status> {
        let mut responses = Vec::new();
        for container in request.into_inner().container_requests {
            let ids = container.devices_ids.join(",");
            append(&self.allocs, &ids)?;
            let mount = self.mount.display().to_string();
            responses.push(api::ContainerAllocateResponse {
                envs: [
                    ("FAKE_DEVICE_IDS".to_owned(), ids.clone()),
                    ("NVIDIA_VISIBLE_DEVICES".to_owned(), ids),
                ]
                .into_iter()
                .collect(),
                mounts: vec![api::Mount {
                    container_path: mount.clone(),
                    host_path: mount,
                    read_only: true,
                }],
                ..Default::default()
            });
        }
        Ok(Response::new(api::AllocateResponse {
            container_responses: responses,
        }))
    }

    async fn pre_start_container(
        &self,
        request: Request<api::PreStartContainerRequest>,
    ) -> Result<Response<api::PreStartContainerResponse>, Status> {
        if let Some(log) = &self.prestart {
            append(log, &request.into_inner().devices_ids.join(","))?;
        }
        Ok(Response::new(api::PreStartContainerResponse {}))
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let usage =
        "usage: stead-test-device-plugin SOCKET_DIR ENDPOINT RESOURCE IDS STATE_DIR [register]";
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [socket_dir, endpoint, resource, ids, state] = &args[..5] else {
        panic!("{usage}");
    };
    let flags = &args[5..];
    let register = flags.iter().any(|a| a == "register");
    let prestart = flags.iter().any(|a| a == "prestart");
    let socket_dir = PathBuf::from(socket_dir);
    let state = PathBuf::from(state);
    let mount = state.join(format!("{endpoint}.mnt"));
    std::fs::create_dir_all(&mount).expect("the mount dir");
    let fake = Fake {
        ids: ids.split(',').map(str::to_owned).collect(),
        prestart: prestart.then(|| state.join(format!("{endpoint}.prestarts"))),
        health: state.join(format!("{endpoint}.health")),
        allocs: state.join(format!("{endpoint}.allocs")),
        mount,
    };
    let socket = socket_dir.join(endpoint);
    let _ = std::fs::remove_file(&socket);
    let listener = tokio::net::UnixListener::bind(&socket).expect("the plugin's socket");
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DevicePluginServer::new(fake))
            .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener)),
    );
    if register {
        let channel = stead_controller::deviceplugin::connect(&socket_dir.join("kubelet.sock"))
            .await
            .expect("the kubelet socket answers");
        RegistrationClient::new(channel)
            .register(api::RegisterRequest {
                version: "v1beta1".to_owned(),
                endpoint: endpoint.clone(),
                resource_name: resource.clone(),
                options: Some(api::DevicePluginOptions::default()),
            })
            .await
            .expect("registered");
    }
    // Tells the test it serves (and has registered).
    std::fs::write(state.join(format!("{endpoint}.ready")), "").expect("the ready file");
    let _ = server.await;
}
