//! Who may join a ring: the ranks that prove they hold the job's rendezvous key.
//!
//! The operator draws a key per job (32 random bytes, in the job's SSH Secret) and gives
//! every rank its path ([`RENDEZVOUS_KEY_FILE_ENV`]). Whoever connects to rank 0's
//! rendezvous, or to a rank's ring port, is first sent a fresh random nonce, and its answer
//! (its hello at the rendezvous, its rank on a ring link) must carry an HMAC-SHA256 under
//! the key of that nonce and of what it says. An answer that is unsigned, signed with
//! another key, a replay of one seen before (its nonce was another), malformed, or later
//! than [`HANDSHAKE_TIMEOUT`] is refused: the connection is logged on stderr with its
//! address and closed, and takes no rank's place. Each connection is answered on a thread
//! of its own, so one that says nothing delays nobody.
//!
//! The key authenticates the ranks; it does not encrypt: gradients still travel in clear,
//! and someone on a connection's path could take it over after its handshake. Without a
//! key the ring admits whoever speaks its protocol, as before keys were given.

use std::fmt;
use std::io::{self, ErrorKind};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use ringmaster_contract::trainer::{RENDEZVOUS_KEY_FILE_ENV, RENDEZVOUS_KEY_MIN_BYTES};
use sha2::Sha256;

use super::CollectiveError;

/// Bytes of a nonce.
pub const NONCE_BYTES: usize = 32;
/// Bytes of a signature (HMAC-SHA256).
pub const MAC_BYTES: usize = 32;
/// The longest a connection may take to answer its nonce (or the collective's timeout, when
/// that is shorter). A rank answers at once.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Connections answered at once; one more is closed at once (and logged).
const MAX_HANDSHAKES: usize = 64;

/// The job's rendezvous key. Never printed.
#[derive(Clone)]
pub struct RendezvousKey(Arc<[u8]>);

impl fmt::Debug for RendezvousKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RendezvousKey(<{} bytes>)", self.0.len())
    }
}

impl RendezvousKey {
    /// A key of these bytes; fewer than [`RENDEZVOUS_KEY_MIN_BYTES`] are refused.
    pub fn new(bytes: &[u8]) -> Result<Self, String> {
        if bytes.len() < RENDEZVOUS_KEY_MIN_BYTES {
            return Err(format!(
                "{} bytes, fewer than the {RENDEZVOUS_KEY_MIN_BYTES} a key needs",
                bytes.len()
            ));
        }
        Ok(Self(bytes.into()))
    }

    /// The key in the file at `path` (all its bytes). A file that does not exist is no key,
    /// said on stderr: the job's Secret was made by an operator that drew none, and its
    /// ranks all go without.
    pub fn read(path: &Path) -> Result<Option<Self>, CollectiveError> {
        let error = |message: String| CollectiveError::Key {
            path: path.display().to_string(),
            message,
        };
        match std::fs::read(path) {
            Ok(bytes) => Self::new(&bytes).map(Some).map_err(error),
            Err(e) if e.kind() == ErrorKind::NotFound => {
                eprintln!(
                    "ringmaster-trainer: {RENDEZVOUS_KEY_FILE_ENV} names {}, which does not exist (a Secret made by an operator without rendezvous keys): the ring admits any peer that speaks its protocol",
                    path.display()
                );
                Ok(None)
            }
            Err(e) => Err(error(e.to_string())),
        }
    }

    /// The key in the file [`RENDEZVOUS_KEY_FILE_ENV`] names; none when it is unset or empty.
    pub fn from_env() -> Result<Option<Self>, CollectiveError> {
        match std::env::var_os(RENDEZVOUS_KEY_FILE_ENV) {
            Some(path) if !path.is_empty() => Self::read(Path::new(&path)),
            _ => Ok(None),
        }
    }

    /// The HMAC of `parts` for `purpose`, each part preceded by its length so that no two
    /// sequences of parts sign alike.
    fn mac(&self, purpose: &str, parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC takes a key of any length");
        for part in std::iter::once(purpose.as_bytes()).chain(parts.iter().copied()) {
            mac.update(&(part.len() as u64).to_le_bytes());
            mac.update(part);
        }
        mac
    }

    /// The signature of `parts` for `purpose`.
    pub(super) fn sign(&self, purpose: &str, parts: &[&[u8]]) -> [u8; MAC_BYTES] {
        self.mac(purpose, parts).finalize().into_bytes().into()
    }

    /// Whether `signature` is this key's of `parts` for `purpose` (compared in constant time).
    pub(super) fn verify(&self, purpose: &str, parts: &[&[u8]], signature: &[u8]) -> bool {
        self.mac(purpose, parts).verify_slice(signature).is_ok()
    }
}

/// A fresh nonce (from the thread's CSPRNG, seeded by the OS).
pub(super) fn nonce() -> [u8; NONCE_BYTES] {
    rand::random()
}

/// `bytes` in lower-case hex.
pub(super) fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes a hex string holds; `None` when it is not hex.
pub(super) fn from_hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Whether an answer's `signature` (none: unsigned) is `key`'s of `parts` for `purpose`;
/// the reason it is refused otherwise. Without a key every answer passes, signed or not
/// (a peer with a key where this rank has none is met at the rendezvous, below).
pub(super) fn check(
    key: Option<&RendezvousKey>,
    purpose: &str,
    parts: &[&[u8]],
    signature: Option<&[u8]>,
) -> Result<(), String> {
    match (key, signature) {
        (None, _) => Ok(()),
        (Some(key), Some(signature)) if key.verify(purpose, parts, signature) => Ok(()),
        (Some(_), Some(_)) => Err(
            "its signature is not the job's key's over this connection's nonce (another key, or a replay)"
                .into(),
        ),
        (Some(_), None) => Err("it is unsigned, and this job's ranks sign with its key".into()),
    }
}

/// A connection that was turned away: from where, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refused {
    /// The address it came from.
    pub peer: SocketAddr,
    /// What was wrong with it.
    pub reason: String,
}

/// What a handshake learnt from a connection it admits, or why it refuses it.
type Handshake<T> = dyn Fn(&mut TcpStream) -> Result<T, String> + Send + Sync;

/// A handshake's end: the connection and what it said, or why it was refused.
type Answer<T> = Result<(TcpStream, T), Refused>;

/// The connections a listener takes, each admitted by a handshake on a thread of its own:
/// those refused are logged and closed, and only those admitted come out of [`Gate::next`].
pub(super) struct Gate<T> {
    /// Where, for the log: "rank 0 refused 10.0.0.9:41234 at {place}: …".
    rank: usize,
    place: &'static str,
    timeout: Duration,
    handshake: Arc<Handshake<T>>,
    sender: Sender<Answer<T>>,
    receiver: Receiver<Answer<T>>,
    in_flight: Arc<AtomicUsize>,
    refused: Vec<Refused>,
}

impl<T: Send + 'static> Gate<T> {
    /// A gate of rank `rank` at `place`, whose handshakes may take `timeout` each.
    pub(super) fn new(
        rank: usize,
        place: &'static str,
        timeout: Duration,
        handshake: impl Fn(&mut TcpStream) -> Result<T, String> + Send + Sync + 'static,
    ) -> Self {
        let (sender, receiver) = mpsc::channel();
        Self {
            rank,
            place,
            timeout,
            handshake: Arc::new(handshake),
            sender,
            receiver,
            in_flight: Arc::new(AtomicUsize::new(0)),
            refused: Vec::new(),
        }
    }

    /// The connections refused so far (each one logged when it was).
    pub(super) fn refused(&self) -> &[Refused] {
        &self.refused
    }

    /// The next connection to `listener` that its handshake admits, and what it said; those
    /// refused meanwhile are logged and closed. Fails when none is admitted by `deadline`.
    pub(super) fn next(
        &mut self,
        listener: &TcpListener,
        deadline: Instant,
    ) -> io::Result<(TcpStream, T)> {
        listener.set_nonblocking(true)?;
        loop {
            while let Ok(answer) = self.receiver.try_recv() {
                match answer {
                    Ok(admitted) => return Ok(admitted),
                    Err(refused) => self.refused.push(refused),
                }
            }
            match listener.accept() {
                Ok((stream, peer)) => self.answer(stream, peer),
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(io::Error::new(
                            ErrorKind::TimedOut,
                            "no peer connected in time",
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                // Gone before it was taken: nobody to answer.
                Err(e) if e.kind() == ErrorKind::ConnectionAborted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Answers `stream` on a thread of its own, unless too many are being answered.
    fn answer(&mut self, stream: TcpStream, peer: SocketAddr) {
        if self.in_flight.load(Ordering::SeqCst) >= MAX_HANDSHAKES {
            let reason = format!("{MAX_HANDSHAKES} other connections are being answered");
            log_refusal(self.rank, self.place, peer, &reason);
            self.refused.push(Refused { peer, reason });
            return;
        }
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let (rank, place, timeout) = (self.rank, self.place, self.timeout);
        let (handshake, sender, in_flight) = (
            self.handshake.clone(),
            self.sender.clone(),
            self.in_flight.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name(format!("handshake {peer}"))
            .spawn(move || {
                let mut stream = stream;
                let result = prepare(&stream, timeout)
                    .map_err(|e| e.to_string())
                    .and_then(|()| handshake(&mut stream));
                let answer = match result {
                    Ok(value) => Ok((stream, value)),
                    Err(reason) => {
                        log_refusal(rank, place, peer, &reason);
                        // Said before the connection closes, so the gate counts it before
                        // any connection made after the refused one saw it close.
                        let _ = sender.send(Err(Refused { peer, reason }));
                        drop(stream);
                        in_flight.fetch_sub(1, Ordering::SeqCst);
                        return;
                    }
                };
                in_flight.fetch_sub(1, Ordering::SeqCst);
                // The gate may be gone (every rank came): the connection then closes.
                let _ = sender.send(answer);
            });
        if let Err(e) = spawned {
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            let reason = format!("no thread to answer it: {e}");
            log_refusal(self.rank, self.place, peer, &reason);
            self.refused.push(Refused { peer, reason });
        }
    }
}

/// A taken connection, blocking, with `timeout` on its reads and writes.
fn prepare(stream: &TcpStream, timeout: Duration) -> io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))
}

fn log_refusal(rank: usize, place: &str, peer: SocketAddr, reason: &str) {
    eprintln!("ringmaster-trainer: rank {rank} refused {peer} at {place}: {reason}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_goes_there_and_back() {
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(from_hex(&to_hex(&bytes)), Some(bytes));
        assert_eq!(to_hex(&[0, 15, 255]), "000fff");
        assert_eq!(from_hex("0"), None);
        assert_eq!(from_hex("zz"), None);
        assert_eq!(from_hex("é0"), None);
    }

    #[test]
    fn a_signature_binds_the_key_the_purpose_and_every_part() {
        let key = RendezvousKey::new(&[7; 32]).unwrap();
        let other = RendezvousKey::new(&[8; 32]).unwrap();
        let signature = key.sign("hello", &[b"nonce", b"rank"]);
        assert!(key.verify("hello", &[b"nonce", b"rank"], &signature));
        assert!(!other.verify("hello", &[b"nonce", b"rank"], &signature));
        assert!(!key.verify("link", &[b"nonce", b"rank"], &signature));
        assert!(!key.verify("hello", &[b"nonce2", b"rank"], &signature));
        // Lengths are signed too: moving bytes from one part to the next changes it.
        assert!(!key.verify("hello", &[b"nonc", b"erank"], &signature));
        assert!(!key.verify("hello", &[b"nonce", b"rank"], &signature[..31]));
        assert_eq!(
            check(Some(&key), "hello", &[b"n"], None).unwrap_err(),
            "it is unsigned, and this job's ranks sign with its key"
        );
        assert!(check(None, "hello", &[b"n"], None).is_ok());
        assert!(check(None, "hello", &[b"n"], Some(&[0; 32])).is_ok());
    }

    #[test]
    fn a_short_key_is_refused_and_none_is_printed() {
        assert!(RendezvousKey::new(&[1; 15]).is_err());
        let key = RendezvousKey::new(&[0x5a; 32]).unwrap();
        assert_eq!(format!("{key:?}"), "RendezvousKey(<32 bytes>)");
    }
}
