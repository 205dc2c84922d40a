#!/usr/bin/env python3
"""Stager throughput from Azurite to local disk next to azcopy and the official Python SDK.

Runs Azurite (the npm emulator, on loopback), uploads 1,000 x 1 MiB and 4 x 256 MiB blobs,
then copies each set to a fresh local folder with each tool in turn, in one run:
  - `ringmaster stage` (16 transfers at once), with a read+list SAS for the container;
  - azcopy (built from its Go module by e2e/tools/peers.sh), `azcopy copy --recursive` with
    the same SAS and its own defaults, as users run it;
  - azure-storage-blob's parallel `download_blob` (a thread pool of the same width, each blob
    downloaded with max_concurrency=4 as its docs suggest for large blobs).
Prints seconds and MiB/s.

Usage: stage-vs-sdk.py RINGMASTER_BINARY AZURITE_BLOB_SCRIPT [--azcopy AZCOPY] [--small N] [--large N]
"""
import argparse
import concurrent.futures
import datetime
import os
import shutil
import socket
import subprocess
import tempfile
import time

from azure.storage.blob import BlobServiceClient, ContainerSasPermissions, generate_container_sas

ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
CONTAINER = "bench"
PARALLELISM = 16


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port):
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit("Azurite did not start")


def upload(container, prefix, count, size):
    block = os.urandom(size)

    def put(i):
        container.upload_blob(f"{prefix}/blob-{i:05d}.bin", block, overwrite=True, max_concurrency=4)

    with concurrent.futures.ThreadPoolExecutor(PARALLELISM) as pool:
        list(pool.map(put, range(count)))


def tree_size(folder):
    """Bytes of the copied files (not the tools' own bookkeeping, such as the stager's manifest)."""
    total = 0
    for d, dirs, fs in os.walk(folder):
        dirs[:] = [x for x in dirs if not x.startswith(".")]
        total += sum(os.path.getsize(os.path.join(d, f)) for f in fs)
    return total


def sdk_download(container, prefix, dest):
    names = [b.name for b in container.list_blobs(name_starts_with=prefix + "/")]

    def get(name):
        path = os.path.join(dest, name[len(prefix) + 1:])
        with open(path, "wb") as f:
            container.download_blob(name, max_concurrency=4).readinto(f)
        return os.path.getsize(path)

    with concurrent.futures.ThreadPoolExecutor(PARALLELISM) as pool:
        return sum(pool.map(get, names))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("ringmaster")
    parser.add_argument("azurite")
    parser.add_argument("--azcopy", help="azcopy binary (e2e/tools/peers.sh azcopy)")
    parser.add_argument("--small", type=int, default=1000)
    parser.add_argument("--large", type=int, default=4)
    args = parser.parse_args()

    work = tempfile.mkdtemp(prefix="ringmaster-bench-")
    port = free_port()
    azurite = subprocess.Popen(
        [args.azurite, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--silent",
         "--skipApiVersionCheck", "--loose", "--location", os.path.join(work, "azurite")],
        stdout=subprocess.DEVNULL)
    try:
        wait_port(port)
        endpoint = f"http://127.0.0.1:{port}/{ACCOUNT}"
        service = BlobServiceClient(account_url=endpoint, credential={"account_name": ACCOUNT, "account_key": KEY})
        container = service.create_container(CONTAINER)
        sets = [("small", args.small, 1 << 20), ("large", args.large, 256 << 20)]
        t = time.time()
        for prefix, count, size in sets:
            upload(container, prefix, count, size)
        print(f"# uploaded in {time.time() - t:.1f} s")
        sas = generate_container_sas(ACCOUNT, CONTAINER, account_key=KEY,
                                     permission=ContainerSasPermissions(read=True, list=True),
                                     expiry=datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=2))
        tools = ["ringmaster stage"] + (["azcopy"] if args.azcopy else []) + ["python azure-storage-blob"]
        print(f"# {'set':<22} {'tool':<28} {'seconds':>8} {'MiB/s':>8}")
        for prefix, count, size in sets:
            label = f"{count} x {size >> 20} MiB"
            for tool in tools:
                dest = os.path.join(work, "out")
                shutil.rmtree(dest, ignore_errors=True)
                os.makedirs(dest)
                subprocess.run(["sync"], check=True)
                t = time.time()
                if tool == "ringmaster stage":
                    env = dict(os.environ, AZURE_STORAGE_SAS_TOKEN=sas)
                    subprocess.run(
                        [args.ringmaster, "stage", "--account", ACCOUNT, "--container", CONTAINER,
                         "--prefix", prefix + "/", "--endpoint", endpoint, "--destination", dest,
                         "--parallelism", str(PARALLELISM), "--progress", "none"],
                        env=env, check=True, stdout=subprocess.DEVNULL)
                    total = tree_size(dest)
                elif tool == "azcopy":
                    state = os.path.join(work, "azcopy-state")
                    env = dict(os.environ, AZCOPY_LOG_LOCATION=state, AZCOPY_JOB_PLAN_LOCATION=state,
                               AZCOPY_DISABLE_SYSLOG="true")
                    subprocess.run(
                        [args.azcopy, "copy", f"{endpoint}/{CONTAINER}/{prefix}/*?{sas}", dest,
                         "--from-to", "BlobLocal", "--recursive", "--log-level", "ERROR",
                         "--output-level", "essential"],
                        env=env, check=True, stdout=subprocess.DEVNULL)
                    total = tree_size(dest)
                else:
                    total = sdk_download(container, prefix, dest)
                seconds = time.time() - t
                assert total == count * size, (tool, total)
                print(f"  {label:<22} {tool:<28} {seconds:8.2f} {total / seconds / (1 << 20):8.1f}")
    finally:
        azurite.terminate()
        azurite.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
