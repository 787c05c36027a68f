"""The Python a sandbox runs, as a directory tree (local jail) or as a docker image.

Both backends need the base interpreter (not the venv): the local jail bind-mounts it read-only,
and the docker image is built from it. When the sandbox drops to uid 65534 and the installation
is not readable by that uid (e.g. pyenv under /root, mode 0700), a stdlib-only tree of hard links
(copies across filesystems) is made once in a world-readable cache dir and used instead.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from functools import lru_cache

from .sandbox import SandboxError

# Parts of the stdlib dir a sandboxed program never needs (big, or needing libraries we do not ship).
SKIPPED_STDLIB = frozenset({"site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo",
                            "ensurepip", "lib2to3", "venv"})
CACHE_ROOT = "/var/tmp/rftgym-sandbox"


@dataclass(frozen=True)
class PythonRuntime:
    prefix: str        # sys.base_prefix (realpath)
    executable: str    # the base interpreter, inside prefix when possible
    stdlib: str        # the stdlib directory (os.py's)
    libdir: str | None  # where libpython lives, if shared

    @property
    def version(self) -> str:
        return f"{sys.version_info.major}.{sys.version_info.minor}"


@lru_cache(maxsize=1)
def base_python() -> PythonRuntime:
    prefix = os.path.realpath(sys.base_prefix)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [os.path.join(prefix, "bin", f"python{version}"), os.path.join(prefix, "bin", "python3"),
                  os.path.realpath(getattr(sys, "_base_executable", sys.executable))]
    executable = next((c for c in candidates if os.access(c, os.X_OK)), None)
    if executable is None:
        raise SandboxError(f"cannot find the base Python interpreter under {prefix}; "
                           "run rftgym from a normal CPython installation or virtual env")
    libdir = sysconfig.get_config_var("LIBDIR") if sysconfig.get_config_var("Py_ENABLE_SHARED") else None
    stdlib = os.path.dirname(os.path.realpath(os.__file__))
    return PythonRuntime(prefix, executable, stdlib, os.path.realpath(libdir) if libdir else None)


def readable_by_others(path: str) -> bool:
    """Whether every directory on the way to ``path`` lets 'other' users through."""
    path = os.path.realpath(path)
    while True:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            return False
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return False
        if path == "/":
            return True
        path = os.path.dirname(path)


def runtime_files(runtime: PythonRuntime):
    """(host path, path in the jail) of every file and symlink the sandboxed Python needs."""
    yield runtime.executable, runtime.executable
    if runtime.libdir:
        for name in os.listdir(runtime.libdir):
            if name.startswith("libpython"):
                path = os.path.join(runtime.libdir, name)
                if os.path.isfile(path) or os.path.islink(path):
                    yield path, path
    for top, dirs, files in os.walk(runtime.stdlib):
        if top == runtime.stdlib:
            dirs[:] = [d for d in dirs if d not in SKIPPED_STDLIB and not d.startswith("config-")]
        for name in files:
            path = os.path.join(top, name)
            yield path, path


def shared_libraries(paths) -> set[str]:
    """The shared libraries (and their symlink targets) that ``paths`` link, from ``ldd``."""
    paths = [p for p in paths if p.endswith(".so") or ".so." in p or os.access(p, os.X_OK)]
    found: set[str] = set()
    for start in range(0, len(paths), 64):
        out = subprocess.run(["ldd", *paths[start:start + 64]], check=False, capture_output=True, text=True).stdout
        for line in out.splitlines():
            words = line.split()
            for word in words:
                if word.startswith("/") and os.path.exists(word):
                    found.add(word)
                    found.add(os.path.realpath(word))
    return found


def runtime_tree() -> str:
    """A world-readable root holding a stdlib-only copy of the base Python at its own paths.

    Made once (hard links when on the same filesystem) and reused; the interpreter inside is
    ``tree + runtime.executable``."""
    runtime = base_python()
    key = hashlib.sha256(f"{runtime.executable}|{sys.version}".encode()).hexdigest()[:12]
    tree = os.path.join(CACHE_ROOT, f"python{runtime.version}-{key}")
    if _trusted_dir(tree) and os.path.exists(os.path.join(tree, "complete")):
        return tree
    os.makedirs(CACHE_ROOT, mode=0o755, exist_ok=True)
    if not _trusted_dir(CACHE_ROOT):
        raise SandboxError(f"{CACHE_ROOT} is not owned by this user or is writable by others; remove it and retry")
    os.chmod(CACHE_ROOT, 0o755)
    staging = tempfile.mkdtemp(prefix=".building-", dir=CACHE_ROOT)
    try:
        for host, jail in runtime_files(runtime):
            target = staging + jail
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.path.islink(host):
                os.symlink(os.readlink(host), target)
                continue
            try:
                os.link(host, target)
            except OSError:
                shutil.copy2(host, target)
        for top, dirs, _ in os.walk(staging):
            for d in dirs:
                os.chmod(os.path.join(top, d), 0o755)
        os.chmod(staging, 0o755)
        open(os.path.join(staging, "complete"), "w").close()
        try:
            os.rename(staging, tree)
        except OSError:   # another process made it first, or a stale incomplete one is there
            if not os.path.exists(os.path.join(tree, "complete")):
                shutil.rmtree(tree, ignore_errors=True)
                os.rename(staging, tree)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return tree


def _trusted_dir(path: str) -> bool:
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o022


# -- the docker image -------------------------------------------------------------------------
IMAGE_REPOSITORY = "rftgym-sandbox"
IMAGE_FORMAT = 2   # bump when the image's contents change
ETC_FILES = {"etc/passwd": b"root:x:0:0:root:/root:/nonexistent\nnobody:x:65534:65534:nobody:/work:/nonexistent\n",
             "etc/group": b"root:x:0:\nnogroup:x:65534:\n"}


def image_tag() -> str:
    runtime = base_python()
    key = hashlib.sha256(f"{IMAGE_FORMAT}|{runtime.executable}|{sys.version}".encode()).hexdigest()[:10]
    return f"{IMAGE_REPOSITORY}:py{'.'.join(map(str, sys.version_info[:3]))}-{key}"


def ensure_image(client) -> str:
    """The tag of the sandbox image in ``client``'s engine, built (once) when it is missing.

    No image can be pulled: it is ``docker import``-ed from a tarball of this host's base Python
    (interpreter, stdlib without tests/site-packages, the shared libraries they link)."""
    import docker

    tag = image_tag()
    try:
        client.images.get(tag)
        return tag
    except docker.errors.ImageNotFound:
        pass
    with tempfile.NamedTemporaryFile(suffix=".tar") as tar_file:
        write_rootfs_tar(tar_file)
        tar_file.flush()
        repository, version = tag.split(":")
        try:
            client.api.import_image_from_file(tar_file.name, repository=repository, tag=version)
            client.images.get(tag)
        except docker.errors.DockerException as exc:
            raise SandboxError(f"could not build the sandbox image {tag} ({exc}); check the docker engine "
                               "(docker info) and its free disk space") from exc
    return tag


def write_rootfs_tar(fileobj) -> None:
    import tarfile

    runtime = base_python()
    paths = [host for host, _ in runtime_files(runtime) if "_tkinter" not in host]
    added: set[str] = set()
    with tarfile.open(fileobj=fileobj, mode="w") as tar:
        for path in paths + sorted(shared_libraries(paths)):
            _add_path(tar, path, added)
        for name, data in ETC_FILES.items():
            _add_bytes(tar, name, data, 0o644)
        for name, mode in (("tmp", 0o1777), ("work", 0o1777), ("dev", 0o755), ("proc", 0o755)):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, mode
            tar.addfile(info)


def _add_path(tar, path: str, added: set[str]) -> None:
    """Add ``path`` with every ancestor (symlinked ancestors as links, with their targets)."""
    if path in added or path == "/":
        return
    added.add(path)
    _add_path(tar, os.path.dirname(path), added)
    if os.path.islink(path):
        tar.add(path, arcname=path.lstrip("/"), recursive=False)
        target = os.path.join(os.path.dirname(path), os.readlink(path))
        _add_path(tar, os.path.normpath(target), added)
    elif os.path.isdir(path) or os.path.isfile(path):
        tar.add(path, arcname=path.lstrip("/"), recursive=False, filter=_world_readable)


def _world_readable(info):
    """Owned by root, readable (and dirs traversable) by everyone: the sandbox runs as 65534."""
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mode = 0o755 if info.isdir() or info.mode & 0o111 else 0o644
    return info


def _add_bytes(tar, name: str, data: bytes, mode: int) -> None:
    import io
    import tarfile

    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    tar.addfile(info, io.BytesIO(data))
