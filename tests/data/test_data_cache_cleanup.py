"""The data cache's leftover cleanup removes only the temp folders its own builds make."""
import os
import socket
import subprocess
import sys

from data.prepare import _clean_stale


def test_cleanup_removes_only_its_own_dead_temp_folders(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()  # a pid that has exited
    host = socket.gethostname()
    ours_dead = tmp_path / f".tmp-0123456789abcdef-{host}-{dead}"
    ours_live = tmp_path / f".tmp-0123456789abcdef-{host}-{os.getpid()}"
    other_host = tmp_path / f".tmp-0123456789abcdef-elsewhere-{dead}"  # fresh: another host may be building
    foreign = [tmp_path / ".tmp-user-notes", tmp_path / f".tmp-{host}-{dead}"]  # not our pattern
    for folder in [ours_dead, ours_live, other_host, *foreign]:
        folder.mkdir()
        (folder / "x").write_text("x")
    for folder in foreign:  # old enough for the other-host rule: still not ours to remove
        os.utime(folder, (0, 0))
    _clean_stale(tmp_path)
    assert not ours_dead.exists()
    assert ours_live.exists() and other_host.exists() and all(f.exists() for f in foreign)
