"""Is a path on a network file system? (The artifact store refuses one: SQLite's WAL needs a single machine.)

SQLite in WAL mode shares its lock state through a memory-mapped ``-shm`` file beside the database; processes on two
machines that open the same file over NFS, SMB, sshfs, ... do not see each other's locks, and the database can be
corrupted. `network_filesystem` names the file system type when the path is on one, from ``/proc/self/mountinfo``
(Linux); elsewhere it answers ``None`` (nothing detected).
"""

from __future__ import annotations

import os

__all__ = ["ALLOW_ENV_VAR", "NETWORK_FS_TYPES", "network_filesystem"]

#: Set to ``1`` to open a store on a network file system anyway (one machine at a time, at your own risk).
ALLOW_ENV_VAR = "PIPEKIT_ALLOW_NETWORK_STORE"

#: File system types (as ``mountinfo`` names them) whose files can be shared between machines.
NETWORK_FS_TYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb",
        "smb2",
        "smb3",
        "smbfs",
        "ncpfs",
        "afs",
        "9p",
        "ceph",
        "fuse.ceph",
        "fuse.cephfs",
        "glusterfs",
        "fuse.glusterfs",
        "lustre",
        "gpfs",
        "beegfs",
        "fuse.sshfs",
        "sshfs",
        "fuse.s3fs",
        "fuse.gcsfuse",
        "fuse.rclone",
        "fuse.juicefs",
        "ocfs2",
        "gfs2",
        "davfs",
        "fuse.davfs",
        "virtiofs",
    }
)

_MOUNTINFO = "/proc/self/mountinfo"


def _unescape(field: str) -> str:
    """A mount point as mountinfo writes it (space, tab, newline and backslash as ``\\ooo`` octal escapes)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _mounts(mountinfo: str) -> list[tuple[str, str, str]]:
    """(mount point, file system type, source) for each well-formed line of a ``mountinfo`` text."""
    mounts = []
    for line in mountinfo.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or not rest:
            continue
        mounts.append((_unescape(fields[4]), rest[0], rest[1] if len(rest) > 1 else ""))
    return mounts


def network_filesystem(path: str | os.PathLike[str], mountinfo: str | None = None) -> str | None:
    """The network file system `path` lies on, as ``"nfs4 (server:/export at /mnt/shared)"``, or ``None``.

    Args:
        path: A file or folder; it need not exist yet (its nearest existing parent decides).
        mountinfo: The text of ``/proc/self/mountinfo`` (read when not given; ``None`` is returned where there is
            no such file, as on macOS and Windows).

    Example:
        >>> text = "36 1 0:40 / /mnt/shared rw - nfs4 server:/export rw\\n22 0 8:1 / / rw - ext4 /dev/sda1 rw\\n"
        >>> network_filesystem("/mnt/shared/runs/artifacts.sqlite", text)
        'nfs4 (server:/export at /mnt/shared)'
        >>> network_filesystem("/home/me/runs/artifacts.sqlite", text) is None
        True
    """
    if mountinfo is None:
        try:
            with open(_MOUNTINFO, encoding="utf-8", errors="surrogateescape") as f:
                mountinfo = f.read()
        except OSError:
            return None
    target, tail = os.path.abspath(os.fspath(path)), ""
    while not os.path.exists(target) and os.path.dirname(target) != target:  # links resolved where they exist
        target, tail = os.path.dirname(target), os.path.join(os.path.basename(target), tail)
    target = os.path.join(os.path.realpath(target), tail).rstrip("/") or "/"
    best: tuple[str, str, str] | None = None
    for point, fstype, source in _mounts(mountinfo):
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):  # the last of equal mount points is on top
            best = (point, fstype, source)
    if best is None:
        return None
    point, fstype, source = best
    if fstype.lower() not in NETWORK_FS_TYPES:
        return None
    return f"{fstype} ({source} at {point})"
