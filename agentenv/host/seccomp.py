"""The seccomp profile of a sandbox (the OCI ``linux.seccomp`` section that runc loads).

An allowlist modelled on Docker's default profile (moby's profiles/seccomp/default.json): what ordinary
programs call is allowed, anything else fails with EPERM. Like Docker, calls that need a capability the
sandbox lacks are left out (mount, unshare, setns, bpf, perf_event_open, keyctl, kexec, modules, clock
setting ...), clone may not make namespaces, clone3 answers ENOSYS (so libc falls back to clone, whose
flags can be checked), socket may not open AF_VSOCK and personality takes Docker's few values. Unlike
the Docker profile this was modelled on, io_uring is refused (as Docker itself has done since 25.0),
and so are ptrace, process_vm_readv/writev and kcmp unless the sandbox is given CAP_SYS_PTRACE: nothing
in a sandbox needs to look into another process, and the keeper must not be looked into.
"""

from __future__ import annotations

import platform
from typing import Any

_SYSCALLS_ALLOWED = """
accept accept4 access adjtimex alarm bind brk capget capset chdir chmod chown chown32 clock_adjtime
clock_adjtime64 clock_getres clock_getres_time64 clock_gettime clock_gettime64 clock_nanosleep
clock_nanosleep_time64 close close_range connect copy_file_range creat dup dup2 dup3 epoll_create
epoll_create1 epoll_ctl epoll_ctl_old epoll_pwait epoll_pwait2 epoll_wait epoll_wait_old eventfd eventfd2
execve execveat exit exit_group faccessat faccessat2 fadvise64 fadvise64_64 fallocate fanotify_mark fchdir
fchmod fchmodat fchown fchown32 fchownat fcntl fcntl64 fdatasync fgetxattr flistxattr flock fork
fremovexattr fsetxattr fstat fstat64 fstatat64 fstatfs fstatfs64 fsync ftruncate ftruncate64 futex
futex_time64 futex_waitv futimesat getcpu getcwd getdents getdents64 getegid getegid32 geteuid geteuid32
getgid getgid32 getgroups getgroups32 getitimer getpeername getpgid getpgrp getpid getppid getpriority
getrandom getresgid getresgid32 getresuid getresuid32 getrlimit get_robust_list getrusage getsid
getsockname getsockopt get_thread_area gettid gettimeofday getuid getuid32 getxattr inotify_add_watch
inotify_init inotify_init1 inotify_rm_watch io_cancel ioctl io_destroy io_getevents io_pgetevents
io_pgetevents_time64 ioprio_get ioprio_set io_setup io_submit ipc kill landlock_add_rule
landlock_create_ruleset landlock_restrict_self lchown lchown32 lgetxattr link linkat listen listxattr
llistxattr _llseek lremovexattr lseek lsetxattr lstat lstat64 membarrier memfd_create memfd_secret
mincore mkdir mkdirat mknod mknodat mlock mlock2 mlockall mmap mmap2 mprotect mq_getsetattr mq_notify
mq_open mq_timedreceive mq_timedreceive_time64 mq_timedsend mq_timedsend_time64 mq_unlink mremap msgctl
msgget msgrcv msgsnd msync munlock munlockall munmap name_to_handle_at nanosleep newfstatat _newselect open
openat openat2 pause pidfd_open pidfd_send_signal pipe pipe2 pkey_alloc pkey_free pkey_mprotect poll ppoll
ppoll_time64 pread64 preadv preadv2 prlimit64 process_mrelease pselect6 pselect6_time64 pwrite64
pwritev pwritev2 read readahead readlink readlinkat readv recv recvfrom recvmmsg recvmmsg_time64 recvmsg
remap_file_pages removexattr rename renameat renameat2 restart_syscall rmdir rseq rt_sigaction
rt_sigpending rt_sigprocmask rt_sigqueueinfo rt_sigreturn rt_sigsuspend rt_sigtimedwait
rt_sigtimedwait_time64 rt_tgsigqueueinfo sched_getaffinity sched_getattr sched_getparam
sched_get_priority_max sched_get_priority_min sched_getscheduler sched_rr_get_interval
sched_rr_get_interval_time64 sched_setaffinity sched_setattr sched_setparam sched_setscheduler sched_yield
seccomp select semctl semget semop semtimedop semtimedop_time64 send sendfile sendfile64 sendmmsg sendmsg
sendto setfsgid setfsgid32 setfsuid setfsuid32 setgid setgid32 setgroups setgroups32 setitimer setpgid
setpriority setregid setregid32 setresgid setresgid32 setresuid setresuid32 setreuid setreuid32 setrlimit
set_robust_list setsid setsockopt set_thread_area set_tid_address setuid setuid32 setxattr shmat shmctl
shmdt shmget shutdown sigaltstack signalfd signalfd4 sigprocmask sigreturn socketcall socketpair splice
stat stat64 statfs statfs64 statx symlink symlinkat sync sync_file_range syncfs sysinfo tee tgkill time
timer_create timer_delete timer_getoverrun timer_gettime timer_gettime64 timer_settime timer_settime64
timerfd_create timerfd_gettime timerfd_gettime64 timerfd_settime timerfd_settime64 times tkill truncate
truncate64 ugetrlimit umask uname unlink unlinkat utime utimensat utimensat_time64 utimes vfork vmsplice
wait4 waitid waitpid write writev
"""
_SYSCALLS_BY_CAP = {  # allowed only when the sandbox holds the capability (as in Docker's profile)
    "CAP_SYS_CHROOT": ["chroot"],
    "CAP_SYS_PTRACE": ["ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
                       "process_madvise"],
    "CAP_SYS_ADMIN": ["mount", "umount", "umount2", "unshare", "setns", "sethostname", "setdomainname",
                      "clone3", "fsconfig", "fsmount", "fsopen", "fspick", "move_mount", "open_tree",
                      "mount_setattr", "quotactl", "quotactl_fd", "fanotify_init", "lookup_dcookie",
                      "syslog", "bpf", "perf_event_open"],
    "CAP_SYS_NICE": ["get_mempolicy", "mbind", "set_mempolicy", "set_mempolicy_home_node"],
    "CAP_SYS_BOOT": ["reboot"],
    "CAP_SYS_TIME": ["settimeofday", "stime", "clock_settime", "clock_settime64"],
    "CAP_DAC_READ_SEARCH": ["open_by_handle_at"],
}
# The native ABI only: unlike Docker's profile, the 32-bit (x86, arm) and x32 entry points are refused outright.
# Sandboxes run 64-bit programs, the compat syscall paths are a known source of kernel bugs, and runc has
# libseccomp compile the filter once per ABI on every start and restore: two more ABIs cost ~10 ms of each.
_SECCOMP_ARCHES = {
    "x86_64": (["SCMP_ARCH_X86_64"], ["arch_prctl", "modify_ldt"]),
    "aarch64": (["SCMP_ARCH_AARCH64"],
                ["arm_fadvise64_64", "arm_sync_file_range", "sync_file_range2", "breakpoint", "cacheflush",
                 "set_tls"]),
}
_CLONE_NAMESPACE_FLAGS = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
_AF_VSOCK = 40
_PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)  # PER_LINUX, UNAME26 and the query value
_ENOSYS = 38
_PR_SET_MEMORY_MERGE = 67
_MADV_MERGEABLE = 12


def _allow_unless(name: str, index: int, value: int) -> list[dict[str, Any]]:
    """Allow ``name`` unless the low 32 bits of its argument ``index`` (an int to the kernel) are ``value``: one rule
    per bit, each allowing the calls whose bit differs from ``value``'s (an ERRNO rule beside the plain allow
    would be ignored by libseccomp, and a 64-bit "not equal" lets value + 2**32 through)."""
    return [{"names": [name], "action": "SCMP_ACT_ALLOW",
             "args": [{"index": index, "value": 1 << b, "valueTwo": ~value & (1 << b), "op": "SCMP_CMP_MASKED_EQ"}]}
            for b in range(32)]


def seccomp_profile(caps: list[str], machine: str | None = None, share_memory: bool = False) -> dict[str, Any]:
    """The OCI ``linux.seccomp`` section of a sandbox holding ``caps``, for this machine's architecture. Without
    ``share_memory`` its processes may not ask KSM to merge their pages (prctl PR_SET_MEMORY_MERGE, madvise
    MADV_MERGEABLE: EPERM), so they never meet a sharing sandbox's pages nor keep ksmd running."""
    arches, arch_calls = _SECCOMP_ARCHES.get(machine or platform.machine(), ([], []))
    allowed = _SYSCALLS_ALLOWED.split() + arch_calls
    for cap, names in _SYSCALLS_BY_CAP.items():
        if cap in caps:
            allowed += names
    rules: list[dict[str, Any]] = [{"names": sorted(set(allowed)), "action": "SCMP_ACT_ALLOW"}]
    rules.append({"names": ["socket"], "action": "SCMP_ACT_ALLOW",
                  "args": [{"index": 0, "value": _AF_VSOCK, "op": "SCMP_CMP_NE"}]})
    rules += [{"names": ["personality"], "action": "SCMP_ACT_ALLOW",
               "args": [{"index": 0, "value": v, "op": "SCMP_CMP_EQ"}]} for v in _PERSONALITIES]
    if "CAP_SYS_ADMIN" in caps:
        rules.append({"names": ["clone"], "action": "SCMP_ACT_ALLOW"})
    else:
        rules.append({"names": ["clone"], "action": "SCMP_ACT_ALLOW",
                      "args": [{"index": 0, "value": _CLONE_NAMESPACE_FLAGS, "valueTwo": 0,
                                "op": "SCMP_CMP_MASKED_EQ"}]})
        rules.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": _ENOSYS})
    if not share_memory:
        rules += _allow_unless("prctl", 0, _PR_SET_MEMORY_MERGE) + _allow_unless("madvise", 2, _MADV_MERGEABLE)
    else:
        rules.append({"names": ["prctl", "madvise"], "action": "SCMP_ACT_ALLOW"})
    return {"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 1, "architectures": arches, "syscalls": rules}
