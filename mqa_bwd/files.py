"""Files written atomically: a reader (or a crash) never sees half of one.

The bytes go to a hidden temporary file in the target's directory, which is
flushed and fsynced before ``os.replace`` renames it over the target (and the
directory is fsynced after). The harness, the tools and the captures share
it: the standard library at import, safetensors only inside the two tensor
file functions (``save_tensors``, ``load_tensors``).
"""

import json
import os
import secrets
from pathlib import Path


def _fsync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some filesystems do not open directories; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path, write, *, durable: bool = True) -> Path:
    """Run ``write(temporary_path)``, then rename the result over ``path``.

    ``durable`` fsyncs the file and its directory, so the capture survives a
    power loss too; a process crash loses nothing either way, which is why the
    fuzzer's in-flight records skip it.
    """
    path = Path(path)
    directory = path.parent if str(path.parent) else Path(".")
    if not directory.is_dir():
        raise ValueError(f"path: directory {str(directory)!r} does not exist")
    temporary = directory / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.partial"
    try:
        # Created here first to learn the mode the caller's umask gives a new file; the writer may
        # replace the file with one of its own (safetensors makes it 0600), so that mode is put back.
        os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        mode = os.stat(temporary).st_mode & 0o777
        write(temporary)
        os.chmod(temporary, mode)
        if durable:
            fd = os.open(temporary, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(temporary, path)
    except BaseException:
        # Interrupted or failed: the target is untouched; do not leave the half file behind.
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
    if durable:
        _fsync_directory(directory)
    return path


def write_json_atomic(path, data, *, durable: bool = False) -> Path:
    """``data`` as indented, key-sorted JSON at ``path``, atomically."""
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    return write_atomic(path, lambda tmp: Path(tmp).write_text(text), durable=durable)


def save_tensors(path, tensors: dict, metadata: dict, *, durable: bool = True) -> Path:
    """torch tensors by name, with text ``metadata``, as a safetensors file at ``path``, atomically.

    The bytes are kept exactly (bf16 stays bf16); what the metadata says is the caller's format.
    """
    import safetensors.torch

    return write_atomic(path, lambda tmp: safetensors.torch.save_file(tensors, str(tmp), metadata=metadata),
                        durable=durable)


def load_tensors(path, what: str) -> tuple:
    """(tensors by name, metadata) of a safetensors file; a ValueError that begins with ``what``
    when the file cannot be read or is not a complete safetensors file. The file is memory-mapped:
    each tensor is copied once, not the whole file first."""
    import safetensors

    path = Path(path)
    try:
        with path.open("rb"):  # unreadable (missing, a directory, no permission) before malformed
            pass
    except OSError as e:
        raise ValueError(f"{what}: cannot read ({e.strerror or e})") from None
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (safetensors.SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{what}: not a complete safetensors file ({e})") from None
    return tensors, metadata
