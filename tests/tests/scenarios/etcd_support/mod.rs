//! A real etcd cluster for the fleet tests: three members on loopback (ephemeral ports,
//! temporary data dirs, short election timeouts), stopped by pid; a client to put, read
//! and compact keys; and a proxy in front of each member that a test can cut to take one
//! agent off etcd while the cluster goes on.

#![allow(dead_code, unreachable_pub)]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use etcd_client::{Client, GetOptions};

use crate::agent_support::{free_port, wait_for};

/// One etcd member process.
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    child: Option<Child>,
}

/// A running cluster.
pub struct EtcdCluster {
    dir: tempfile::TempDir,
    members: Vec<Member>,
    runtime: tokio::runtime::Runtime,
    client: Client,
}

impl EtcdCluster {
    /// Starts `size` members and waits until the cluster serves.
    pub fn start(size: usize) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let members: Vec<Member> = (0..size)
            .map(|i| Member {
                name: format!("m{i}"),
                client_port: free_port(),
                peer_port: free_port(),
                child: None,
            })
            .collect();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let urls: Vec<String> = members
            .iter()
            .map(|m| format!("http://127.0.0.1:{}", m.client_port))
            .collect();
        let client = runtime
            .block_on(Client::connect(&urls, None))
            .expect("client");
        let mut cluster = EtcdCluster {
            dir,
            members,
            runtime,
            client,
        };
        for index in 0..size {
            cluster.spawn(index, "new");
        }
        cluster.wait_serving();
        cluster
    }

    fn spawn(&mut self, index: usize, state: &str) {
        let initial: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect();
        let member = &self.members[index];
        let data = self.dir.path().join(&member.name);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("{}.log", member.name)))
            .expect("log");
        let client_url = format!("http://127.0.0.1:{}", member.client_port);
        let peer_url = format!("http://127.0.0.1:{}", member.peer_port);
        let child = Command::new("etcd")
            .args(["--name", &member.name])
            .arg("--data-dir")
            .arg(&data)
            .args(["--listen-client-urls", &client_url])
            .args(["--advertise-client-urls", &client_url])
            .args(["--listen-peer-urls", &peer_url])
            .args(["--initial-advertise-peer-urls", &peer_url])
            .args(["--initial-cluster", &initial.join(",")])
            .args(["--initial-cluster-state", state])
            .args(["--initial-cluster-token", "stead-test"])
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
            .args(["--logger", "zap", "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("etcd runs (Debian's etcd-server, installed by scripts/install-deps.sh)");
        self.members[index].child = Some(child);
    }

    /// Waits until a write goes through.
    pub fn wait_serving(&self) {
        wait_for("etcd serves", Duration::from_secs(30), || {
            self.try_put("/stead-test/ping", "1")
        });
    }

    /// The members' client URLs.
    pub fn urls(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("http://127.0.0.1:{}", m.client_port))
            .collect()
    }

    /// The client URLs as one comma-separated list, for `--etcd`.
    pub fn urls_flag(&self) -> String {
        self.urls().join(",")
    }

    /// The members' client ports.
    pub fn ports(&self) -> Vec<u16> {
        self.members.iter().map(|m| m.client_port).collect()
    }

    fn try_put(&self, key: &str, value: &str) -> Result<i64, String> {
        let mut kv = self.client.kv_client();
        let put = self.runtime.block_on(async {
            tokio::time::timeout(Duration::from_secs(3), kv.put(key, value, None)).await
        });
        match put {
            Ok(Ok(response)) => Ok(response.header().map_or(0, |h| h.revision())),
            Ok(Err(error)) => Err(error.to_string()),
            Err(_) => Err("timed out".to_owned()),
        }
    }

    /// Puts `value` at `key` (retrying while the cluster elects a leader); the revision.
    pub fn put(&self, key: &str, value: &str) -> i64 {
        wait_for(&format!("a put of {key}"), Duration::from_secs(15), || {
            self.try_put(key, value)
        })
    }

    /// Deletes `key`.
    pub fn delete(&self, key: &str) {
        let mut kv = self.client.kv_client();
        self.runtime
            .block_on(kv.delete(key, None))
            .expect("deleted");
    }

    /// Every key below `prefix` with its value.
    pub fn get_prefix(&self, prefix: &str) -> Vec<(String, String)> {
        wait_for(
            &format!("a read of {prefix}"),
            Duration::from_secs(15),
            || {
                let mut kv = self.client.kv_client();
                let got = self.runtime.block_on(async {
                    tokio::time::timeout(
                        Duration::from_secs(3),
                        kv.get(prefix, Some(GetOptions::new().with_prefix())),
                    )
                    .await
                });
                match got {
                    Ok(Ok(response)) => Ok(response
                        .kvs()
                        .iter()
                        .map(|kv| {
                            (
                                kv.key_str().expect("utf-8").to_owned(),
                                kv.value_str().expect("utf-8").to_owned(),
                            )
                        })
                        .collect()),
                    Ok(Err(error)) => Err(error.to_string()),
                    Err(_) => Err("timed out".to_owned()),
                }
            },
        )
    }

    /// The cluster's current revision.
    pub fn revision(&self) -> i64 {
        wait_for("the revision", Duration::from_secs(15), || {
            let mut kv = self.client.kv_client();
            match self.runtime.block_on(kv.get("/stead-test/ping", None)) {
                Ok(response) => Ok(response.header().map_or(0, |h| h.revision())),
                Err(error) => Err(error.to_string()),
            }
        })
    }

    /// Compacts the history up to `revision`.
    pub fn compact(&self, revision: i64) {
        let mut kv = self.client.kv_client();
        self.runtime
            .block_on(kv.compact(revision, None))
            .expect("compacted");
    }

    /// The index of the member that leads now.
    pub fn leader(&self) -> usize {
        wait_for("a leader", Duration::from_secs(15), || {
            let mut maintenance = self.client.maintenance_client();
            let mut cluster = self.client.cluster_client();
            let status = self
                .runtime
                .block_on(maintenance.status())
                .map_err(|e| e.to_string())?;
            let members = self
                .runtime
                .block_on(cluster.member_list())
                .map_err(|e| e.to_string())?;
            let leader = status.leader();
            let name = members
                .members()
                .iter()
                .find(|m| m.id() == leader)
                .map(|m| m.name().to_owned())
                .ok_or("no leader yet")?;
            self.members
                .iter()
                .position(|m| m.name == name)
                .ok_or_else(|| format!("leader {name} is not a member"))
        })
    }

    /// SIGKILLs member `index`.
    pub fn kill(&mut self, index: usize) {
        if let Some(mut child) = self.members[index].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts member `index` again over its data dir.
    pub fn restart(&mut self, index: usize) {
        self.spawn(index, "existing");
    }

    /// Sends `signal` to every member.
    pub fn signal_all(&self, signal: rustix::process::Signal) {
        for member in &self.members {
            if let Some(child) = &member.child {
                let pid = rustix::process::Pid::from_raw(child.id() as i32).expect("pid");
                let _ = rustix::process::kill_process(pid, signal);
            }
        }
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        self.signal_all(rustix::process::Signal::CONT);
        for index in 0..self.members.len() {
            self.kill(index);
        }
    }
}

/// A TCP proxy to one port that a test can cut (every connection closed, new ones
/// refused) and mend.
pub struct Proxy {
    pub port: u16,
    cut: Arc<AtomicBool>,
    open: Arc<Mutex<Vec<TcpStream>>>,
}

impl Proxy {
    /// A proxy on a free loopback port to `upstream`.
    pub fn to(upstream: u16) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let cut = Arc::new(AtomicBool::new(false));
        let open: Arc<Mutex<Vec<TcpStream>>> = Arc::new(Mutex::new(Vec::new()));
        let (cut_flag, conns) = (cut.clone(), open.clone());
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                if cut_flag.load(Ordering::SeqCst) {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                let mut list = conns.lock().expect("lock");
                for stream in [&client, &server] {
                    if let Ok(clone) = stream.try_clone() {
                        list.push(clone);
                    }
                }
                drop(list);
                pipe(&client, &server);
                pipe(&server, &client);
            }
        });
        Proxy { port, cut, open }
    }

    /// Closes every connection and refuses new ones.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for stream in self.open.lock().expect("lock").drain(..) {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    /// Lets connections through again.
    pub fn mend(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

/// Copies `from` to `to` on a thread of its own until either end closes.
fn pipe(from: &TcpStream, to: &TcpStream) {
    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else {
        return;
    };
    std::thread::spawn(move || {
        let mut buffer = [0u8; 16 * 1024];
        loop {
            match from.read(&mut buffer) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if to.write_all(&buffer[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = to.shutdown(Shutdown::Both);
        let _ = from.shutdown(Shutdown::Both);
    });
}
