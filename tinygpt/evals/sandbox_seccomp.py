"""The system call filter each sandboxed process runs under (installed by the supervisor,
sandbox_init.py, in each child before exec): standard library only."""
from __future__ import annotations

import os

# Installed in each child before exec (kept across exec, inherited by threads), on the two
# architectures whose numbers are below. What no sandboxed process may do, with EPERM:
# - SysV IPC and POSIX message queues: shared memory held outside RLIMIT_AS (3 GB past a 1 GB
#   limit) and, in the uid mode, in the host's namespace, kept after the sandbox ends;
# - memfd_create, memfd_secret: memory files outside the jail's size-capped tmpfs (~1 GB past the
#   limit);
# - unshare, setns, and clone with a CLONE_NEW* flag: a user namespace gives back every capability
#   in it, and with them a mount of any size;
# - with max_processes=1, a new process: clone without CLONE_THREAD, fork, vfork. Threads are a
#   clone with CLONE_THREAD, allowed (RLIMIT_NPROC allows THREADS of them).
# clone3 answers ENOSYS: its flags are in memory the filter cannot read, and glibc then uses clone.
# Another architecture's calls (i386's int 0x80, x32's numbers on x86_64) are refused whole.

THREADS = 32  # a thread pool's worth (ThreadPoolExecutor's default is at most 32 workers)
CLONE_THREAD = 0x00010000
# NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET|NEWTIME (all in the low 32 bits)
CLONE_NEW = 0x7E020080
_SYSCALLS = {  # machine: (AUDIT_ARCH_*, refused, clone, clone3, fork and vfork)
    "x86_64": (0xC000003E, (29, 30, 31, 67,  # shmget shmat shmctl shmdt
                            64, 65, 66, 220,  # semget semop semctl semtimedop
                            68, 69, 70, 71,  # msgget msgsnd msgrcv msgctl
                            240, 241, 242, 243, 244, 245,  # mq_open .. mq_getsetattr
                            319, 447,  # memfd_create memfd_secret
                            272, 308),  # unshare setns
               56, 435, (57, 58)),
    "aarch64": (0xC00000B7, (*range(180, 198),  # mq_open .. mq_getsetattr, msg*, sem*, shm*
                             279, 447, 97, 268),  # memfd_create memfd_secret unshare setns
                220, 435, ()),
}


def seccomp_filter(processes: bool, machine: str | None = None) -> bytes | None:
    """The filter above as classic BPF (struct sock_filter[]), or None on an architecture not
    listed."""
    import struct
    machine = machine or os.uname().machine
    arch = _SYSCALLS.get(machine)
    if arch is None:
        return None
    audit_arch, refused, clone, clone3, forks = arch
    # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    # SECCOMP_RET_ALLOW, RET_ERRNO(...)
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, audit_arch), (ret, 0, 0, eperm),  # seccomp_data.arch
            (ld, 0, 0, 0)]  # seccomp_data.nr
    if machine == "x86_64":
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, eperm)]  # x32
    for nr in refused + (() if processes else forks):
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, eperm)]
    prog += [(jeq, 0, 1, clone3), (ret, 0, 0, enosys)]
    flags = [(ld, 0, 0, 16),  # the low 32 bits of args[0] (both are little-endian), clone's flags
             (jset, 0, 1, CLONE_NEW), (ret, 0, 0, eperm)]
    if not processes:
        flags += [(jset, 1, 0, CLONE_THREAD), (ret, 0, 0, eperm)]
    flags += [(ret, 0, 0, allow)]
    prog += [(jeq, 0, len(flags), clone), *flags, (ret, 0, 0, allow)]
    return b"".join(struct.pack("=HBBI", *ins) for ins in prog)


def install_filter(libc, program: bytes) -> None:
    """prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &sock_fprog), after no-new-privs; raises if
    refused."""
    import ctypes

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    prog = Fprog(len(program) // 8, program)
    ul = ctypes.c_ulong
    if libc.prctl(ul(22), ul(2), ctypes.byref(prog), ul(0), ul(0)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"sandbox: the system call filter: {os.strerror(err)}")
