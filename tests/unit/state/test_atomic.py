"""Atomic writes: the new file or the old one, and no partial temp file left by a failed write."""

import errno
import subprocess
import sys
import textwrap
from pathlib import Path

from framework.state import atomic


def test_write_replaces_the_file_whole(tmp_path):
    path = tmp_path / "sub" / "f.bin"
    atomic.write_bytes(path, b"old")
    atomic.write_bytes(path, b"new contents")
    assert path.read_bytes() == b"new contents"
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.bin"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temp_file(tmp_path):
    # A real write failure: the file-size limit (EFBIG) in a child process, as a full disk would fail it.
    script = textwrap.dedent(f"""
        import errno, resource, signal, sys
        from pathlib import Path
        from framework.state import atomic
        path = Path({str(tmp_path / "f.bin")!r})
        atomic.write_bytes(path, b"old")
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
        try:
            atomic.write_bytes(path, b"x" * 5000)
        except OSError as err:
            sys.exit(0 if err.errno == errno.EFBIG else 3)
        sys.exit(4)
    """)
    from pathlib import Path
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "f.bin").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_a_symlink_planted_at_a_temp_name_or_the_final_name_does_not_redirect_the_write(tmp_path):
    import os
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    directory = tmp_path / "shared"
    directory.mkdir()
    for name in ("f.bin", "g.pt"):
        # The names a write used to take: .NAME.tmp.PID, and the final name itself.
        (directory / f".{name}.tmp.{os.getpid()}").symlink_to(victim)
    (directory / "f.bin").symlink_to(victim)
    atomic.write_bytes(directory / "f.bin", b"new contents")
    assert victim.read_bytes() == b"precious"
    digest, size = atomic.torch_save({"w": __import__("torch").ones(3)}, directory / "g.pt")
    assert victim.read_bytes() == b"precious"
    assert (directory / "f.bin").read_bytes() == b"new contents" and not (directory / "f.bin").is_symlink()
    assert not (directory / "g.pt").is_symlink() and (directory / "g.pt").stat().st_size == size
    import hashlib
    assert hashlib.sha256((directory / "g.pt").read_bytes()).hexdigest() == digest
    # Every file written here is a regular file with the usual permissions (not mkstemp's 0600).
    umask = os.umask(0)
    os.umask(umask)
    assert (directory / "f.bin").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_full_disk_during_a_streamed_torch_save_raises_its_oserror(tmp_path):
    """torch.save's zip writer turns a failed write into "RuntimeError: unexpected pos"; the
    checkpoint writer must still see the OSError (EFBIG here, ENOSPC on a full disk), which is what
    makes a full disk a clean FATAL stop instead of a crash that leaves the other ranks waiting."""
    script = f"""
import resource, signal, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[3])!r})
import torch
from framework.state import atomic
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
try:
    atomic.torch_save({{"w": torch.zeros(100_000)}}, {str(tmp_path / "x.pt")!r})
except BaseException as err:
    print(type(err).__name__, getattr(err, "errno", None))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["OSError", str(errno.EFBIG)], out.stdout + out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # the partial temp file is gone
