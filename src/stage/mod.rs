//! `ringmaster stage`: copy every blob under a prefix into a folder, resumably.
//!
//! The DataStage controller runs this in a Job with the share mounted; it also works on a
//! laptop. Blobs are listed first (a wrong credential fails here, before anything is
//! written), names that would leave the destination are refused, then up to `parallelism`
//! downloads stream into temporary files under `.ringmaster-stage/tmp/` and are renamed
//! into place when complete, so a reader never sees half a file and a killed run leaves no
//! partial file under a real name. The manifest (`.ringmaster-stage/manifest.jsonl`) makes
//! a rerun skip what is already there and intact.
//!
//! Each download is of one blob version: the GET is pinned to the ETag the listing gave
//! (`If-Match`), so a blob overwritten meanwhile is fetched again whole at its new version,
//! never spliced from two. When the blob states a Content-MD5, the bytes must hash to it, or
//! the file is fetched again and, failing that, the copy fails naming it. With `--mirror`,
//! files copied earlier whose blobs are gone are deleted after a complete copy.

pub mod manifest;
mod mirror;
pub mod names;
pub mod progress;
pub mod verify;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use md5::{Digest, Md5};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::path::Path as ObjectPath;
use object_store::{GetOptions, ObjectMeta, ObjectStore, ObjectStoreExt, RetryConfig};
use tokio::io::AsyncWriteExt;

use manifest::{Entry, Manifest};
use progress::{Counters, Reporter};

/// The stager's bookkeeping folder under the destination.
pub const STATE_DIR: &str = ".ringmaster-stage";

/// Environment variable holding a SAS token (never a flag: flags show in `ps`).
pub const SAS_TOKEN_ENV: &str = "AZURE_STORAGE_SAS_TOKEN";
/// Environment variable holding an account key.
pub const ACCOUNT_KEY_ENV: &str = "AZURE_STORAGE_ACCOUNT_KEY";

/// The stager's settings in its environment: one name each, read by [`StageArgs`] and
/// written by the DataStage controller's copy Job (through [`StageSettings::to_env`]).
pub mod env {
    /// `--account`.
    pub const ACCOUNT: &str = "RINGMASTER_STAGE_ACCOUNT";
    /// `--container`.
    pub const CONTAINER: &str = "RINGMASTER_STAGE_CONTAINER";
    /// `--prefix`.
    pub const PREFIX: &str = "RINGMASTER_STAGE_PREFIX";
    /// `--endpoint`.
    pub const ENDPOINT: &str = "RINGMASTER_STAGE_ENDPOINT";
    /// `--destination`.
    pub const DESTINATION: &str = "RINGMASTER_STAGE_DESTINATION";
    /// `--parallelism`.
    pub const PARALLELISM: &str = "RINGMASTER_STAGE_PARALLELISM";
    /// `--verify`.
    pub const VERIFY: &str = "RINGMASTER_STAGE_VERIFY";
    /// `--auth`.
    pub const AUTH: &str = "RINGMASTER_STAGE_AUTH";
    /// `--report-to`.
    pub const REPORT_TO: &str = "RINGMASTER_DATASTAGE";
    /// `--mirror`.
    pub const MIRROR: &str = "RINGMASTER_STAGE_MIRROR";
    /// Tests only: a path. Each file is held, once written and fsynced and before it is
    /// renamed into place, forever, after this file is created: a test kills the stager
    /// there. Never set by the DataStage controller.
    pub const TEST_HOLD_BEFORE_RENAME: &str = "RINGMASTER_STAGE_TEST_HOLD_BEFORE_RENAME";
}

/// What the DataStage controller asks of the stager: typed, and turned into the copy Job's
/// environment by [`StageSettings::to_env`], which [`StageArgs`] reads back (a test runs the
/// stager's own parser on a built Job's environment).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageSettings {
    /// Storage account.
    pub account: String,
    /// Container.
    pub container: String,
    /// Folder prefix.
    pub prefix: String,
    /// Blob service URL.
    pub endpoint: String,
    /// Folder to copy into.
    pub destination: String,
    /// Downloads at once.
    pub parallelism: u32,
    /// Check of files already present.
    pub verify: VerifyMode,
    /// Sign-in method (its secret comes from a Secret, by name, not from here).
    pub auth: AuthMethod,
    /// The DataStage to report progress to, `NAMESPACE/NAME`.
    pub report_to: String,
    /// Delete files copied earlier whose blobs are gone.
    pub mirror: bool,
}

impl StageSettings {
    /// The environment variables (name, value) that carry these settings.
    pub fn to_env(&self) -> Vec<(&'static str, String)> {
        vec![
            (env::ACCOUNT, self.account.clone()),
            (env::CONTAINER, self.container.clone()),
            (env::PREFIX, self.prefix.clone()),
            (env::ENDPOINT, self.endpoint.clone()),
            (env::DESTINATION, self.destination.clone()),
            (env::PARALLELISM, self.parallelism.to_string()),
            (
                env::VERIFY,
                ringmaster_contract::trainer::flag_value(self.verify),
            ),
            (
                env::AUTH,
                ringmaster_contract::trainer::flag_value(self.auth),
            ),
            (env::REPORT_TO, self.report_to.clone()),
            (env::MIRROR, self.mirror.to_string()),
        ]
    }
}

/// How the stager signs in to Blob Storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AuthMethod {
    /// A SAS token from $AZURE_STORAGE_SAS_TOKEN when set, else an account key from
    /// $AZURE_STORAGE_ACCOUNT_KEY, else workload identity when $AZURE_FEDERATED_TOKEN_FILE
    /// is set (AKS injects it), else the VM's managed identity.
    Auto,
    /// $AZURE_STORAGE_SAS_TOKEN (read + list on the container).
    SasToken,
    /// $AZURE_STORAGE_ACCOUNT_KEY (full access to the account: prefer a SAS token).
    AccountKey,
    /// Azure AD workload identity: $AZURE_CLIENT_ID, $AZURE_TENANT_ID,
    /// $AZURE_FEDERATED_TOKEN_FILE.
    WorkloadIdentity,
    /// The node's managed identity (IMDS); $AZURE_CLIENT_ID picks a user-assigned one.
    ManagedIdentity,
}

/// How a file already present is checked before it is skipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum VerifyMode {
    /// Same size and same blob version (ETag) as recorded.
    Size,
    /// That, and the file still hashes to the MD5 recorded when it was downloaded.
    Md5,
}

/// Where progress goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProgressMode {
    /// A bar when stderr is a terminal, else log lines.
    Auto,
    /// A bar on stderr.
    Bar,
    /// A log line every interval.
    Log,
    /// Nothing but the summary.
    None,
}

/// Settings of `ringmaster stage`.
#[derive(clap::Args, Clone, Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StageArgs {
    /// Storage account name.
    #[arg(long, env = env::ACCOUNT)]
    pub account: String,
    /// Blob container.
    #[arg(long, env = env::CONTAINER)]
    pub container: String,
    /// Copy the blobs whose names start with this folder prefix (e.g. `imagenet/`); the
    /// prefix is taken off the local paths. Empty: the whole container.
    #[arg(long, env = env::PREFIX, default_value = "")]
    pub prefix: String,
    /// Blob service URL of the account: sovereign clouds
    /// (`https://ACCOUNT.blob.core.chinacloudapi.cn`) or Azurite
    /// (`http://127.0.0.1:10000/devstoreaccount1`). Default:
    /// `https://ACCOUNT.blob.core.windows.net`.
    #[arg(long, env = env::ENDPOINT)]
    pub endpoint: Option<String>,
    /// Folder to copy into (created when missing).
    #[arg(long, env = env::DESTINATION)]
    pub destination: PathBuf,
    /// Downloads at once.
    #[arg(long, env = env::PARALLELISM, default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=512))]
    pub parallelism: u32,
    /// How files already present are checked before being skipped.
    #[arg(long, env = env::VERIFY, value_enum, default_value_t = VerifyMode::Md5)]
    pub verify: VerifyMode,
    /// How to sign in (secrets come from the environment only).
    #[arg(long, env = env::AUTH, value_enum, default_value_t = AuthMethod::Auto)]
    pub auth: AuthMethod,
    /// Report progress to this DataStage (`NAMESPACE/NAME`) through the in-cluster
    /// ServiceAccount, which needs `patch` on `datastages/status` for that name.
    #[arg(long, env = env::REPORT_TO)]
    pub report_to: Option<String>,
    /// After a complete copy, delete the files this stager copied earlier (they are in its
    /// manifest) whose blobs are gone from the source, so the destination mirrors the
    /// prefix. Files it did not copy are never touched. Off: they stay.
    #[arg(long, env = env::MIRROR, default_value_t = false, action = clap::ArgAction::Set,
          num_args = 0..=1, default_missing_value = "true")]
    pub mirror: bool,
    /// Where progress is shown.
    #[arg(long, value_enum, default_value_t = ProgressMode::Auto)]
    pub progress: ProgressMode,
    /// Seconds between progress reports.
    #[arg(long, default_value_t = 2.0)]
    pub progress_interval: f64,
    /// Also write the error (or the JSON summary) to this file: a pod's termination message,
    /// which Kubernetes shows in the pod's status.
    #[arg(long)]
    pub termination_message: Option<PathBuf>,
    /// Attempts per file for errors in the middle of a download (each request is also
    /// retried with backoff on throttling and server errors).
    #[arg(long, default_value_t = 4)]
    pub attempts: u32,
    /// Print the settings as read from the flags and the environment (JSON, no secrets)
    /// and exit without copying.
    #[arg(long)]
    #[serde(skip)]
    pub print_settings: bool,
}

/// What `ringmaster stage` leaves in its termination message (`--termination-message`): the
/// summary, or the error. The DataStage controller reads it into the DataStage's status.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "result", rename_all = "camelCase")]
pub enum Outcome {
    /// Every blob is in place.
    Succeeded(Summary),
    /// Staging stopped; why (never a credential).
    Failed {
        /// The error, as the stager printed it.
        error: String,
    },
}

impl Outcome {
    /// The one line written to the termination message.
    pub fn to_message(&self) -> String {
        serde_json::to_string(self).expect("an outcome serializes")
    }

    /// The outcome in a termination message, if it holds one (else it is a log's tail).
    pub fn parse(message: &str) -> Option<Outcome> {
        message
            .lines()
            .rev()
            .find_map(|line| serde_json::from_str(line.trim()).ok())
    }
}

/// Why staging failed. Messages never contain the credential.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// The settings cannot work.
    #[error("{0}")]
    Config(String),
    /// Blob Storage refused the credential or the listing. The message is composed here,
    /// not the client's error kept as a source: that error can quote the request URL, and
    /// with it a SAS token's signature.
    #[error("listing {container}/{prefix} in account {account}: {message}")]
    List {
        account: String,
        container: String,
        prefix: String,
        message: String,
    },
    /// Blob names that cannot be written safely; nothing was copied.
    #[error(
        "{count} blob name(s) would be written outside the destination, nothing copied: {examples}"
    )]
    UnsafeNames { count: usize, examples: String },
    /// The destination filled up.
    #[error(
        "the destination {path} is full: {needed} still to copy; grow the volume (DataStage spec.capacity) and run again, copied files are kept"
    )]
    DiskFull { path: PathBuf, needed: String },
    /// A file could not be written.
    #[error("writing {path}: {source}")]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A blob could not be downloaded after every attempt.
    #[error("downloading {name} failed after {attempts} attempts: {message}")]
    Download {
        name: String,
        attempts: u32,
        message: String,
    },
    /// The bytes of a blob never hashed to the Content-MD5 the blob states.
    #[error(
        "blob {name} states Content-MD5 {expected} (hex) but its bytes hashed to {got} in each of {attempts} downloads; it was not written under its name. Its stored Content-MD5 is wrong (set by its uploader) or the blob is damaged: upload it again, or correct the property (az storage blob update --content-md5), then run again"
    )]
    ContentMismatch {
        name: String,
        expected: String,
        got: String,
        attempts: u32,
    },
    /// A blob kept changing while it was downloaded.
    #[error(
        "blob {name} was overwritten {times} times while it was being copied; stop writing it (or stage a prefix that is not being written) and run again"
    )]
    KeepsChanging { name: String, times: u32 },
    /// A blob was deleted after it was listed.
    #[error(
        "blob {name} was deleted while the copy ran; run again to copy the prefix as it is now"
    )]
    Vanished { name: String },
    /// `--report-to` is not `NAMESPACE/NAME`.
    #[error("reporting to DataStage {0}: expected NAMESPACE/NAME")]
    ReportTarget(String),
    /// No in-cluster client to report progress with.
    #[error("reporting to DataStage {target}: {source}")]
    Report {
        target: String,
        #[source]
        source: kube::Error,
    },
}

/// What a run did.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Summary {
    /// Files listed.
    pub files: u64,
    /// Bytes listed.
    pub bytes: u64,
    /// Files downloaded in this run.
    pub downloaded_files: u64,
    /// Bytes downloaded in this run.
    pub downloaded_bytes: u64,
    /// Files already present and intact.
    pub skipped_files: u64,
    /// Files deleted because their blobs are gone (`--mirror`).
    #[serde(default)]
    pub deleted_files: u64,
    /// Wall time.
    pub seconds: f64,
    /// Downloaded bytes per second.
    pub bytes_per_second: f64,
}

/// Builds the Blob client for `args`, with credentials from the environment.
pub fn blob_store(args: &StageArgs) -> Result<Arc<dyn ObjectStore>, StageError> {
    crate::tls::install_provider();
    let env = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    let mut builder = MicrosoftAzureBuilder::new()
        .with_account(&args.account)
        .with_container_name(&args.container)
        // Keeps each blob's Content-MD5, which the download is checked against.
        .with_http_connector(verify::Md5Connector)
        .with_retry(RetryConfig {
            max_retries: 8,
            retry_timeout: Duration::from_secs(300),
            ..RetryConfig::default()
        });
    if let Some(endpoint) = &args.endpoint {
        builder = builder
            .with_endpoint(endpoint.trim_end_matches('/').to_string())
            .with_allow_http(endpoint.starts_with("http://"));
    }
    let method = match args.auth {
        AuthMethod::Auto if env(SAS_TOKEN_ENV).is_some() => AuthMethod::SasToken,
        AuthMethod::Auto if env(ACCOUNT_KEY_ENV).is_some() => AuthMethod::AccountKey,
        AuthMethod::Auto if env("AZURE_FEDERATED_TOKEN_FILE").is_some() => {
            AuthMethod::WorkloadIdentity
        }
        AuthMethod::Auto => AuthMethod::ManagedIdentity,
        other => other,
    };
    let missing = |name: &str| StageError::Config(format!("--auth needs ${name}"));
    builder = match method {
        AuthMethod::SasToken => {
            let token = env(SAS_TOKEN_ENV).ok_or_else(|| missing(SAS_TOKEN_ENV))?;
            builder.with_config(AzureConfigKey::SasKey, token.trim_start_matches('?'))
        }
        AuthMethod::AccountKey => {
            builder.with_access_key(env(ACCOUNT_KEY_ENV).ok_or_else(|| missing(ACCOUNT_KEY_ENV))?)
        }
        AuthMethod::WorkloadIdentity => {
            let file = env("AZURE_FEDERATED_TOKEN_FILE")
                .ok_or_else(|| missing("AZURE_FEDERATED_TOKEN_FILE"))?;
            builder
                .with_federated_token_file(file)
                .with_client_id(env("AZURE_CLIENT_ID").ok_or_else(|| missing("AZURE_CLIENT_ID"))?)
                .with_tenant_id(env("AZURE_TENANT_ID").ok_or_else(|| missing("AZURE_TENANT_ID"))?)
        }
        AuthMethod::ManagedIdentity | AuthMethod::Auto => {
            let builder = builder.with_config(AzureConfigKey::CredentialType, "managed_identity");
            match env("AZURE_CLIENT_ID") {
                Some(id) => builder.with_client_id(id),
                None => builder,
            }
        }
    };
    builder
        .build()
        .map(|s| Arc::new(s) as Arc<dyn ObjectStore>)
        .map_err(|e| StageError::Config(format!("Blob Storage client: {e}")))
}

/// Runs a copy with the reporter `args` asks for.
pub async fn run(args: &StageArgs) -> Result<Summary, StageError> {
    let store = blob_store(args)?;
    let reporter = reporter(args).await?;
    copy(store, args, &reporter).await
}

async fn reporter(args: &StageArgs) -> Result<Reporter, StageError> {
    if let Some(target) = &args.report_to {
        let (namespace, name) = target
            .split_once('/')
            .ok_or_else(|| StageError::ReportTarget(target.clone()))?;
        crate::tls::install_provider();
        let client = kube::Client::try_default()
            .await
            .map_err(|source| StageError::Report {
                target: target.clone(),
                source,
            })?;
        return Ok(Reporter::Status {
            api: Box::new(kube::Api::namespaced(client, namespace)),
            name: name.to_string(),
        });
    }
    use std::io::IsTerminal;
    Ok(match args.progress {
        ProgressMode::Bar => bar(),
        ProgressMode::Auto if std::io::stderr().is_terminal() => bar(),
        ProgressMode::Auto | ProgressMode::Log => Reporter::Log,
        ProgressMode::None => Reporter::Log,
    })
}

fn bar() -> Reporter {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} {msg} eta {eta}",
        )
        .expect("template is valid"),
    );
    Reporter::Bar(bar)
}

/// Lists, plans and copies; reports progress through `reporter`.
pub async fn copy(
    store: Arc<dyn ObjectStore>,
    args: &StageArgs,
    reporter: &Reporter,
) -> Result<Summary, StageError> {
    let started = Instant::now();
    let listing = list(store.as_ref(), args).await?;
    let state = args.destination.join(STATE_DIR);
    // One stager writes a destination at a time (a Job's replacement pod during a node
    // partition, a second DataStage of the same folder): held until this copy ends.
    let _writing = lock_destination(&state).await?;
    let tmp = state.join("tmp");
    // Leftovers of a killed run are partial downloads: start them again. (No other stager
    // is writing here: the lock.)
    let _ = tokio::fs::remove_dir_all(&tmp).await;
    tokio::fs::create_dir_all(&tmp)
        .await
        .map_err(write_err(&tmp))?;
    let manifest = Manifest::load(&state).map_err(write_err(&state))?;

    let counters = Arc::new(Counters::default());
    counters
        .files_total
        .store(listing.len() as u64, Ordering::Relaxed);
    counters.bytes_total.store(
        listing.iter().map(|(_, meta)| meta.size).sum(),
        Ordering::Relaxed,
    );

    // Decide what to fetch; checking with MD5 reads every present file, so it runs in
    // parallel too.
    let checks = futures::stream::iter(listing.into_iter().map(|(local, meta)| {
        let manifest = &manifest;
        let destination = &args.destination;
        async move {
            let key = slash_path(&local);
            let present = intact(destination, &key, &meta, manifest.get(&key), args.verify).await;
            (local, meta, present)
        }
    }))
    .buffer_unordered(args.parallelism as usize)
    .collect::<Vec<_>>()
    .await;

    let mut entries = Vec::with_capacity(checks.len());
    let mut to_fetch = Vec::new();
    for (local, meta, present) in checks {
        match present {
            Some(entry) => {
                counters.files_done.fetch_add(1, Ordering::Relaxed);
                counters.bytes_done.fetch_add(meta.size, Ordering::Relaxed);
                entries.push(entry);
            }
            None => to_fetch.push((local, meta)),
        }
    }
    let skipped = entries.len() as u64;

    let appender = std::sync::Mutex::new(manifest.appender().map_err(write_err(&state))?);
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let interval = Duration::from_secs_f64(args.progress_interval.max(0.1));
    let report = async {
        if args.progress != ProgressMode::None || args.report_to.is_some() {
            reporter
                .run(&counters, interval, async {
                    let _ = done_rx.await;
                })
                .await;
        }
    };
    let downloads = async {
        let result = futures::stream::iter(to_fetch.into_iter().enumerate().map(|(i, item)| {
            let (store, counters, tmp, appender) = (&store, &counters, &tmp, &appender);
            async move {
                let (local, meta) = item;
                let entry = fetch(
                    store.as_ref(),
                    args,
                    &meta,
                    &local,
                    &tmp.join(i.to_string()),
                    counters,
                )
                .await?;
                appender
                    .lock()
                    .expect("manifest lock")
                    .append(&entry)
                    .map_err(write_err(&args.destination.join(STATE_DIR)))?;
                counters.files_done.fetch_add(1, Ordering::Relaxed);
                Ok::<_, StageError>(entry)
            }
        }))
        .buffer_unordered(args.parallelism as usize)
        .try_collect::<Vec<_>>()
        .await;
        let _ = done_tx.send(());
        result
    };
    let (fetched, ()) = tokio::join!(downloads, report);
    let fetched = fetched.map_err(|e| disk_full(e, &args.destination, &counters))?;
    let downloaded_files = fetched.len() as u64;
    entries.extend(fetched);
    // Files copied earlier whose blobs are gone: deleted with --mirror, else kept on record
    // (their files stay, and a later --mirror run finds them).
    let gone = mirror::gone(&manifest, &entries);
    let deleted_files = if args.mirror {
        mirror::delete(&args.destination, &gone).await?
    } else {
        entries.extend(gone);
        0
    };
    entries.sort_by(|a, b| a.path.cmp(&b.path));
    manifest.compact(&entries).map_err(write_err(&state))?;
    let _ = tokio::fs::remove_dir_all(&tmp).await;

    let s = counters.snapshot();
    let seconds = started.elapsed().as_secs_f64();
    Ok(Summary {
        files: s.files_total,
        bytes: s.bytes_total,
        downloaded_files,
        downloaded_bytes: s.bytes_downloaded,
        skipped_files: skipped,
        deleted_files,
        seconds,
        bytes_per_second: s.bytes_downloaded as f64 / seconds.max(1e-9),
    })
}

/// Turns an I/O error on `path` into [`StageError::Write`].
/// Linux's "no locks available" (an NFS mount without a lock manager).
const ENOLCK: i32 = 37;

/// The lock file under the state folder that one stager at a time holds (`flock`, which
/// Linux carries over NFS as a byte-range lock). Another stager's lock is waited for, and
/// said on stderr.
async fn lock_destination(state: &Path) -> Result<std::fs::File, StageError> {
    tokio::fs::create_dir_all(state)
        .await
        .map_err(write_err(state))?;
    let path = state.join("lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(write_err(&path))?;
    match file.try_lock() {
        Ok(()) => return Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => eprintln!(
            "ringmaster stage: another stager is writing {}; waiting for it to finish",
            state.parent().unwrap_or(state).display()
        ),
        // An NFSv3 mount without a lock manager: copy as before, unlocked, and say so.
        Err(std::fs::TryLockError::Error(e))
            if e.kind() == std::io::ErrorKind::Unsupported || e.raw_os_error() == Some(ENOLCK) =>
        {
            eprintln!(
                "ringmaster stage: {} cannot be locked ({e}); copying without the lock that keeps a second stager out",
                path.display()
            );
            return Ok(file);
        }
        Err(std::fs::TryLockError::Error(e)) => return Err(write_err(&path)(e)),
    }
    tokio::task::spawn_blocking(move || file.lock().map(|()| file))
        .await
        .expect("the lock task does not panic")
        .map_err(write_err(&path))
}

fn write_err(path: &Path) -> impl FnOnce(std::io::Error) -> StageError {
    let path = path.to_path_buf();
    move |source| StageError::Write { path, source }
}

/// A full disk is said as such, with what was left to copy.
fn disk_full(error: StageError, destination: &Path, counters: &Counters) -> StageError {
    match &error {
        StageError::Write { source, .. } if is_disk_full(source) => {
            let s = counters.snapshot();
            StageError::DiskFull {
                path: destination.to_path_buf(),
                needed: progress::human_bytes(s.bytes_total.saturating_sub(s.bytes_done)),
            }
        }
        _ => error,
    }
}

/// Whether an I/O error means there is no space (or quota) left.
pub fn is_disk_full(error: &std::io::Error) -> bool {
    matches!(
        error.kind(),
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
    )
}

/// Every blob under the prefix with its local path; refuses the whole listing when a name
/// is unsafe.
async fn list(
    store: &dyn ObjectStore,
    args: &StageArgs,
) -> Result<Vec<(PathBuf, ObjectMeta)>, StageError> {
    let list_error = |message: String| StageError::List {
        account: args.account.clone(),
        container: args.container.clone(),
        prefix: args.prefix.clone(),
        message,
    };
    let prefix = args.prefix.trim_end_matches('/');
    let prefix_path = (!prefix.is_empty()).then(|| ObjectPath::from(prefix));
    let objects: Vec<ObjectMeta> = store
        .list(prefix_path.as_ref())
        .try_collect()
        .await
        .map_err(|e| match e {
            // object_store refuses names with `..`, `.` or empty segments while listing.
            object_store::Error::InvalidPath { source } => StageError::UnsafeNames {
                count: 1,
                examples: source.to_string(),
            },
            other => list_error(explain_list_error(&other)),
        })?;
    let name_prefix = if prefix.is_empty() {
        String::new()
    } else {
        format!("{prefix}/")
    };
    let mut unsafe_names = Vec::new();
    let mut listing = Vec::with_capacity(objects.len());
    for meta in objects {
        match names::local_path(&name_prefix, meta.location.as_ref()) {
            Ok(local) if names::is_bookkeeping(&local) => unsafe_names.push(format!(
                "{}: uses the stager's folder {STATE_DIR}",
                meta.location
            )),
            Ok(local) => listing.push((local, meta)),
            Err(e) => unsafe_names.push(e.to_string()),
        }
    }
    if !unsafe_names.is_empty() {
        return Err(StageError::UnsafeNames {
            count: unsafe_names.len(),
            examples: unsafe_names
                .into_iter()
                .take(5)
                .collect::<Vec<_>>()
                .join("; "),
        });
    }
    Ok(listing)
}

/// A short, actionable reason for a failed listing (the SDK's own text is kept at the end).
fn explain_list_error(error: &object_store::Error) -> String {
    let text = error.to_string();
    let hint = if text.contains("403") || text.contains("AuthenticationFailed") {
        "the credential was refused (wrong key, or a SAS token that is expired, for another \
         account or container, or lacks read and list permissions)"
    } else if text.contains("404") || text.contains("ContainerNotFound") {
        "the container does not exist"
    } else {
        "Blob Storage could not be reached or refused the request"
    };
    format!("{hint}: {text}")
}

/// `a/b/c` for a relative path.
fn slash_path(path: &Path) -> String {
    path.components()
        .map(|c| c.as_os_str().to_string_lossy())
        .collect::<Vec<_>>()
        .join("/")
}

/// The manifest entry when the file is present and intact, else `None`.
async fn intact(
    destination: &Path,
    key: &str,
    meta: &ObjectMeta,
    recorded: Option<&Entry>,
    verify: VerifyMode,
) -> Option<Entry> {
    let recorded = recorded?;
    let on_disk = tokio::fs::metadata(destination.join(key)).await.ok()?;
    if !on_disk.is_file() || on_disk.len() != meta.size || recorded.size != meta.size {
        return None;
    }
    if recorded.etag.is_some() && recorded.etag != meta.e_tag {
        return None;
    }
    if verify == VerifyMode::Md5 && md5_of_file(&destination.join(key)).await.ok()? != recorded.md5
    {
        return None;
    }
    Some(recorded.clone())
}

async fn md5_of_file(path: &Path) -> std::io::Result<String> {
    let path = path.to_path_buf();
    tokio::task::spawn_blocking(move || {
        use std::io::Read;
        let mut file = std::fs::File::open(path)?;
        let mut hasher = Md5::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = file.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
        }
        Ok(hex(&hasher.finalize()))
    })
    .await
    .expect("hashing task")
}

/// How often a blob may be overwritten while it is fetched before the copy gives up on it:
/// more is a blob being written continuously, which cannot be copied whole.
const MAX_VERSION_CHANGES: u32 = 5;

/// Downloads one blob into `tmp`, then renames it to its place. A broken stream, or bytes
/// that do not hash to the blob's Content-MD5, is fetched again (`--attempts`); a blob
/// overwritten since it was listed is looked up again and fetched whole at its new version.
async fn fetch(
    store: &dyn ObjectStore,
    args: &StageArgs,
    listed: &ObjectMeta,
    local: &Path,
    tmp: &Path,
    counters: &Counters,
) -> Result<Entry, StageError> {
    let target = args.destination.join(local);
    if let Some(parent) = target.parent() {
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(write_err(parent))?;
    }
    let mut meta = listed.clone();
    let (mut attempt, mut changes) = (0, 0);
    loop {
        attempt += 1;
        let failure = match download(store, &meta, tmp, counters).await {
            Ok(md5) => {
                hold_before_rename(tmp).await;
                tokio::fs::rename(tmp, &target)
                    .await
                    .map_err(write_err(&target))?;
                return Ok(Entry {
                    path: slash_path(local),
                    size: meta.size,
                    etag: meta.e_tag.clone(),
                    md5,
                });
            }
            Err(Failure::Write(source)) => {
                return Err(StageError::Write {
                    path: target,
                    source,
                });
            }
            Err(failure) => failure,
        };
        // Bytes of a failed attempt are not progress.
        let read = failure.read();
        counters.bytes_done.fetch_sub(read, Ordering::Relaxed);
        counters.bytes_downloaded.fetch_sub(read, Ordering::Relaxed);
        if let Failure::Changed(_) = failure {
            changes += 1;
            attempt -= 1;
            meta = new_version(store, &meta, changes, counters).await?;
            continue;
        }
        let name = meta.location.to_string();
        if attempt >= args.attempts.max(1) {
            return Err(failure.into_error(name, attempt));
        }
        tracing::warn!(blob = %name, attempt, failure = %failure.describe(), "download failed; retrying");
        tokio::time::sleep(Duration::from_millis(200 << attempt.min(6))).await;
    }
}

/// The blob's version now, after a download pinned to `old` found it overwritten; the total
/// to copy follows its new size.
async fn new_version(
    store: &dyn ObjectStore,
    old: &ObjectMeta,
    changes: u32,
    counters: &Counters,
) -> Result<ObjectMeta, StageError> {
    let name = old.location.to_string();
    if changes > MAX_VERSION_CHANGES {
        return Err(StageError::KeepsChanging {
            name,
            times: changes,
        });
    }
    let new = match store.head(&old.location).await {
        Ok(new) => new,
        Err(object_store::Error::NotFound { .. }) => return Err(StageError::Vanished { name }),
        Err(e) => {
            return Err(StageError::Download {
                name,
                attempts: 1,
                message: format!("looking up its new version: {e}"),
            });
        }
    };
    eprintln!(
        "ringmaster stage: blob {name} was overwritten after it was listed (ETag {} → {}); fetching the new version whole",
        old.e_tag.as_deref().unwrap_or("none"),
        new.e_tag.as_deref().unwrap_or("none")
    );
    counters.bytes_total.fetch_add(new.size, Ordering::Relaxed);
    counters.bytes_total.fetch_sub(old.size, Ordering::Relaxed);
    Ok(new)
}

/// Tests only ([`env::TEST_HOLD_BEFORE_RENAME`]): a written, fsynced file waits here forever,
/// before its rename, once the marker file is made.
async fn hold_before_rename(tmp: &Path) {
    if let Some(marker) = std::env::var_os(env::TEST_HOLD_BEFORE_RENAME) {
        let _ = std::fs::write(&marker, tmp.as_os_str().as_encoded_bytes());
        std::future::pending::<()>().await;
    }
}

/// Why one download attempt failed.
enum Failure {
    /// Reading from Blob Storage failed after `u64` bytes.
    Read(String, u64),
    /// The blob is no longer the version listed (`If-Match` failed), after `u64` bytes.
    Changed(u64),
    /// The `u64` bytes read hash to `got`, not to the blob's Content-MD5 `expected`.
    Corrupt {
        expected: String,
        got: String,
        read: u64,
    },
    /// Writing locally failed.
    Write(std::io::Error),
}

impl Failure {
    /// Bytes counted as progress in the attempt.
    fn read(&self) -> u64 {
        match self {
            Failure::Read(_, read) | Failure::Changed(read) | Failure::Corrupt { read, .. } => {
                *read
            }
            Failure::Write(_) => 0,
        }
    }

    fn describe(&self) -> String {
        match self {
            Failure::Read(message, _) => message.clone(),
            Failure::Changed(_) => "the blob changed".into(),
            Failure::Corrupt { expected, got, .. } => {
                format!("MD5 {got} of the bytes is not the blob's Content-MD5 {expected}")
            }
            Failure::Write(e) => e.to_string(),
        }
    }

    /// The error when this was the last attempt on blob `name`.
    fn into_error(self, name: String, attempts: u32) -> StageError {
        match self {
            Failure::Corrupt { expected, got, .. } => StageError::ContentMismatch {
                name,
                expected,
                got,
                attempts,
            },
            other => StageError::Download {
                name,
                attempts,
                message: other.describe(),
            },
        }
    }
}

/// A failed GET or a broken stream: the blob changed (`If-Match` refused), or a read error.
fn read_failure(error: object_store::Error, read: u64) -> Failure {
    match error {
        object_store::Error::Precondition { .. } => Failure::Changed(read),
        other => Failure::Read(other.to_string(), read),
    }
}

/// Downloads the version `meta` names (its ETag) into `tmp`, fsyncs it and checks its size
/// and, when the blob states one, its Content-MD5; the hex MD5 of the bytes.
async fn download(
    store: &dyn ObjectStore,
    meta: &ObjectMeta,
    tmp: &Path,
    counters: &Counters,
) -> Result<String, Failure> {
    let mut file = tokio::fs::File::create(tmp).await.map_err(Failure::Write)?;
    let mut hasher = Md5::new();
    let mut read = 0u64;
    let options = GetOptions {
        if_match: meta.e_tag.clone(),
        ..GetOptions::default()
    };
    let result = store
        .get_opts(&meta.location, options)
        .await
        .map_err(|e| read_failure(e, 0))?;
    let stated = result.extensions.get::<verify::ContentMd5>().cloned();
    let mut stream = result.into_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| read_failure(e, read))?;
        hasher.update(&chunk);
        file.write_all(&chunk).await.map_err(Failure::Write)?;
        read += chunk.len() as u64;
        counters
            .bytes_done
            .fetch_add(chunk.len() as u64, Ordering::Relaxed);
        counters
            .bytes_downloaded
            .fetch_add(chunk.len() as u64, Ordering::Relaxed);
    }
    file.flush().await.map_err(Failure::Write)?;
    // On disk before the rename gives it its name: a crash never leaves a named, empty file.
    file.sync_all().await.map_err(Failure::Write)?;
    if read != meta.size {
        return Err(Failure::Read(
            format!("got {read} bytes of {}", meta.size),
            read,
        ));
    }
    let got = hex(&hasher.finalize());
    verify::check(stated.as_ref(), &got).map_err(|expected| Failure::Corrupt {
        expected,
        got: got.clone(),
        read,
    })?;
    Ok(got)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
