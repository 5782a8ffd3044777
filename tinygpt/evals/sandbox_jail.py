"""The jail of the namespace modes (root, userns), built by the supervisor (sandbox_init.py) before
it starts any process: standard library only (run inside the sandbox's supervisor, which never
imports tinygpt)."""

from __future__ import annotations

import contextlib
import os

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC = 1, 2, 4, 8, 32, 4096, 16384
_KEPT_FLAGS = {
    "ro": MS_RDONLY,
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": 1024,
    "nodiratime": 2048,
    "relatime": 1 << 21,
}
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
DEVICES = ("null", "zero", "full", "random", "urandom")


class Jail:
    """The namespace modes' mounts: a size-capped tmpfs as the new `/`, read-only binds."""

    def __init__(self) -> None:
        import ctypes

        self.ctypes = ctypes
        self.libc = ctypes.CDLL(None, use_errno=True)

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            err = self.ctypes.get_errno()
            raise OSError(err, f"sandbox: {what}: {os.strerror(err)}")

    def mount(
        self, src: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
    ) -> None:
        def enc(s: str | None) -> bytes | None:
            return None if s is None else s.encode()

        self._check(
            self.libc.mount(
                enc(src), enc(target), enc(fstype), self.ctypes.c_ulong(flags), enc(data)
            ),
            f"mount {target}",
        )

    @staticmethod
    def mounts_under(path: str) -> list[tuple[str, int]]:
        """(mount point, the flags a remount must keep) for `path` and every mount below it."""
        out = []
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                fields = line.split()
                point = fields[4].encode("latin-1", "surrogateescape").decode("unicode_escape")
                if point == path or point.startswith(path.rstrip("/") + "/"):
                    flags = 0
                    for opt in fields[5].split(","):
                        flags |= _KEPT_FLAGS.get(opt, 0)
                    out.append((point, flags))
        return out

    def bind_read_only(self, src: str, target: str, extra: int = MS_NOSUID | MS_NODEV) -> None:
        self.mount(src, target, None, MS_BIND | MS_REC)
        # a bind's read-only flag covers its top mount only
        for point, flags in self.mounts_under(target):
            self.mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | extra | flags)

    def build(self, job: dict, root: str = "/tmp") -> None:
        """Mount the new root at `root` (a private mount of this namespace: the host's folder is
        untouched), fill it, pivot into it and drop the old root."""
        self.mount(
            "tmpfs",
            root,
            "tmpfs",
            MS_NOSUID | MS_NODEV | MS_NOEXEC,
            f"size={job['max_write_bytes']},nr_inodes=16384,mode=755",
        )
        bound: list[str] = []
        for path in job["read_only"]:
            if any(path == b or path.startswith(b + "/") for b in bound) or not os.path.lexists(
                path
            ):
                continue
            inside = root + path
            os.makedirs(os.path.dirname(inside), exist_ok=True)
            if os.path.islink(path):  # /bin -> usr/bin on merged-/usr systems
                os.symlink(os.readlink(path), inside)
            elif os.path.isdir(path):
                os.makedirs(inside, exist_ok=True)
                self.bind_read_only(path, inside)
                bound.append(path)
        os.makedirs(root + "/dev", exist_ok=True)
        for name in DEVICES:
            dev = f"{root}/dev/{name}"
            open(dev, "w").close()
            self.mount(f"/dev/{name}", dev, None, MS_BIND)
            flags = self.mounts_under(dev)[-1][1]
            self.mount(None, dev, None, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NOEXEC | flags)
        os.mkdir(root + "/tmp")
        os.chmod(root + "/tmp", 0o1777)
        # the outputs: their own tmpfs, so that a full jail still shows why
        os.mkdir(root + "/.out")
        self.mount(
            "tmpfs",
            root + "/.out",
            "tmpfs",
            MS_NOSUID | MS_NODEV | MS_NOEXEC,
            f"size={4 * job['max_output_bytes'] + 2**20},mode=700",
        )
        os.chdir(root)
        number = _PIVOT_ROOT.get(os.uname().machine)
        if number is not None:
            self._check(self.libc.syscall(number, b".", b"."), "pivot_root")
            self._check(self.libc.umount2(b".", 2), "detach the old root")  # MNT_DETACH
        else:
            os.chroot(".")
        os.chdir("/")

    def drop_capabilities(self) -> None:
        """All capabilities, also those an exec as uid 0 of a user namespace would grant again."""
        for cap in range(64):
            self.libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP; past the last cap: EINVAL
        # _LINUX_CAPABILITY_VERSION_3, this process
        header = (self.ctypes.c_uint32 * 2)(0x20080522, 0)
        data = (self.ctypes.c_uint32 * 6)()
        self._check(self.libc.capset(header, data), "capset")
        self.libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL


def no_ipc_nor_user_namespaces(job: dict) -> None:
    """Namespace modes, before the jail hides /proc: this IPC namespace is not the caller's (else
    stop), and allows no SysV segment, queue or semaphore set; in userns mode no user namespace can
    be made below this one. The filter refuses those calls already: this holds where it cannot be
    installed. /proc/sys can be read-only (a container): then the filter alone."""

    def ns(name: str) -> tuple[int, int]:
        st = os.stat(f"/proc/self/ns/{name}")
        return st.st_dev, st.st_ino

    caller = job.get("caller_ns") or {}
    if caller.get("ipc") is None:
        raise OSError(
            "sandbox: cannot tell this IPC namespace from the caller's (no /proc/self/ns/ipc)"
        )
    if tuple(caller["ipc"]) == ns("ipc"):
        raise OSError("sandbox: no IPC namespace of its own")
    sysctls = [("kernel/shmmni", "0"), ("kernel/msgmni", "0"), ("kernel/sem", "0 0 0 0")]
    user = caller.get("user")
    if job["mode"] == "userns" and user is not None and tuple(user) != ns("user"):
        sysctls.append(("user/max_user_namespaces", "0"))  # a limit of this user namespace only
    for name, value in sysctls:
        with contextlib.suppress(OSError), open(f"/proc/sys/{name}", "w") as f:
            f.write(value)
