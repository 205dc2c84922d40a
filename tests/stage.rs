//! `ringmaster stage` against Azurite (the real emulator, on loopback): what it copies,
//! what it refuses, and how it resumes.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use object_store::azure::MicrosoftAzureBuilder;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use ringmaster::stage::progress::Reporter;
use ringmaster::stage::{AuthMethod, ProgressMode, StageArgs, StageError, VerifyMode, copy};

#[path = "support/azurite.rs"]
mod azurite;
use azurite::Azurite;

const CONTAINER: &str = "datasets";

fn writer(azurite: &Azurite) -> Arc<dyn ObjectStore> {
    ringmaster::tls::install_provider();
    Arc::new(
        MicrosoftAzureBuilder::new()
            .with_account(azurite::ACCOUNT)
            .with_access_key(azurite::KEY)
            .with_container_name(CONTAINER)
            .with_endpoint(azurite.endpoint())
            .with_allow_http(true)
            .build()
            .unwrap(),
    )
}

fn create_container(azurite: &Azurite) {
    azurite.create_container(CONTAINER);
}

/// Azurite on a free port, with the container holding `files`.
async fn azurite_with(files: &BTreeMap<String, Vec<u8>>) -> Azurite {
    let azurite = Azurite::start();
    create_container(&azurite);
    upload(&writer(&azurite), files).await;
    azurite
}

/// Uploads `files` (name → bytes) in parallel.
async fn upload(store: &Arc<dyn ObjectStore>, files: &BTreeMap<String, Vec<u8>>) {
    futures::stream::iter(files.iter())
        .for_each_concurrent(32, |(name, data)| {
            let store = store.clone();
            async move {
                store
                    .put(
                        &ObjectPath::parse(name).unwrap(),
                        PutPayload::from(data.clone()),
                    )
                    .await
                    .unwrap_or_else(|e| panic!("upload {name}: {e}"));
            }
        })
        .await;
}

/// The dataset of the tests: 1,000 small files in nested folders, three multi-MiB files, a
/// zero-byte file and non-ASCII names under `ds/`, and one blob outside the prefix.
fn dataset() -> BTreeMap<String, Vec<u8>> {
    let mut files = BTreeMap::new();
    for i in 0..1000 {
        let data: Vec<u8> = (0..(100 + i * 7)).map(|b| (b * 31 + i) as u8).collect();
        files.insert(format!("ds/train/class-{:02}/img-{i:04}.bin", i % 10), data);
    }
    for i in 0..3 {
        let data: Vec<u8> = (0..(3 << 20) + i * 4099)
            .map(|b| (b % 251) as u8 ^ i as u8)
            .collect();
        files.insert(format!("ds/big/shard-{i}.bin"), data);
    }
    files.insert("ds/empty.txt".into(), Vec::new());
    files.insert("ds/ünïcødé/файл-数据 (1).txt".into(), b"non-ascii".to_vec());
    files.insert("ds/a/b/c/d/deep.txt".into(), b"deep".to_vec());
    files.insert("outside/not-me.txt".into(), b"no".to_vec());
    files
}

/// `ringmaster stage` from the test container's `ds/` prefix into `destination`, no progress.
fn stage_command(azurite: &Azurite, destination: &Path) -> std::process::Command {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_ringmaster"));
    command
        .args([
            "stage",
            "--account",
            azurite::ACCOUNT,
            "--container",
            CONTAINER,
        ])
        .args(["--prefix", "ds/", "--endpoint", &azurite.endpoint()])
        .args(["--progress", "none"])
        .arg("--destination")
        .arg(destination);
    command
}

fn args(azurite: &Azurite, destination: &Path) -> StageArgs {
    StageArgs {
        account: azurite::ACCOUNT.into(),
        container: CONTAINER.into(),
        prefix: "ds/".into(),
        endpoint: Some(azurite.endpoint()),
        destination: destination.to_path_buf(),
        parallelism: 16,
        verify: VerifyMode::Md5,
        auth: AuthMethod::SasToken,
        report_to: None,
        progress: ProgressMode::None,
        progress_interval: 1.0,
        attempts: 3,
        mirror: false,
        termination_message: None,
        print_settings: false,
    }
}

/// Stages with a SAS token or account key given directly (the CLI reads them from the
/// environment; tests run in parallel threads, so they do not touch it).
async fn stage(
    args: &StageArgs,
    sas: Option<&str>,
    key: Option<&str>,
) -> Result<ringmaster::stage::Summary, StageError> {
    ringmaster::tls::install_provider();
    let mut builder = MicrosoftAzureBuilder::new()
        .with_account(&args.account)
        .with_container_name(&args.container)
        .with_endpoint(args.endpoint.clone().unwrap())
        .with_allow_http(true)
        .with_http_connector(ringmaster::stage::verify::Md5Connector)
        .with_retry(object_store::RetryConfig {
            max_retries: 1,
            ..Default::default()
        });
    if let Some(sas) = sas {
        builder = builder.with_config(object_store::azure::AzureConfigKey::SasKey, sas);
    }
    if let Some(key) = key {
        builder = builder.with_access_key(key);
    }
    copy(Arc::new(builder.build().unwrap()), args, &Reporter::Log).await
}

fn assert_tree_matches(destination: &Path, files: &BTreeMap<String, Vec<u8>>) {
    let mut expected = 0;
    for (name, data) in files {
        let local = destination.join(name.strip_prefix("ds/").unwrap_or(name));
        if name.starts_with("ds/") {
            expected += 1;
            let got = std::fs::read(&local).unwrap_or_else(|e| {
                let near = std::fs::read_dir(local.parent().unwrap().parent().unwrap())
                    .map(|d| d.map(|e| e.unwrap().file_name()).collect::<Vec<_>>());
                panic!("{}: {e}; beside it: {near:?}", local.display())
            });
            assert!(got == *data, "{name} differs");
        } else {
            assert!(
                !local.exists(),
                "{name} is outside the prefix but was copied"
            );
        }
    }
    let on_disk = walk(destination);
    assert_eq!(
        on_disk, expected,
        "files under the destination (bookkeeping excluded)"
    );
}

fn walk(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name() != ".ringmaster-stage")
        .map(|e| {
            if e.file_type().unwrap().is_dir() {
                walk(&e.path())
            } else {
                1
            }
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_a_prefix_with_a_sas_token_then_skips_and_repairs() {
    let files = dataset();
    let azurite = azurite_with(&files).await;
    let dest = tempfile::tempdir().unwrap();
    let args = args(&azurite, dest.path());
    let sas = azurite::container_sas(azurite::KEY, CONTAINER, "rl");

    let first = stage(&args, Some(&sas), None).await.expect("first copy");
    let in_prefix = files.keys().filter(|n| n.starts_with("ds/")).count() as u64;
    assert_eq!(first.files, in_prefix);
    assert_eq!(first.downloaded_files, in_prefix);
    assert_eq!(first.skipped_files, 0);
    assert_tree_matches(dest.path(), &files);
    let manifest =
        std::fs::read_to_string(dest.path().join(".ringmaster-stage/manifest.jsonl")).unwrap();
    assert_eq!(manifest.lines().count() as u64, in_prefix);
    assert!(!dest.path().join(".ringmaster-stage/tmp").exists());

    let second = stage(&args, Some(&sas), None).await.unwrap();
    assert_eq!(
        (second.downloaded_files, second.skipped_files),
        (0, in_prefix)
    );

    // Same size, other content: MD5 verification catches it; a deleted file comes back.
    let corrupt = dest.path().join("big/shard-1.bin");
    let mut data = std::fs::read(&corrupt).unwrap();
    data[12345] ^= 0xff;
    std::fs::write(&corrupt, data).unwrap();
    std::fs::remove_file(dest.path().join("train/class-03/img-0013.bin")).unwrap();
    let third = stage(&args, Some(&sas), None).await.unwrap();
    assert_eq!(third.downloaded_files, 2);
    assert_tree_matches(dest.path(), &files);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_key_or_token_is_a_clear_error_and_copies_nothing() {
    let azurite = azurite_with(&dataset()).await;
    let dest = tempfile::tempdir().unwrap();
    let args = args(&azurite, dest.path());
    let wrong_key = "d3Jvbmcta2V5LXdyb25nLWtleS13cm9uZy1rZXktd3Jvbmcta2V5LXdyb25nLWtleQ==";
    let forged = azurite::container_sas(wrong_key, CONTAINER, "rl");
    for (sas, key) in [(None, Some(wrong_key)), (Some(forged.as_str()), None)] {
        let err = stage(&args, sas, key).await.unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, StageError::List { .. }), "{text}");
        assert!(text.contains("credential was refused"), "{text}");
        assert!(
            !text.contains(wrong_key) && !text.contains("sig="),
            "secret in: {text}"
        );
        assert_eq!(walk(dest.path()), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_named_dot_dot_is_refused_before_anything_is_copied() {
    let azurite = azurite_with(&dataset()).await;
    // `../x` cannot be written through object_store (it escapes `..`): a raw request, with
    // the dots percent-encoded so no client normalises them away.
    let status = azurite.put_blob(CONTAINER, "ds/%2E%2E/%2E%2E/x", b"x");
    assert_eq!(status, 201, "Azurite took the blob");
    let dest = tempfile::tempdir().unwrap();
    let args = args(&azurite, dest.path());
    let read_sas = azurite::container_sas(azurite::KEY, CONTAINER, "rl");
    let err = stage(&args, Some(&read_sas), None).await.unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, StageError::UnsafeNames { .. }), "{text}");
    assert!(text.contains(".."), "{text}");
    assert_eq!(walk(dest.path()), 0);
    assert!(!dest.path().parent().unwrap().join("x").exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_mid_copy_the_rerun_copies_only_the_rest() {
    let files = dataset();
    let azurite = azurite_with(&files).await;
    let dest = tempfile::tempdir().unwrap();
    let sas = azurite::container_sas(azurite::KEY, CONTAINER, "rl");
    let manifest = dest.path().join(".ringmaster-stage/manifest.jsonl");

    let mut child = stage_command(&azurite, dest.path())
        .args(["--parallelism", "2"])
        .env("AZURE_STORAGE_SAS_TOKEN", &sas)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let done = std::fs::read_to_string(&manifest).map_or(0, |m| m.lines().count());
        if done >= 100 {
            break;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "stager ended before it was killed"
        );
        assert!(Instant::now() < deadline, "stager made no progress");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let recorded = std::fs::read_to_string(&manifest).unwrap().lines().count() as u64;

    let args = args(&azurite, dest.path());
    let rerun = stage(&args, Some(&sas), None).await.unwrap();
    // Every file the killed run finished and recorded is skipped (the last line may be torn).
    assert!(
        rerun.skipped_files >= recorded - 1,
        "{rerun:?}, {recorded} recorded"
    );
    assert_eq!(rerun.skipped_files + rerun.downloaded_files, rerun.files);
    assert!(rerun.downloaded_files < rerun.files);
    assert_tree_matches(dest.path(), &files);
}

/// `--termination-message` gets the stager's outcome: the error when it fails (no secret in
/// it), the summary when it succeeds; the DataStage controller reads it with `Outcome::parse`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_termination_message_holds_the_outcome() {
    use ringmaster::stage::Outcome;
    let mut files = BTreeMap::new();
    files.insert("ds/a.txt".to_string(), b"alpha".to_vec());
    files.insert("ds/b/c.txt".to_string(), b"gamma".to_vec());
    let azurite = azurite_with(&files).await;
    let dest = tempfile::tempdir().unwrap();
    let message = dest.path().join("termination-log");
    let run = |sas: &str| {
        stage_command(&azurite, &dest.path().join("copy"))
            .arg("--termination-message")
            .arg(&message)
            .env("AZURE_STORAGE_SAS_TOKEN", sas)
            .output()
            .unwrap()
    };
    let wrong_key = "d3Jvbmcta2V5LXdyb25nLWtleS13cm9uZy1rZXktd3Jvbmcta2V5LXdyb25nLWtleQ==";
    let forged = azurite::container_sas(wrong_key, CONTAINER, "rl");
    let out = run(&forged);
    assert!(!out.status.success());
    let text = std::fs::read_to_string(&message).unwrap();
    match Outcome::parse(&text) {
        Some(Outcome::Failed { error }) => {
            assert!(error.contains("credential was refused"), "{error}");
            assert!(!text.contains("sig="), "secret in: {text}");
        }
        other => panic!("expected a failure, got {other:?} from {text}"),
    }
    let sas = azurite::container_sas(azurite::KEY, CONTAINER, "rl");
    let out = run(&sas);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&message).unwrap();
    match Outcome::parse(&text) {
        Some(Outcome::Succeeded(summary)) => {
            assert_eq!((summary.files, summary.downloaded_files), (2, 2), "{text}")
        }
        other => panic!("expected a summary, got {other:?} from {text}"),
    }
}

/// Two stagers on one destination at once (a copy Job's replacement pod while the first
/// still runs behind a node partition, two DataStages of one folder): the second waits for
/// the first's lock and says so, neither deletes the other's partial files, both succeed,
/// and the tree is whole. Before the lock, the second removed the first's temporary folder
/// at start and the first failed renaming files that were gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stagers_on_one_destination_take_turns_and_the_tree_is_whole() {
    let files = dataset();
    let azurite = azurite_with(&files).await;
    let dest = tempfile::tempdir().unwrap();
    let sas = azurite::container_sas(azurite::KEY, CONTAINER, "rl");
    let manifest = dest.path().join(".ringmaster-stage/manifest.jsonl");
    let spawn = || {
        stage_command(&azurite, dest.path())
            .args(["--parallelism", "2"])
            .env("AZURE_STORAGE_SAS_TOKEN", &sas)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let first = spawn();
    // The second comes while the first is copying.
    let deadline = Instant::now() + Duration::from_secs(120);
    while std::fs::read_to_string(&manifest).map_or(0, |m| m.lines().count()) < 20 {
        assert!(
            Instant::now() < deadline,
            "the first stager made no progress"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let second = spawn();
    let (first, second) = (
        first.wait_with_output().unwrap(),
        second.wait_with_output().unwrap(),
    );
    let said = |o: &std::process::Output| String::from_utf8_lossy(&o.stderr).to_string();
    assert!(first.status.success(), "first: {}", said(&first));
    assert!(second.status.success(), "second: {}", said(&second));
    assert!(
        said(&second).contains("another stager is writing"),
        "the second waited and said so: {}",
        said(&second)
    );
    assert_tree_matches(dest.path(), &files);
    assert!(!dest.path().join(".ringmaster-stage/tmp").exists());
}

/// The manifest's entries by path: (ETag, MD5).
fn manifest_entries(destination: &Path) -> BTreeMap<String, (Option<String>, String)> {
    let text =
        std::fs::read_to_string(destination.join(".ringmaster-stage/manifest.jsonl")).unwrap();
    text.lines()
        .map(|line| {
            let entry: ringmaster::stage::manifest::Entry = serde_json::from_str(line).unwrap();
            (entry.path, (entry.etag, entry.md5))
        })
        .collect()
}

fn md5_hex(data: &[u8]) -> String {
    use md5::{Digest, Md5};
    Md5::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// SIGKILL between write and rename: the stager is held (a test-only hook) once a file is
/// written and fsynced and before its rename, and killed there. Nothing sits under the
/// file's real name, and the rerun leaves the tree whole, every file as its blob and recorded
/// with its MD5, and no temporary file behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_between_write_and_rename_no_partial_file_and_the_rerun_is_whole() {
    let files = dataset();
    let azurite = azurite_with(&files).await;
    let dest = tempfile::tempdir().unwrap();
    let sas = azurite::container_sas(azurite::KEY, CONTAINER, "rl");
    let marker = dest.path().with_extension("held");
    let mut child = stage_command(&azurite, dest.path())
        .args(["--parallelism", "4"])
        .env("AZURE_STORAGE_SAS_TOKEN", &sas)
        .env(
            ringmaster::stage::env::TEST_HOLD_BEFORE_RENAME,
            marker.as_os_str(),
        )
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !marker.exists() {
        if child.try_wait().unwrap().is_some() {
            let out = child.wait_with_output().unwrap();
            panic!(
                "stager ended ({}) before it held a file: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        assert!(Instant::now() < deadline, "stager held no file");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(100));
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    // The held file is whole in its temporary folder, and not under any real name.
    let held = std::path::PathBuf::from(std::fs::read_to_string(&marker).unwrap());
    assert!(
        held.starts_with(dest.path().join(".ringmaster-stage/tmp")),
        "{held:?}"
    );
    assert!(held.exists(), "the written file waits in {held:?}");
    assert!(
        manifest_entries(dest.path()).len() < files.len() - 1,
        "killed mid-copy"
    );
    for (name, data) in &files {
        let local = dest.path().join(name.strip_prefix("ds/").unwrap_or(name));
        if let Ok(got) = std::fs::read(&local) {
            assert!(got == *data, "{name}: a file under its real name is whole");
        }
    }

    let rerun = stage(&args(&azurite, dest.path()), Some(&sas), None)
        .await
        .unwrap();
    assert!(rerun.downloaded_files > 0, "{rerun:?}");
    assert_tree_matches(dest.path(), &files);
    assert!(!dest.path().join(".ringmaster-stage/tmp").exists());
    let entries = manifest_entries(dest.path());
    for (name, data) in files.iter().filter(|(n, _)| n.starts_with("ds/")) {
        let key = name.strip_prefix("ds/").unwrap();
        assert_eq!(entries[key].1, md5_hex(data), "{key}");
    }
}

/// A blob overwritten after the listing, before its download: the GET pinned to the listed
/// ETag is refused, the blob is looked up again and fetched whole at its new version, and
/// the manifest records that version's ETag. Before the pin the new bytes were recorded
/// under the old ETag (and a new size failed the copy).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_overwritten_after_listing_is_copied_whole_at_its_new_version() {
    let azurite = Azurite::start();
    create_container(&azurite);
    let mut files = BTreeMap::new();
    for i in 0..1000 {
        files.insert(format!("ds/a/{i:04}.bin"), vec![i as u8; 500]);
    }
    let old: Vec<u8> = (0..(4 << 20)).map(|b| (b % 251) as u8).collect();
    let new: Vec<u8> = (0..(4 << 20)).map(|b| (b % 241) as u8 ^ 0x5a).collect();
    files.insert("ds/z-big.bin".into(), old.clone());
    let store = writer(&azurite);
    upload(&store, &files).await;
    let dest = tempfile::tempdir().unwrap();
    let sas = azurite::container_sas(azurite::KEY, CONTAINER, "rl");
    let manifest = dest.path().join(".ringmaster-stage/manifest.jsonl");
    // One download at a time, in name order: the big blob comes last.
    let child = stage_command(&azurite, dest.path())
        .args(["--parallelism", "1"])
        .env("AZURE_STORAGE_SAS_TOKEN", &sas)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    // Listed once the first file is recorded: overwrite the big blob now, same size.
    while std::fs::read_to_string(&manifest).map_or(0, |m| m.lines().count()) < 1 {
        assert!(Instant::now() < deadline, "the stager made no progress");
        std::thread::sleep(Duration::from_millis(5));
    }
    let big = ObjectPath::parse("ds/z-big.bin").unwrap();
    store
        .put(&big, PutPayload::from(new.clone()))
        .await
        .unwrap();
    let recorded_before = std::fs::read_to_string(&manifest).unwrap().lines().count();
    // Well before the big blob's turn (its GET, were it under way during the overwrite, could
    // rightly return the old version whole).
    assert!(
        recorded_before < 900,
        "the overwrite came late ({recorded_before} files done): too slow a machine"
    );
    let out = child.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{}: {said}", out.status);
    assert!(
        said.contains("was overwritten after it was listed"),
        "{said}"
    );
    let got = std::fs::read(dest.path().join("z-big.bin")).unwrap();
    assert!(got == new, "the file is the new version, whole");
    let now = store.head(&big).await.unwrap();
    assert_eq!(
        manifest_entries(dest.path())["z-big.bin"],
        (now.e_tag, md5_hex(&new)),
        "the manifest records the version written"
    );
}

/// A blob whose stated Content-MD5 is not its bytes' (set with Set Blob Properties, which
/// checks nothing): each download is refused, and the copy fails naming the blob and what to
/// do; nothing is written under its name, and the other files are copied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_content_md5_mismatch_fails_the_copy_naming_the_blob() {
    let mut files = BTreeMap::new();
    files.insert("ds/good.txt".to_string(), b"good".to_vec());
    files.insert("ds/bad/liar.bin".to_string(), vec![7u8; 100_000]);
    let azurite = azurite_with(&files).await;
    // MD5("hello"), not of 100,000 sevens.
    let status = azurite.set_content_md5(CONTAINER, "ds/bad/liar.bin", "XUFAKrxLKna5cZ2REBfFkg==");
    assert_eq!(status, 200, "Azurite set the property");
    let dest = tempfile::tempdir().unwrap();
    let mut args = args(&azurite, dest.path());
    args.attempts = 2;
    let sas = azurite::container_sas(azurite::KEY, CONTAINER, "rl");
    let err = stage(&args, Some(&sas), None).await.unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, StageError::ContentMismatch { attempts: 2, .. }),
        "{text}"
    );
    assert!(
        text.contains("ds/bad/liar.bin")
            && text.contains("5d41402abc4b2a76b9719d911017c592")
            && text.contains(&md5_hex(&[7u8; 100_000])),
        "{text}"
    );
    assert!(!dest.path().join("bad/liar.bin").exists());
    // A blob whose stated MD5 is right passes the same check (Azurite states one for each
    // upload).
    assert_eq!(
        std::fs::read(dest.path().join("good.txt")).unwrap(),
        b"good"
    );
}

/// Mirror mode: after a complete copy, the files copied earlier whose blobs are gone are
/// deleted (and the folders they leave empty), with their manifest entries; a file the
/// stager did not copy stays. Off (the default), they all stay, still on record.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mirror_mode_deletes_exactly_the_files_whose_blobs_are_gone() {
    let azurite = Azurite::start();
    create_container(&azurite);
    let mut files = BTreeMap::new();
    for name in ["a.txt", "keep/b.txt", "gone/c.txt", "keep/d.txt", "e.txt"] {
        files.insert(format!("ds/{name}"), name.as_bytes().to_vec());
    }
    let store = writer(&azurite);
    upload(&store, &files).await;
    let dest = tempfile::tempdir().unwrap();
    let mut args = args(&azurite, dest.path());
    let sas = azurite::container_sas(azurite::KEY, CONTAINER, "rl");
    stage(&args, Some(&sas), None).await.unwrap();
    std::fs::write(dest.path().join("notes-of-mine.txt"), b"mine").unwrap();
    for gone in ["ds/gone/c.txt", "ds/keep/d.txt"] {
        store
            .delete(&ObjectPath::parse(gone).unwrap())
            .await
            .unwrap();
        files.remove(gone);
    }

    let kept = stage(&args, Some(&sas), None).await.unwrap();
    assert_eq!(kept.deleted_files, 0);
    assert!(dest.path().join("gone/c.txt").exists() && dest.path().join("keep/d.txt").exists());
    assert!(manifest_entries(dest.path()).contains_key("gone/c.txt"));

    args.mirror = true;
    let mirrored = stage(&args, Some(&sas), None).await.unwrap();
    assert_eq!(mirrored.deleted_files, 2, "{mirrored:?}");
    assert!(
        !dest.path().join("gone").exists(),
        "its empty folder goes too"
    );
    assert!(!dest.path().join("keep/d.txt").exists());
    assert!(dest.path().join("keep/b.txt").exists());
    assert!(
        dest.path().join("notes-of-mine.txt").exists(),
        "not the stager's"
    );
    let entries = manifest_entries(dest.path());
    assert_eq!(
        entries.keys().collect::<Vec<_>>(),
        ["a.txt", "e.txt", "keep/b.txt"]
    );
    std::fs::remove_file(dest.path().join("notes-of-mine.txt")).unwrap();
    assert_tree_matches(dest.path(), &files);
}
