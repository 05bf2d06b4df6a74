//! The CLI's side of the HTTP API: where the agent is, how to ask it, and what its errors
//! mean for a person at a terminal.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, anyhow, bail};
use reqwest::{Method, RequestBuilder, Response, StatusCode};
use serde::Serialize;
use serde::de::DeserializeOwned;
use stead_schemas::api::ErrorBody;

/// The agent's address when neither `--address` nor `STEAD_ADDR` says otherwise.
pub(crate) const DEFAULT_ADDRESS: &str = "127.0.0.1:4750";

/// How long connecting may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a request may take (restart and signal wait for the alloc's worker, up to
/// the agent's own 30 s command timeout).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(40);

/// Where the agent listens, as the user wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Endpoint {
    /// `host:port` or `http://host:port`: the base URL.
    Tcp(String),
    /// `unix:/path`, or a path: the socket.
    Unix(PathBuf),
}

impl Endpoint {
    fn parse(address: &str) -> anyhow::Result<Endpoint> {
        if let Some(path) = address.strip_prefix("unix:") {
            let path = path.strip_prefix("//").unwrap_or(path);
            if path.is_empty() {
                bail!("address {address:?} names no socket path");
            }
            return Ok(Endpoint::Unix(PathBuf::from(path)));
        }
        if address.starts_with('/') || address.starts_with("./") || address.starts_with("../") {
            return Ok(Endpoint::Unix(PathBuf::from(address)));
        }
        if address.starts_with("https://") {
            bail!(
                "address {address:?}: the agent's api speaks plain http only (use a unix socket or a tunnel)"
            );
        }
        let base = match address.strip_prefix("http://") {
            Some(rest) => format!("http://{}", rest.trim_end_matches('/')),
            None => format!("http://{}", address.trim_end_matches('/')),
        };
        Ok(Endpoint::Tcp(base))
    }

    /// Whether the agent is on this host: a unix socket, `localhost` or a loopback IP.
    fn is_local(&self) -> bool {
        let base = match self {
            Endpoint::Unix(_) => return true,
            Endpoint::Tcp(base) => base.trim_start_matches("http://"),
        };
        let host = base.split('/').next().unwrap_or(base);
        let host = match host.rsplit_once(':') {
            Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
            _ => host,
        };
        let host = host.trim_start_matches('[').trim_end_matches(']');
        host.eq_ignore_ascii_case("localhost")
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    }
}

/// Whether `address` names an agent on this host (a unix socket or loopback), to
/// which a token found in this host's files may be sent.
pub(crate) fn is_local_address(address: &str) -> anyhow::Result<bool> {
    Endpoint::parse(address).map(|endpoint| endpoint.is_local())
}

/// A connection to one agent.
pub(crate) struct Client {
    http: reqwest::Client,
    base: String,
    /// The address as the user gave it, for error messages.
    address: String,
    token: Option<String>,
    /// Added to a 401's message: where the token came from, or how to pass one.
    unauthorized_hint: String,
}

/// An error response of the agent.
#[derive(Debug, thiserror::Error)]
#[error("{}{hint}", body.message)]
pub(crate) struct ApiFailure {
    /// The response status.
    pub(crate) status: StatusCode,
    /// The agent's error document.
    pub(crate) body: ErrorBody,
    /// What the CLI adds to the agent's message (on a 401, about the token).
    pub(crate) hint: String,
}

impl Client {
    /// A client of the agent at `address` (see [`DEFAULT_ADDRESS`]) that sends `token`
    /// and adds `unauthorized_hint` to the message of a 401.
    pub(crate) fn new(
        address: &str,
        token: Option<String>,
        unauthorized_hint: String,
    ) -> anyhow::Result<Client> {
        let endpoint = Endpoint::parse(address)?;
        // The agent is on this host (loopback or a unix socket) or addressed directly:
        // never through a proxy from the environment, which would see the token.
        let builder = reqwest::Client::builder()
            .no_proxy()
            .connect_timeout(CONNECT_TIMEOUT)
            .user_agent(concat!("stead/", env!("CARGO_PKG_VERSION")));
        let (builder, base) = match endpoint {
            Endpoint::Tcp(base) => (builder, base),
            Endpoint::Unix(path) => (builder.unix_socket(path), "http://localhost".to_owned()),
        };
        let http = builder.build().context("cannot set up the http client")?;
        Ok(Client {
            http,
            base,
            address: address.to_owned(),
            token: token.filter(|t| !t.is_empty()),
            unauthorized_hint,
        })
    }

    fn request(&self, method: Method, path: &str) -> RequestBuilder {
        let request = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        }
    }

    /// Sends `request`; an error response becomes an [`ApiFailure`].
    async fn send(&self, request: RequestBuilder) -> anyhow::Result<Response> {
        let response = request.send().await.map_err(|error| {
            let reached = !(error.is_connect() || error.is_timeout());
            let error = anyhow!(error.without_url());
            if reached {
                error.context(format!(
                    "request to the stead agent at {} failed",
                    self.address
                ))
            } else {
                error.context(format!("cannot reach the stead agent at {}", self.address))
            }
        })?;
        let status = response.status();
        if status.is_success() || status == StatusCode::SWITCHING_PROTOCOLS {
            return Ok(response);
        }
        let bytes = response.bytes().await.unwrap_or_default();
        match serde_json::from_slice::<ErrorBody>(&bytes) {
            Ok(body) => {
                let hint = if status == StatusCode::UNAUTHORIZED {
                    self.unauthorized_hint.clone()
                } else {
                    String::new()
                };
                Err(ApiFailure { status, body, hint }.into())
            }
            Err(_) => bail!(
                "the stead agent at {} answered {status}: {}",
                self.address,
                String::from_utf8_lossy(&bytes).trim()
            ),
        }
    }

    /// `GET path`, decoded from JSON.
    pub(crate) async fn get<T: DeserializeOwned>(&self, path: &str) -> anyhow::Result<T> {
        self.json(Method::GET, path).await
    }

    /// `method path` without a body, its answer decoded from JSON.
    async fn json<T: DeserializeOwned>(&self, method: Method, path: &str) -> anyhow::Result<T> {
        let response = self
            .send(self.request(method, path).timeout(REQUEST_TIMEOUT))
            .await?;
        let bytes = response.bytes().await.with_context(|| {
            format!("reading the answer of the stead agent at {}", self.address)
        })?;
        serde_json::from_slice(&bytes).with_context(|| {
            format!(
                "the stead agent at {} sent an unexpected document",
                self.address
            )
        })
    }

    /// `POST path` with a JSON body.
    pub(crate) async fn post(&self, path: &str, body: &impl Serialize) -> anyhow::Result<()> {
        let body = serde_json::to_vec(body)?;
        self.send(
            self.request(Method::POST, path)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(body)
                .timeout(REQUEST_TIMEOUT),
        )
        .await?;
        Ok(())
    }

    /// `POST path` with no body, reading the JSON answer.
    pub(crate) async fn post_for<T: DeserializeOwned>(&self, path: &str) -> anyhow::Result<T> {
        self.json(Method::POST, path).await
    }

    /// `POST path` with a JSON body, asking to switch the connection to `protocol`
    /// (`Connection: Upgrade`): the switched connection, without a time limit.
    pub(crate) async fn upgrade(
        &self,
        path: &str,
        protocol: &'static str,
        body: &impl Serialize,
    ) -> anyhow::Result<reqwest::Upgraded> {
        let body = serde_json::to_vec(body)?;
        let response = self
            .send(
                self.request(Method::POST, path)
                    .header(reqwest::header::CONTENT_TYPE, "application/json")
                    .header(reqwest::header::CONNECTION, "upgrade")
                    .header(reqwest::header::UPGRADE, protocol)
                    .body(body),
            )
            .await?;
        if response.status() != StatusCode::SWITCHING_PROTOCOLS {
            bail!(
                "the stead agent at {} answered {} instead of switching to {protocol}",
                self.address,
                response.status()
            );
        }
        response.upgrade().await.with_context(|| {
            format!(
                "the connection to the stead agent at {} did not switch to {protocol}",
                self.address
            )
        })
    }

    /// `GET path` as a stream of bytes, without a time limit (for following logs).
    pub(crate) async fn stream(&self, path: &str) -> anyhow::Result<Response> {
        self.send(self.request(Method::GET, path)).await
    }

    /// The address as the user gave it.
    pub(crate) fn address(&self) -> &str {
        &self.address
    }
}

/// Percent-encodes one path segment or query value.
pub(crate) fn encode(text: &str) -> String {
    let mut encoded = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
            encoded.push(char::from(byte));
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_name_tcp_hosts_or_unix_sockets() {
        let cases = [
            (
                "127.0.0.1:4750",
                Endpoint::Tcp("http://127.0.0.1:4750".to_owned()),
            ),
            (
                "http://node-1:4750/",
                Endpoint::Tcp("http://node-1:4750".to_owned()),
            ),
            (
                "unix:/run/stead.sock",
                Endpoint::Unix("/run/stead.sock".into()),
            ),
            (
                "unix:///run/stead.sock",
                Endpoint::Unix("/run/stead.sock".into()),
            ),
            ("/run/stead.sock", Endpoint::Unix("/run/stead.sock".into())),
            ("./stead.sock", Endpoint::Unix("./stead.sock".into())),
        ];
        for (address, expected) in cases {
            assert_eq!(Endpoint::parse(address).expect(address), expected);
        }
        assert!(Endpoint::parse("https://node-1:4750").is_err());
        assert!(Endpoint::parse("unix:").is_err());
    }

    #[test]
    fn only_a_unix_socket_localhost_or_a_loopback_ip_is_this_host() {
        let cases = [
            ("127.0.0.1:4750", true),
            ("127.1.2.3:4750", true),
            ("http://localhost:4750/", true),
            ("[::1]:4750", true),
            ("unix:/run/stead.sock", true),
            ("./stead.sock", true),
            ("10.0.0.7:4750", false),
            ("node-1:4750", false),
            ("http://localhost.example.com:4750", false),
            ("[::]:4750", false),
        ];
        for (address, local) in cases {
            assert_eq!(
                is_local_address(address).expect(address),
                local,
                "{address}"
            );
        }
    }

    #[test]
    fn path_segments_are_percent_encoded() {
        assert_eq!(encode("web-1"), "web-1");
        assert_eq!(encode("../x y"), "..%2Fx%20y");
    }
}
