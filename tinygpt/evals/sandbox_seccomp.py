"""The system call filter each sandboxed process runs under (installed by the supervisor,
sandbox_init.py, in each child before exec): standard library only."""

from __future__ import annotations

import os

# Installed in each child before exec (kept across exec, inherited by threads), on the two
# architectures whose numbers are below. An allowlist: a call not named in ALLOWED answers ENOSYS,
# as on a kernel without it (so io_uring, userfaultfd, bpf, keyctl, add_key, ptrace, perf_event_open
# and whatever the next kernel adds are refused, and a C library takes its fallback). ALLOWED is
# what the sandbox's processes were seen to make (strace -f of the test and solution processes on
# HumanEval's and MBPP's canonical solutions and a program using most of the standard library:
# files, threads, asyncio, sqlite3, subprocess, signals, sockets; Pythons 3.10 to 3.13, glibc
# 2.36, in each mode), with the variants other C libraries and Pythons use for the same work
# (statx, faccessat2, fchmodat2, ppoll, epoll_pwait2...). Sockets are allowed: the network
# namespace, not the filter, keeps the network out (asyncio needs a socketpair). Named in REFUSED,
# with EPERM:
# - SysV IPC and POSIX message queues: shared memory held outside RLIMIT_AS (3 GB past a 1 GB
#   limit) and, in the uid mode, in the host's namespace, kept after the sandbox ends;
# - memfd_create, memfd_secret: memory files outside the jail's size-capped tmpfs (~1 GB past the
#   limit);
# - unshare, setns, and clone with a CLONE_NEW* flag: a user namespace gives back every capability
#   in it, and with them a mount of any size;
# - with max_processes=1, a new process: clone without CLONE_THREAD, fork, vfork. Threads are a
#   clone with CLONE_THREAD, allowed (RLIMIT_NPROC allows THREADS of them).
# clone3 is not named (ENOSYS): its flags are in memory the filter cannot read, and glibc then uses
# clone. Another architecture's calls (i386's int 0x80, x32's numbers on x86_64) are refused whole.

THREADS = 32  # a thread pool's worth (ThreadPoolExecutor's default is at most 32 workers)
CLONE_THREAD = 0x00010000
# NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET|NEWTIME (all in the low 32 bits)
CLONE_NEW = 0x7E020080
MACHINES = {"x86_64": 0, "aarch64": 1}  # the column of each table below
AUDIT_ARCH = (0xC000003E, 0xC00000B7)
CLONE, FORKS = (56, 220), ((57, 58), ())  # clone; fork and vfork (aarch64 has neither)


def _calls(table: str) -> dict[str, tuple[int | None, int | None]]:
    """{name: (x86_64 number, aarch64 number)} from "name x86_64 aarch64" triples ("-": none)."""
    w = table.split()
    return {
        w[i]: tuple(None if n == "-" else int(n) for n in w[i + 1 : i + 3])
        for i in range(0, len(w), 3)
    }


ALLOWED = _calls(  # name x86_64 aarch64 ("-": that architecture has no such call)
    # files
    "read 0 63  write 1 64  readv 19 65  writev 20 66  pread64 17 67  pwrite64 18 68 "
    "preadv 295 69  pwritev 296 70  preadv2 327 286  pwritev2 328 287  open 2 -  openat 257 56 "
    "creat 85 -  close 3 57  close_range 436 436  lseek 8 62  dup 32 23  dup2 33 -  dup3 292 24 "
    "pipe 22 -  pipe2 293 59  fcntl 72 25  ioctl 16 29  flock 73 32  fsync 74 82 "
    "fdatasync 75 83  truncate 76 45  ftruncate 77 46  fallocate 285 47  fadvise64 221 223 "
    "sendfile 40 71  copy_file_range 326 285  stat 4 -  fstat 5 80  lstat 6 - "
    "newfstatat 262 79  statx 332 291  statfs 137 43  fstatfs 138 44  access 21 - "
    "faccessat 269 48  faccessat2 439 439  readlink 89 -  readlinkat 267 78  getdents 78 - "
    "getdents64 217 61  getcwd 79 17  chdir 80 49  fchdir 81 50  umask 95 166  mkdir 83 - "
    "mkdirat 258 34  rmdir 84 -  unlink 87 -  unlinkat 263 35  rename 82 -  renameat 264 38 "
    "renameat2 316 276  link 86 -  linkat 265 37  symlink 88 -  symlinkat 266 36  chmod 90 - "
    "fchmod 91 52  fchmodat 268 53  fchmodat2 452 452  chown 92 -  fchown 93 55  lchown 94 - "
    "fchownat 260 54  utime 132 -  utimes 235 -  utimensat 280 88  futimesat 261 - "
    "getxattr 191 8  lgetxattr 192 9  fgetxattr 193 10  listxattr 194 11  llistxattr 195 12 "
    "flistxattr 196 13  setxattr 188 5  lsetxattr 189 6  fsetxattr 190 7  removexattr 197 14 "
    "lremovexattr 198 15  fremovexattr 199 16 "
    # memory
    "brk 12 214  mmap 9 222  munmap 11 215  mremap 25 216  mprotect 10 226  madvise 28 233 "
    "msync 26 227  mincore 27 232 "
    # process
    "execve 59 221  exit 60 93  exit_group 231 94  wait4 61 260  waitid 247 95 "
    "set_tid_address 218 96  set_robust_list 273 99  rseq 334 293  futex 202 98 "
    "arch_prctl 158 -  prctl 157 167  sched_yield 24 124  sched_getaffinity 204 123 "
    "sched_getparam 143 121  sched_getscheduler 145 120  sched_get_priority_max 146 125 "
    "sched_get_priority_min 147 126  getpid 39 172  getppid 110 173  gettid 186 178 "
    "getuid 102 174  geteuid 107 175  getgid 104 176  getegid 108 177  getgroups 115 158 "
    "getresuid 118 148  getresgid 120 150  getpgid 121 155  getpgrp 111 -  getsid 124 156 "
    "setpgid 109 154  setsid 112 157  getrlimit 97 163  setrlimit 160 164  prlimit64 302 261 "
    "getrusage 98 165  times 100 153  uname 63 160  sysinfo 99 179  getcpu 309 168 "
    "getpriority 140 141  kill 62 129  tkill 200 130  tgkill 234 131  pidfd_open 434 434 "
    "pidfd_send_signal 424 424 "
    # signals
    "rt_sigaction 13 134  rt_sigprocmask 14 135  rt_sigreturn 15 139  rt_sigpending 127 136 "
    "rt_sigtimedwait 128 137  rt_sigsuspend 130 133  sigaltstack 131 132  pause 34 - "
    "alarm 37 -  setitimer 38 103  getitimer 36 102  restart_syscall 219 128 "
    # time
    "clock_gettime 228 113  clock_getres 229 114  clock_nanosleep 230 115  nanosleep 35 101 "
    "gettimeofday 96 169  time 201 - "
    # events
    "poll 7 -  ppoll 271 73  select 23 -  pselect6 270 72  epoll_create 213 - "
    "epoll_create1 291 20  epoll_ctl 233 21  epoll_wait 232 -  epoll_pwait 281 22 "
    "epoll_pwait2 441 441  eventfd 284 -  eventfd2 290 19  getrandom 318 278 "
    # sockets
    "socket 41 198  socketpair 53 199  connect 42 203  bind 49 200  listen 50 201 "
    "accept 43 202  accept4 288 242  sendto 44 206  recvfrom 45 207  sendmsg 46 211 "
    "recvmsg 47 212  sendmmsg 307 269  recvmmsg 299 243  shutdown 48 210  getsockname 51 204 "
    "getpeername 52 205  setsockopt 54 208  getsockopt 55 209 "
)
REFUSED = _calls(  # name x86_64 aarch64, each answered EPERM
    "shmget 29 194  shmat 30 196  shmctl 31 195  shmdt 67 197  semget 64 190  semop 65 193 "
    "semctl 66 191  semtimedop 220 192  msgget 68 186  msgsnd 69 189  msgrcv 70 188 "
    "msgctl 71 187  mq_open 240 180  mq_unlink 241 181  mq_timedsend 242 182 "
    "mq_timedreceive 243 183  mq_notify 244 184  mq_getsetattr 245 185  memfd_create 319 279 "
    "memfd_secret 447 447  unshare 272 97  setns 308 268 "
)


def _allow(numbers: list[int]) -> list[tuple]:
    """ALLOW for each number in `numbers` (the accumulator holds the call's number), as runs of
    consecutive numbers: one or three instructions each."""
    jeq, jge, jgt, ret, allow = 0x15, 0x35, 0x25, 0x06, 0x7FFF0000
    prog: list[tuple] = []
    runs: list[list[int]] = []
    for nr in sorted(set(numbers)):
        if runs and runs[-1][1] == nr - 1:
            runs[-1][1] = nr
        else:
            runs.append([nr, nr])
    for lo, hi in runs:
        prog += [(jeq, 0, 1, lo)] if lo == hi else [(jge, 0, 2, lo), (jgt, 1, 0, hi)]
        prog.append((ret, 0, 0, allow))
    return prog


def seccomp_filter(processes: bool, machine: str | None = None) -> bytes | None:
    """The filter above as classic BPF (struct sock_filter[]), or None on an architecture not
    listed."""
    import struct

    machine = machine or os.uname().machine
    col = MACHINES.get(machine)
    if col is None:
        return None
    # BPF_LD|W|ABS, BPF_JMP|JEQ/JGE/JSET|K, BPF_RET|K
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    # SECCOMP_RET_ALLOW, RET_ERRNO(...)
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    # seccomp_data.arch must be this machine's; then seccomp_data.nr is loaded
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, AUDIT_ARCH[col]), (ret, 0, 0, eperm), (ld, 0, 0, 0)]
    if machine == "x86_64":
        prog += [(jge, 0, 1, 0x40000000), (ret, 0, 0, eperm)]  # x32
    allowed = [nrs[col] for nrs in ALLOWED.values() if nrs[col] is not None]
    prog += _allow(allowed + list(FORKS[col] if processes else ()))
    for nr in [nrs[col] for nrs in REFUSED.values()] + list(() if processes else FORKS[col]):
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, eperm)]
    # the low 32 bits of args[0] (both are little-endian), clone's flags: no new namespace
    flags = [(ld, 0, 0, 16), (jset, 0, 1, CLONE_NEW), (ret, 0, 0, eperm)]
    if not processes:
        flags += [(jset, 1, 0, CLONE_THREAD), (ret, 0, 0, eperm)]
    flags += [(ret, 0, 0, allow)]
    prog += [(jeq, 0, len(flags), CLONE[col]), *flags, (ret, 0, 0, enosys)]
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
