//! Azurite, Microsoft's Blob Storage emulator (npm `azurite`, installed by `make azurite`),
//! started on a free loopback port for one test and stopped when dropped.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use hmac::{Hmac, Mac};
use sha2::Sha256;

#[path = "ports.rs"]
mod ports;

/// Azurite's published development account.
pub const ACCOUNT: &str = "devstoreaccount1";
/// Azurite's published development key (not a secret).
pub const KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// A running Azurite blob service.
pub struct Azurite {
    child: Child,
    /// The address it listens on (127.0.0.1 unless started with [`Azurite::start_on`]).
    pub host: String,
    /// Its port on `host`.
    pub port: u16,
    _data: tempfile::TempDir,
}

/// Where `make azurite` puts the `azurite-blob` script.
pub fn azurite_blob() -> PathBuf {
    if let Ok(path) = std::env::var("RINGMASTER_AZURITE_BLOB") {
        return PathBuf::from(path);
    }
    let cache = std::env::var("RINGMASTER_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap()).join(".cache/ringmaster")
        });
    cache.join("azurite-3.37.0/node_modules/.bin/azurite-blob")
}

impl Azurite {
    /// Starts Azurite on 127.0.0.1 and waits until it accepts connections.
    pub fn start() -> Self {
        Self::start_on("127.0.0.1")
    }

    /// Starts Azurite on `host`, a local address (the real node's pods reach the host at its
    /// bridge address, not at 127.0.0.1), and waits until it accepts connections.
    pub fn start_on(host: &str) -> Self {
        let bin = azurite_blob();
        assert!(
            bin.exists(),
            "{} is missing: run `make azurite` (make test does it)",
            bin.display()
        );
        let port = ports::free_port(host);
        let data = tempfile::tempdir().unwrap();
        let mut child = Command::new(bin)
            .args(["--blobHost", host, "--blobPort", &port.to_string()])
            .args(["--skipApiVersionCheck", "--loose", "--silent"])
            .arg("--location")
            .arg(data.path())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start azurite-blob");
        let deadline = Instant::now() + Duration::from_secs(60);
        while TcpStream::connect((host, port)).is_err() {
            if let Ok(Some(status)) = child.try_wait() {
                panic!("Azurite exited ({status}) before it listened on {host}:{port}");
            }
            assert!(
                Instant::now() < deadline,
                "Azurite did not listen on {port} in 60 s"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Self {
            child,
            host: host.to_string(),
            port,
            _data: data,
        }
    }

    /// The account's blob endpoint, as a DataStage's `endpoint` takes it.
    pub fn endpoint(&self) -> String {
        format!("http://{}:{}/{ACCOUNT}", self.host, self.port)
    }
}

impl Drop for Azurite {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A service SAS for `container` (version 2021-08-06) signed with `key`: `permissions`
/// such as `rl` (read + list), valid until 2099.
pub fn container_sas(key: &str, container: &str, permissions: &str) -> String {
    let version = "2021-08-06";
    let expiry = "2099-01-01T00:00:00Z";
    let resource = format!("/blob/{ACCOUNT}/{container}");
    // signedPermissions, start, expiry, canonicalizedResource, identifier, IP, protocol,
    // version, resource, snapshot time, encryption scope, rscc, rscd, rsce, rscl, rsct.
    let to_sign = [
        permissions,
        "",
        expiry,
        &resource,
        "",
        "",
        "",
        version,
        "c",
        "",
        "",
        "",
        "",
        "",
        "",
        "",
    ]
    .join("\n");
    format!(
        "sv={version}&sr=c&sp={permissions}&se={}&sig={}",
        url_encode(expiry),
        sign(key, &to_sign)
    )
}

/// The URL-encoded base64 HMAC-SHA256 of `to_sign` with the base64 `key`.
fn sign(key: &str, to_sign: &str) -> String {
    let key = base64::engine::general_purpose::STANDARD
        .decode(key)
        .unwrap();
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).unwrap();
    mac.update(to_sign.as_bytes());
    url_encode(&base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes()))
}

fn url_encode(s: &str) -> String {
    form_urlencoded::byte_serialize(s.as_bytes()).collect()
}

/// An account SAS (blob service; service, container and object level) signed with the
/// development key, for test set-up such as creating containers.
pub fn account_sas(permissions: &str) -> String {
    let version = "2021-08-06";
    let expiry = "2099-01-01T00:00:00Z";
    let to_sign = format!("{ACCOUNT}\n{permissions}\nb\nsco\n\n{expiry}\n\n\n{version}\n\n");
    format!(
        "sv={version}&ss=b&srt=sco&sp={permissions}&se={}&sig={}",
        url_encode(expiry),
        sign(KEY, &to_sign)
    )
}

impl Azurite {
    /// Creates `container` (an account SAS request; object_store has no Create Container).
    pub fn create_container(&self, container: &str) {
        let sas = account_sas("racwdl");
        let status = self.put(&format!("{container}?restype=container&{sas}"), &[], b"");
        assert!(
            status == 201 || status == 409,
            "create container {container}: {status}"
        );
    }

    /// Uploads one block blob; `name` is put in the URL as given (percent-encode it first
    /// when it needs to be).
    pub fn put_blob(&self, container: &str, name: &str, data: &[u8]) -> u16 {
        let sas = account_sas("racwdl");
        self.put(
            &format!("{container}/{name}?{sas}"),
            &[("x-ms-blob-type", "BlockBlob")],
            data,
        )
    }

    /// Sets a blob's stored Content-MD5 (Set Blob Properties, which checks nothing, unlike an
    /// upload): a blob whose stated MD5 is not its content's.
    #[allow(dead_code)] // tests/stage.rs only
    pub fn set_content_md5(&self, container: &str, name: &str, md5_base64: &str) -> u16 {
        let sas = account_sas("racwdl");
        self.put(
            &format!("{container}/{name}?comp=properties&{sas}"),
            &[
                ("x-ms-blob-content-md5", md5_base64),
                ("x-ms-blob-content-type", "application/octet-stream"),
            ],
            b"",
        )
    }

    /// A raw HTTP/1.1 PUT to `/{account}/{path}`: no client in between that could
    /// normalise the path (the `..` test needs the dots to arrive as sent).
    fn put(&self, path: &str, headers: &[(&str, &str)], body: &[u8]) -> u16 {
        use std::io::{Read, Write};
        let mut request = format!(
            "PUT /{ACCOUNT}/{path} HTTP/1.1\r\nHost: {}:{}\r\nContent-Length: {}\r\nConnection: close\r\n",
            self.host,
            self.port,
            body.len()
        );
        for (k, v) in headers {
            request.push_str(&format!("{k}: {v}\r\n"));
        }
        request.push_str("\r\n");
        let mut stream = TcpStream::connect((self.host.as_str(), self.port)).unwrap();
        stream.write_all(request.as_bytes()).unwrap();
        stream.write_all(body).unwrap();
        let mut response = String::new();
        let _ = stream.read_to_string(&mut response);
        response
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0)
    }
}
