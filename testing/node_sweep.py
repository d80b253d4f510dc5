"""Leave nothing behind: the processes, mounts, cgroups and files a real node made.

A node's processes are the ones the harness started (stopped by their PIDs first), containerd's
shims (found by the containerd socket in their command line) and every process in the node's
cgroups (the pods' containers). Its mounts are all under its run folder or containerd's root. The
same sweep runs when a node stops and before the next one starts, so a run killed with -9 is
cleaned up by the next.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


def _mountinfo() -> list[tuple[str, str]]:
    """(mount point, filesystem type) of every mount, in mount order."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        point = fields[4].encode().decode("unicode_escape")  # \040 for a space, etc.
        out.append((point, fields[sep + 1]))
    return out


def cgroup_dirs(cgroup_root: str) -> list[Path]:
    """`cgroup_root` in every mounted cgroup hierarchy (v1 controllers and the v2 one)."""
    name = cgroup_root.strip("/")
    return [Path(p) / name for p, fstype in _mountinfo() if fstype in ("cgroup", "cgroup2")]


def cgroup_pids(cgroup_root: str) -> set[int]:
    pids: set[int] = set()
    for top in cgroup_dirs(cgroup_root):
        if not top.is_dir():
            continue
        for procs in top.rglob("cgroup.procs"):
            try:
                pids.update(int(p) for p in procs.read_text().split())
            except OSError:
                continue
    return pids


def shim_pids(containerd_socket: Path) -> set[int]:
    """containerd-shim processes of the containerd listening on `containerd_socket`."""
    needle = str(containerd_socket).encode()
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and b"containerd-shim" in argv[0] and needle in argv:
            pids.add(int(proc.name))
    return pids


def kill_all(pids: Iterable[int], what: str) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
            log.info("killed leftover pid=%d what=%s", pid, what)
        except ProcessLookupError:
            pass


def kill_node_processes(cgroup_root: str, containerd_socket: Path, timeout_s: float = 30) -> None:
    """SIGKILL every process in the node's cgroups and every shim, until none is left."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = cgroup_pids(cgroup_root) | shim_pids(containerd_socket)
        if not left:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"node processes survive SIGKILL: {sorted(left)}")
        kill_all(cgroup_pids(cgroup_root), "container")
        kill_all(shim_pids(containerd_socket), "containerd-shim")
        time.sleep(0.2)


def unmount_under(prefixes: Iterable[Path]) -> int:
    """Detach every mount at or below one of `prefixes`, deepest first; returns how many."""
    roots = [str(p.resolve()) for p in prefixes]
    points = [
        p
        for p, _ in _mountinfo()
        if any(p == r or p.startswith(r.rstrip("/") + "/") for r in roots)
    ]
    count = 0
    for point in sorted(set(points), key=lambda p: p.count("/"), reverse=True):
        while point in (p for p, _ in _mountinfo()):
            if _libc.umount2(point.encode(), MNT_DETACH) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"umount {point}: {os.strerror(err)}")
            count += 1
    return count


def remove_cgroups(cgroup_root: str) -> None:
    """rmdir the node's cgroup trees, leaves first (the processes must be gone)."""
    for top in cgroup_dirs(cgroup_root):
        if not top.is_dir():
            continue
        dirs = sorted((d for d in top.rglob("*") if d.is_dir()), key=lambda d: len(d.parts))
        for d in [*reversed(dirs), top]:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY while the kernel finishes a killed task
                    time.sleep(0.1)
            else:
                raise RuntimeError(f"cgroup {d} cannot be removed")


def remove_cni_results(network: str) -> None:
    """libcni's cache of results (always under /var/lib/cni) for the node's network."""
    for f in Path("/var/lib/cni/results").glob(f"{network}-*"):
        f.unlink(missing_ok=True)
