"""The seccomp filter of the bubblewrap backend, compiled by libseccomp (through ctypes: the system
``libseccomp.so.2``; the PyPI bindings are not a dependency of agentrl).

Everything is allowed except what lets sandboxed code leave or widen its namespaces (new namespaces,
``setns``, mounts), reach other processes (``ptrace``, ``process_vm_*``), share state outside the
sandbox (the kernel keyring, which no namespace isolates) or talk to the kernel in ways no test needs
(modules, ``bpf``, ``perf_event_open``, ``userfaultfd``, terminal injection). Those fail with EPERM;
``clone3`` fails with ENOSYS so libc falls back to ``clone``, whose flags the filter can see.
Foreign-architecture syscalls kill the process (libseccomp's default).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os

DENIED = (
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "mount_setattr", "move_mount",
    "open_tree", "fsopen", "fsconfig", "fsmount", "fspick", "keyctl", "add_key", "request_key", "ptrace",
    "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp", "bpf", "perf_event_open", "userfaultfd",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "open_by_handle_at",
    "name_to_handle_at", "iopl", "ioperm", "swapon", "swapoff", "reboot", "acct", "quotactl", "syslog",
    "vhangup", "uselib", "lookup_dcookie", "personality",
)
# CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME
CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000,
                         0x00000080)
TIOCSTI = 0x5412

_ACT_ALLOW = 0x7FFF0000
_CMP_MASKED_EQ = 7


def _act_errno(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


class SeccompUnavailable(RuntimeError):
    """libseccomp is not installed, or refused the filter."""


@functools.cache
def _lib() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise SeccompUnavailable(f"libseccomp not found ({exc}); apt-get install libseccomp2") from exc
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


@functools.cache
def filter_program() -> bytes:
    """The compiled BPF program (what ``bwrap --seccomp FD`` reads); SeccompUnavailable without libseccomp."""
    lib = _lib()
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if not ctx:
        raise SeccompUnavailable("seccomp_init failed")
    try:
        def add(name: str, action: int, *cmps: tuple[int, int, int, int]) -> None:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                return  # not a syscall on this architecture
            args = (_ArgCmp * max(1, len(cmps)))(*[_ArgCmp(*c) for c in cmps])
            rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), args)
            if rc < 0:
                raise SeccompUnavailable(f"seccomp_rule_add({name}) failed: {os.strerror(-rc)}")

        for name in DENIED:
            add(name, _act_errno(errno.EPERM))
        add("clone3", _act_errno(errno.ENOSYS))
        for flag in CLONE_NAMESPACE_FLAGS:
            add("clone", _act_errno(errno.EPERM), (0, _CMP_MASKED_EQ, flag, flag))
        add("ioctl", _act_errno(errno.EPERM), (1, _CMP_MASKED_EQ, 0xFFFFFFFF, TIOCSTI))
        fd = os.memfd_create("agentrl-seccomp")
        try:
            rc = lib.seccomp_export_bpf(ctx, fd)
            if rc < 0:
                raise SeccompUnavailable(f"seccomp_export_bpf failed: {os.strerror(-rc)}")
            os.lseek(fd, 0, os.SEEK_SET)
            chunks = []
            while chunk := os.read(fd, 65536):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)


def seccomp_problem() -> str | None:
    """Why the bubblewrap backend cannot have its seccomp filter here, or None."""
    try:
        filter_program()
    except SeccompUnavailable as exc:
        return str(exc)
    return None
