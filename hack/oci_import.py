#!/usr/bin/env python3
"""Load one image from an OCI layout directory into containerd, sending only what it lacks.

    hack/oci_import.py LAYOUT REF SOCKET

`ctr images import` takes a tar of an OCI layout. kvrail's image is 6.5 GB uncompressed and a
change to kvrail itself changes only its small top layers, so this streams to `ctr -n k8s.io
images import -` a layout holding the image's index entry, manifest and config, and only the
layers containerd's content store does not have yet; containerd unpacks it on top of the
snapshots it already has. Afterwards containerd forgets the repository's other tags, and the
layout keeps only the newest reference of each repository and the blobs those need (the scripts
that fill it name one tag per build).
Standard library only: it runs with the system python3.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path


def ctr(socket: str, *args: str) -> list[str]:
    out = subprocess.run(
        ["ctr", "-a", socket, "-n", "k8s.io", *args], check=True, capture_output=True
    )
    return out.stdout.decode().split()


def blob(layout: Path, digest: str) -> Path:
    algorithm, hex_digest = digest.split(":", 1)
    return layout / "blobs" / algorithm / hex_digest


def manifest_entry(layout: Path, ref: str) -> dict[str, object]:
    index = json.loads((layout / "index.json").read_text())
    for entry in index["manifests"]:
        if entry.get("annotations", {}).get("org.opencontainers.image.ref.name") == ref:
            return dict(entry)
    raise SystemExit(f"oci_import: {ref} is not in {layout}/index.json")


def import_image(layout: Path, ref: str, socket: str) -> int:
    """Stream the missing blobs; returns how many layer bytes were sent."""
    entry = manifest_entry(layout, ref)
    manifest = json.loads(blob(layout, str(entry["digest"])).read_text())
    have = set(ctr(socket, "content", "ls", "-q"))
    send = [str(entry["digest"]), manifest["config"]["digest"]]
    send += [layer["digest"] for layer in manifest["layers"] if layer["digest"] not in have]
    index = {"schemaVersion": 2, "manifests": [entry]}
    proc = subprocess.Popen(
        ["ctr", "-a", socket, "-n", "k8s.io", "images", "import", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
    )
    assert proc.stdin is not None
    sent = 0
    with tarfile.open(fileobj=proc.stdin, mode="w|") as tar:
        for name, data in (("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'),
                           ("index.json", json.dumps(index).encode())):  # fmt: skip
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for digest in dict.fromkeys(send):
            path = blob(layout, digest)
            tar.add(path, arcname=str(path.relative_to(layout)))
            sent += path.stat().st_size
    proc.stdin.close()
    if proc.wait() != 0:
        raise SystemExit(f"oci_import: ctr images import failed for {ref}")
    return sent


def prune(layout: Path) -> None:
    """Keep the last-added reference per repository and only the blobs they use."""
    index = json.loads((layout / "index.json").read_text())
    newest: dict[str, dict[str, object]] = {}
    for entry in index["manifests"]:
        ref = entry.get("annotations", {}).get("org.opencontainers.image.ref.name", "")
        newest[ref.rpartition(":")[0]] = entry
    index["manifests"] = list(newest.values())
    keep = {"index.json", "oci-layout"}
    for entry in index["manifests"]:
        manifest = json.loads(blob(layout, str(entry["digest"])).read_text())
        for digest in (entry["digest"], manifest["config"]["digest"],
                       *(layer["digest"] for layer in manifest["layers"])):  # fmt: skip
            keep.add(str(blob(layout, str(digest)).relative_to(layout)))
    (layout / "index.json").write_text(json.dumps(index))
    for path in (layout / "blobs").rglob("*"):
        if path.is_file() and str(path.relative_to(layout)) not in keep:
            path.unlink()


def targets(socket: str) -> dict[str, str]:
    """Every image reference in containerd and the manifest digest it points to."""
    out = subprocess.run(["ctr", "-a", socket, "-n", "k8s.io", "images", "ls"],
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    rows = [line.split() for line in out.splitlines()[1:] if line.strip()]
    return {row[0]: row[2] for row in rows}


def forget_older(socket: str, ref: str) -> None:
    """Remove the other tags of `ref`'s repository from containerd, then the references by ID
    (`sha256:<config>`, which the CRI plugin adds for every image it sees) of images no tag
    names any more, with their blobs and snapshots (`--sync`: collected before returning)."""
    repository = ref.rpartition(":")[0]
    old = [r for r in targets(socket) if r.rpartition(":")[0] == repository and r != ref]
    if old:
        ctr(socket, "images", "rm", "--sync", *old)
    refs = targets(socket)
    named = {digest for r, digest in refs.items() if not r.startswith("sha256:")}
    orphans = [r for r, digest in refs.items() if r.startswith("sha256:") and digest not in named]
    if orphans:
        ctr(socket, "images", "rm", "--sync", *orphans)


def main() -> None:
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    layout, ref, socket = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    sent = import_image(layout, ref, socket)
    print(f"oci_import: {ref} layer_bytes_sent={sent}", file=sys.stderr)
    forget_older(socket, ref)
    prune(layout)


if __name__ == "__main__":
    main()
