"""A store on a network file system is refused (SQLite's WAL needs one machine); a local one is not."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipekit_train.provenance import ArtifactStore, ArtifactStoreError, TrainingArtifact, _netfs
from pipekit_train.provenance._netfs import network_filesystem

MOUNTINFO = r"""22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 27 0:40 / /mnt/shared rw,relatime shared:20 - nfs4 fileserver:/export/team rw,vers=4.2
41 40 0:41 / /mnt/shared/scratch rw,relatime - tmpfs tmpfs rw,size=1024k
42 27 0:42 / /home/me/remote\040box rw,nosuid - fuse.sshfs me@box:/data rw,user_id=0
43 27 0:43 / /data/cifs rw - cifs //nas/share rw
44 27 0:44 / /lustre rw - lustre 10.0.0.1@tcp:/fs rw
45 27 8:2 / /data rw - xfs /dev/sdb1 rw
garbage line without the separator
"""


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/mnt/shared/runs/artifacts.sqlite", "nfs4 (fileserver:/export/team at /mnt/shared)"),
        ("/mnt/shared", "nfs4 (fileserver:/export/team at /mnt/shared)"),
        ("/mnt/shared/scratch/a.sqlite", None),  # a local tmpfs mounted inside the NFS export
        ("/mnt/sharedother/a.sqlite", None),  # a prefix of the name is not a parent
        ("/home/me/remote box/runs/a.sqlite", "fuse.sshfs (me@box:/data at /home/me/remote box)"),
        ("/data/cifs/a.sqlite", "cifs (//nas/share at /data/cifs)"),
        ("/lustre/x/y.sqlite", "lustre (10.0.0.1@tcp:/fs at /lustre)"),
        ("/data/runs/a.sqlite", None),
        ("/home/me/runs/a.sqlite", None),
    ],
)
def test_network_filesystem_reads_the_mount_the_path_is_on(path: str, expected: str | None):
    assert network_filesystem(path, MOUNTINFO) == expected


def test_the_test_directory_is_local_and_a_store_there_opens(tmp_path: Path):
    assert network_filesystem(tmp_path / "not-yet" / "a.sqlite") is None  # the real /proc/self/mountinfo
    store = ArtifactStore(tmp_path / "not-yet" / "a.sqlite")
    store.record(TrainingArtifact(run_id="r1", backend="equinox"))
    assert [a.run_id for a in store.query()] == ["r1"]


def test_a_store_on_a_network_mount_is_refused_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # The machine's own mount table, with the test folder declared an NFS mount (no NFS server is needed).
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(f"{Path('/proc/self/mountinfo').read_text()}99 27 0:99 / {tmp_path} rw - nfs4 srv:/x rw\n")
    monkeypatch.setattr(_netfs, "_MOUNTINFO", str(mountinfo))
    path = tmp_path / "runs" / "a.sqlite"
    with pytest.raises(ArtifactStoreError, match=r"network file system, nfs4 \(srv:/x at .*WAL.*one machine") as e:
        ArtifactStore(path).record(TrainingArtifact(run_id="r1", backend="equinox"))
    assert "\n" not in str(e.value) and str(path) in str(e.value) and "PIPEKIT_ALLOW_NETWORK_STORE=1" in str(e.value)
    assert not path.exists()  # refused before SQLite created anything

    monkeypatch.setenv("PIPEKIT_ALLOW_NETWORK_STORE", "1")  # accepted explicitly: one machine only
    ArtifactStore(path).record(TrainingArtifact(run_id="r1", backend="equinox"))
    assert path.exists()
