//! A service for the health check tests: `stead-test-health PORT FLAG` answers every HTTP
//! request on 127.0.0.1:PORT with `200 OK`, or with `500 Internal Server Error` while the
//! file FLAG exists, so a test turns the service unhealthy and back by creating and
//! removing one file.

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::Path;

fn main() {
    let mut args = std::env::args().skip(1);
    let port: u16 = args
        .next()
        .and_then(|arg| arg.parse().ok())
        .expect("usage: stead-test-health PORT FLAG");
    let flag = args.next().expect("usage: stead-test-health PORT FLAG");
    let listener = TcpListener::bind(("127.0.0.1", port)).expect("the port is free");
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let mut request = [0u8; 4096];
        let _ = stream.read(&mut request);
        let (status, body) = if Path::new(&flag).exists() {
            ("500 Internal Server Error", "failing")
        } else {
            ("200 OK", "ok")
        };
        let _ = write!(
            stream,
            "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
    }
}
