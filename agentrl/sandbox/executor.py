"""The in-sandbox command executor: a stdlib-only Python program that runs inside the sandbox.

It is started once per sandbox (``python3 -c <this file's source> [--contained]``) and then serves
requests over its stdin/stdout, so a command costs one fork+exec instead of a ``docker exec`` (~80 ms
here). Protocol: each message is a 4-byte big-endian length then UTF-8 JSON; byte strings are base64.

Requests: ``{"op": "run", "argv", "timeout", "stdin", "env", "cwd", "limit", "python_code"}`` ->
``{"exit_code", "stdout", "stderr", "stdout_total", "stderr_total", "timed_out", "oom_killed",
"duration_s"}``; ``{"op": "reset", "paths": [[path, mode]]}`` -> ``{"ok", "why"}`` kills every other
process of this uid, removes its SysV IPC objects, empties the paths and gives them their modes;
``{"op": "write", "files": [[path, b64, mode]]}``; ``{"op": "read", "path", "max_bytes"}`` ->
``{"data", "truncated"}`` or ``{"missing"|"isdir"|"denied"|"special": true}``; ``{"op": "ping"}`` ->
``{"pid"}``.

Who can reach the protocol: nobody but the host. The executor marks itself non-dumpable, so no
process of its uid without CAP_SYS_PTRACE (every command) can open its ``/proc/<pid>/fd``, read or
write its memory or trace it; its protocol fds are never inherited. What a command can still do to
it is signal it (SIGSTOP, SIGKILL; not under bubblewrap, where it is PID 1 of the pid namespace): the
host then gets no answer, kills everything and starts a fresh executor, and never a forged reply.

Containment rules it enforces: each command runs in its own session; when the command exits or times
out the whole process group is SIGKILLed; output beyond ``limit`` bytes per stream is counted and
dropped; after the command exits, pipes held open by escaped grandchildren are read for at most
``_DRAIN_S`` more seconds. Keep this file free of agentrl imports: it runs in the sandbox's python3.
"""

import atexit
import base64
import contextlib
import ctypes
import errno
import gc
import json
import os
import selectors
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import traceback
import types

_DRAIN_S = 0.2
_RESET_KILL_S = 3.0
_PR_SET_DUMPABLE = 4
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_IPC_RMID = 0
_LIBC = ctypes.CDLL(None, use_errno=True)
_OOM_FILES = ("/sys/fs/cgroup/memory/memory.oom_control", "/sys/fs/cgroup/memory.events",
              "/run/agentrl/oom_control")
# Set by --contained: this executor shares its pid namespace only with the agent's processes, so
# kill(-1) in reset reaches nothing else. Never set when it runs on a host (local tests).
_CONTAINED = False


def _set_dumpable(on):
    _LIBC.prctl(_PR_SET_DUMPABLE, 1 if on else 0, 0, 0, 0)


def _oom_kills():
    for path in _OOM_FILES:
        try:
            with open(path) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            continue
    return None


class _Capped:
    def __init__(self, limit):
        self.limit, self.parts, self.kept, self.total = limit, [], 0, 0

    def add(self, data):
        self.total += len(data)
        room = self.limit - self.kept
        if room > 0:
            self.parts.append(data[:room])
            self.kept += min(room, len(data))

    def b64(self):
        return base64.b64encode(b"".join(self.parts)).decode()


def _killpg(pid):
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


def _bury_group(pgid, wait_s=2.0):
    """SIGKILL the group until no member is left (killed processes die asynchronously, and a fork
    bomb's last children may still be exiting), reaping those that became our children."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            break  # ESRCH: the group is empty
        _reap()
        if not _live_members(pgid):
            break  # only zombies left, for whoever is their parent to reap
        time.sleep(0.002)
    _reap()


def _live_members(pgid):
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] not in "ZX":
                return True
    return False


def _reap():
    # Under bubblewrap the executor is PID 1 of its namespace, so orphans become its children.
    with contextlib.suppress(ChildProcessError):
        while (pid := os.waitpid(-1, os.WNOHANG)[0]) > 0:
            if pid == _Zygote.pid:  # an agent killed it: its pid must not be spared once reused
                _Zygote.pid = None
            _Zygote.dead(pid)


class _Zygote:
    """The process every ``run_python`` child is forked from: itself forked from this executor before
    it served any request, and never handed a request's bytes since, so no child can find another
    episode's code or output in the memory it inherits (the executor's freed heap holds both).

    It forks children ahead of need: per ``s`` message on a private socket it receives one end of a
    fresh socket pair, forks a child that waits on it and answers that child's pid. The executor keeps
    one such spare ready and asks for the next as it hands one a command, so the fork runs while a
    command runs instead of before it starts. The children stay the zygote's (one fork each: forking
    twice to hand them to the executor cost a third of an exec's CPU); the executor watches one through
    a pidfd, kills its group, then asks ``w`` for its wait status, and the zygote reaps it only then, so
    its pid (its group's id) is not reused before the executor is done with it. ``d`` names a spare
    dropped unused, reaped once it exits. Orphans of a command still go to the executor (a child
    subreaper, or PID 1 under bubblewrap), and so do the zygote's children if an agent kills it. A spare holds
    nothing of any request until its own arrives; reset kills it like every agent process and asks
    for a new one. The zygote is non-dumpable like the executor, and so is a spare until its command
    came; when an agent kills the zygote, ``run_python`` falls back to a fresh ``python3 -c`` (never to
    a fork of the executor)."""

    pid = None
    _sock = None
    _spare = None  # (pid, socket) of a child waiting for its command
    _asked = None  # our end of the socket the zygote is forking a spare for (its pid not read yet)

    @classmethod
    def start(cls, protocol_fds):
        _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:  # the zygote: never returns
            try:
                _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
                parent.close()
                for fd in protocol_fds:
                    os.close(fd)
                _warm_up()
                gc.freeze()  # keep the executor's objects out of every child's collections (fewer CoW faults)
                cls._serve(child)
            finally:
                os._exit(0)
        child.close()
        cls.pid, cls._sock = pid, parent
        cls._ask()

    @staticmethod
    def _serve(sock):
        dropped = set()
        while True:
            for pid in list(dropped):
                with contextlib.suppress(ChildProcessError):
                    if not os.waitpid(pid, os.WNOHANG)[0]:
                        continue
                dropped.discard(pid)
            msg, fds, _, _ = socket.recv_fds(sock, 16, 1)
            if msg[:1] in (b"w", b"d") and len(msg) == 5 and not fds:
                pid = struct.unpack(">i", msg[1:])[0]
                if msg[:1] == b"d":
                    dropped.add(pid)
                    continue
                try:
                    status = os.waitpid(pid, 0)[1]
                except ChildProcessError:
                    status = -1
                sock.send(struct.pack(">i", status))
                continue
            if msg != b"s" or len(fds) != 1:
                return
            try:
                pid = os.fork()
            except OSError:  # EAGAIN at the pids limit (a fork bomb of the agent's): no spare this time
                pid = -1
            if pid == 0:
                _spare_child(fds[0])  # never returns
            os.close(fds[0])
            sock.send(struct.pack(">i", pid))

    @classmethod
    def _ask(cls):
        """Ask the zygote to fork the next spare; it answers the pid when ``take`` needs it."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            cls._sock.settimeout(5.0)
            socket.send_fds(cls._sock, [b"s"], [theirs.fileno()], socket.MSG_NOSIGNAL)
        except OSError:
            ours.close()
            cls.gone()
        else:
            cls._asked = ours
        finally:
            theirs.close()

    @classmethod
    def _answer(cls):
        """The zygote's next 4-byte answer (they come in the order asked); None when it is gone."""
        try:
            cls._sock.settimeout(5.0)
            reply = cls._sock.recv(16)
        except OSError:
            reply = b""
        if len(reply) != 4:
            cls.gone()
            return None
        return struct.unpack(">i", reply)[0]

    @classmethod
    def _collect(cls):
        ours, cls._asked = cls._asked, None
        pid = cls._answer()
        if pid is None or pid <= 0:
            ours.close()  # gone, or its fork failed
        else:
            cls._spare = (pid, ours)

    @classmethod
    def _tell(cls, op, pid):
        try:
            cls._sock.settimeout(5.0)
            cls._sock.send(op + struct.pack(">i", pid), socket.MSG_NOSIGNAL)
        except OSError:
            cls.gone()
            return False
        return True

    @classmethod
    def wait_status(cls, pid):
        """The wait status of the zygote's child ``pid`` (an exited one: a pidfd said so), reaped now;
        None when the zygote is gone."""
        if cls._sock is not None and cls._asked is not None:
            cls._collect()
        if cls._sock is None or not cls._tell(b"w", pid):
            return None
        status = cls._answer()
        return None if status is None or status < 0 else status

    @classmethod
    def take(cls):
        """``(pid, socket)`` of a spare child, the next one asked for; None when the zygote is gone."""
        if cls._spare is None and cls._asked is not None:
            cls._collect()
        if cls._spare is None and cls._sock is not None:  # the last fork failed: try once more now
            cls._ask()
            if cls._asked is not None:
                cls._collect()
        spare, cls._spare = cls._spare, None
        if spare is not None and cls._sock is not None:
            cls._ask()  # forked while this one runs
        return spare

    @classmethod
    def renew(cls):
        """Drop the spare (reset has killed it, or it may have been tampered with) and ask for a new one."""
        if cls._asked is not None and cls._sock is not None:
            cls._collect()  # keep the zygote's answers in step with our questions
        cls.dead(None)
        if cls._sock is not None:
            cls._ask()

    @classmethod
    def dead(cls, pid):
        """Forget the spare when it is ``pid`` (reaped: its pid may be reused) or when ``pid`` is None."""
        if cls._spare is not None and pid in (None, cls._spare[0]):
            cls.drop(*cls._spare)
            cls._spare = None

    @classmethod
    def drop(cls, pid, sock):
        """A spare not used: it exits once its socket closes (if still alive) and the zygote reaps it."""
        sock.close()
        if cls._sock is not None:
            cls._tell(b"d", pid)

    @classmethod
    def gone(cls):
        for sock in (cls._sock, cls._asked):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        cls._sock = cls._asked = None
        cls.dead(None)
        if cls.pid is not None:
            with contextlib.suppress(OSError):
                os.kill(cls.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(cls.pid, 0)
        cls.pid = None


def _warm_up():
    """Do once in the zygote what every child does first (compile and run a snippet, decode its request,
    open text streams), so each child inherits the caches filled instead of filling them itself. On
    bubblewrap (2 shared cores, load ~3) children of the cold zygote ran 150-180/s at 5.6-6.7 ms p50,
    of the warmed one 190/s at 4.5 ms; forks of the executor itself, before the zygote, 350/s at 2.4 ms.
    Nothing of any request is involved."""
    with open(os.devnull, "w", encoding="utf-8", errors="backslashreplace", buffering=1) as sink:
        exec(compile("print(sum(range(10)), file=sink)\n", "<string>", "exec", dont_inherit=True), {"sink": sink})
    json.loads(json.dumps({"code": "", "env": {"PATH": "/usr/bin"}, "cwd": None, "private": False}))


class _ForkedPython:
    """Runs Python code in a fork of the zygote's already started interpreter: ~1 ms instead of the
    ~20 ms of a fresh ``python3 -c``. The child looks like ``python3 -c CODE``: own session, fds 0-2 on
    pipes, every other fd closed, fresh ``__main__``, SIGPIPE ignored, argv ``['-c']``, the requested
    env and cwd, atexit handlers and non-daemon threads honoured. Differences: modules this executor
    imported (json, subprocess, selectors, ...) are already in ``sys.modules``. Raises OSError when
    the zygote is gone."""

    def __init__(self, code, with_stdin, env, cwd, private=False):
        payload = json.dumps({"code": code, "env": env, "cwd": cwd, "private": private}).encode()
        frame = memoryview(struct.pack(">I", len(payload)) + payload)
        r_in, w_in = os.pipe() if with_stdin else (os.open(os.devnull, os.O_RDONLY), None)
        r_out, w_out = os.pipe()
        r_err, w_err = os.pipe()
        try:
            pid = self._hand_over(frame, (r_in, w_out, w_err))
        finally:
            for fd in (r_in, w_out, w_err):
                os.close(fd)
        if pid is None:
            for fd in (w_in, r_out, r_err):
                if fd is not None:
                    os.close(fd)
            raise OSError(errno.ESRCH, "the zygote is gone")
        self.pid, self.returncode = pid, None
        self.stdin = os.fdopen(w_in, "wb", buffering=0) if w_in is not None else None
        self.stdout = os.fdopen(r_out, "rb", buffering=0)
        self.stderr = os.fdopen(r_err, "rb", buffering=0)

    @staticmethod
    def _hand_over(frame, fds):
        """Give a spare its fds and request; its pid, or None when no spare is left."""
        for _ in range(2):  # a spare an agent killed refuses the fds: the next one
            spare = _Zygote.take()
            if spare is None:
                return None
            pid, sock = spare
            try:
                sock.settimeout(5.0)
                sent = socket.send_fds(sock, [frame[:65536]], list(fds), socket.MSG_NOSIGNAL)
            except OSError:
                _Zygote.drop(pid, sock)
                continue
            with contextlib.suppress(OSError):  # a child that died (or was stopped) first reports itself
                sock.sendall(frame[sent:], socket.MSG_NOSIGNAL)
            sock.close()
            return pid
        return None

    def poll(self):
        if self.returncode is None:
            try:
                with open(f"/proc/{self.pid}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                state = "X"
            if state in ("Z", "X"):
                self.wait()
        return self.returncode

    def wait(self):
        """The exit code, from the zygote; once an agent killed the zygote its children are ours (the
        executor is their subreaper) and are waited for here, and one already reaped reads as SIGKILLed."""
        if self.returncode is None:
            status = _Zygote.wait_status(self.pid)
            if status is None:
                try:
                    status = os.waitpid(self.pid, 0)[1]
                except ChildProcessError:
                    status = signal.SIGKILL
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode


def _spare_child(sock_fd):
    """In a fork of the zygote: wait on ``sock_fd`` for stdin, stdout, stderr and a request, then become
    ``python3 -c CODE``. Everything that needs no request is done before it comes."""
    rc = 1
    try:
        os.setsid()
        os.closerange(3, sock_fd)
        os.closerange(sock_fd + 1, 65536)
        sock = socket.socket(fileno=sock_fd)
        _warm_up()  # the pages a child writes first are copied now, not once its command is waiting
        msg, fds, _, _ = socket.recv_fds(sock, 65536, 3)
        if len(fds) == 3:
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            body = bytearray(msg)
            size = None
            while size is None or len(body) < size:
                if size is None and len(body) >= 4:
                    size = struct.unpack(">I", body[:4])[0] + 4
                    continue
                chunk = sock.recv(1 << 20 if size is None else min(size - len(body), 1 << 20))
                if not chunk:
                    break
                body += chunk
            sock.detach()
            os.closerange(3, 65536)
            if size is not None and len(body) == size:
                request = json.loads(body[4:])
                # As after exec: the agent's own process, holding none of our fds. A private one (the
                # host's health probe) stays non-dumpable, so no leftover of the agent can write into its output.
                _set_dumpable(not request["private"])
                rc = _child_python(request["code"], request["env"], request["cwd"])
    finally:
        os._exit(rc)


def _child_python(code, env, cwd):
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    if cwd:
        os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.stdin = sys.__stdin__ = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stderr = sys.__stderr__ = open(2, "w", encoding="utf-8", errors="backslashreplace",  # noqa: SIM115
                                       buffering=1, closefd=False)
    sys.argv = ["-c"]
    main = types.ModuleType("__main__")
    main.__builtins__ = __builtins__
    sys.modules["__main__"] = main
    rc = 0
    try:
        if isinstance(code, str):
            code = compile(code, "<string>", "exec", dont_inherit=True)
        exec(code, main.__dict__)
    except SystemExit as exc:
        rc = _exit_code(exc.code)
    except BaseException as exc:
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next if exc.__traceback__ else None)
        rc = 1
    for finish in (getattr(threading, "_shutdown", None), getattr(atexit, "_run_exitfuncs", None)):
        if finish is not None:
            try:
                finish()
            except SystemExit as exc:
                rc = _exit_code(exc.code)
            except BaseException:
                traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    return rc


def _exit_code(code):
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(BaseException):
        print(code, file=sys.stderr)
    return 1


def run(req):
    argv, timeout, limit = req["argv"], float(req["timeout"]), int(req["limit"])
    stdin = base64.b64decode(req["stdin"]) if req.get("stdin") is not None else None
    before = _oom_kills()
    start = time.monotonic()
    try:
        proc = _spawn(req, argv, stdin is not None)
    except OSError as exc:
        msg = f"{argv[0]}: {exc.strerror or exc}\n"
        return {"exit_code": 127 if isinstance(exc, FileNotFoundError) else 126, "stdout": "",
                "stderr": base64.b64encode(msg.encode()).decode(), "stdout_total": 0,
                "stderr_total": len(msg), "timed_out": False, "oom_killed": False,
                "duration_s": time.monotonic() - start}
    streams = _Streams(proc, stdin, limit)
    timed_out = streams.pump_until_exit(start + timeout)
    _killpg(proc.pid)  # the command's leftovers (background children) die with it
    streams.drain_and_close()
    rc = proc.wait()
    _bury_group(proc.pid)
    duration = time.monotonic() - start
    if rc < 0:
        rc = 128 - rc
    after = _oom_kills() if rc == 137 and not timed_out else None
    oom = after is not None and before is not None and after > before
    out, err = streams.out, streams.err
    return {"exit_code": rc, "stdout": out.b64(), "stderr": err.b64(), "stdout_total": out.total,
            "stderr_total": err.total, "timed_out": timed_out, "oom_killed": oom, "duration_s": duration}


def _spawn(req, argv, with_stdin):
    code, env, cwd = req.get("python_code"), req.get("env"), req.get("cwd")
    if code is not None:
        try:
            return _ForkedPython(code, with_stdin, env or {}, cwd, bool(req.get("private")))
        except OSError:
            argv = [argv[0], "-c", code]  # the zygote is gone: a fresh interpreter, never our fork
    return subprocess.Popen(argv, stdin=subprocess.PIPE if with_stdin else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env,
                            start_new_session=True)


class _Streams:
    """A command's stdin (fed from ``stdin``) and its capped stdout/stderr, pumped by one selector."""

    def __init__(self, proc, stdin, limit):
        self.proc, self.out, self.err = proc, _Capped(limit), _Capped(limit)
        self.sel = selectors.DefaultSelector()
        self.sinks = {proc.stdout.fileno(): self.out, proc.stderr.fileno(): self.err}
        for fd in self.sinks:
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ)
        self.pending = memoryview(stdin) if stdin else None
        if proc.stdin is not None:
            if self.pending:
                os.set_blocking(proc.stdin.fileno(), False)
                self.sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
            else:
                proc.stdin.close()
        try:
            self.pidfd = os.pidfd_open(proc.pid)
            self.sel.register(self.pidfd, selectors.EVENT_READ)
        except (AttributeError, OSError):
            self.pidfd = None

    def pump_until_exit(self, deadline):
        """Move bytes until the command exits; True when ``deadline`` came first."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return True
            wait = remaining if self.pidfd is not None else min(remaining, 0.01)
            for key, _ in self.sel.select(wait):
                if key.fd == self.pidfd:
                    return False
                self._pump(key.fd)
            if self.pidfd is None and self.proc.poll() is not None:
                return False

    def drain_and_close(self):
        """Close stdin, read what escaped grandchildren still write for at most ``_DRAIN_S``, close all."""
        proc = self.proc
        if self.pidfd is not None:
            self.sel.unregister(self.pidfd)
            os.close(self.pidfd)
        if proc.stdin is not None and not proc.stdin.closed:
            with contextlib.suppress(KeyError, ValueError):
                self.sel.unregister(proc.stdin.fileno())
            with contextlib.suppress(OSError):
                proc.stdin.close()
        drain_until = time.monotonic() + _DRAIN_S
        while self.sel.get_map() and time.monotonic() < drain_until:
            for key, _ in self.sel.select(max(0.0, drain_until - time.monotonic())):
                self._pump(key.fd)
        self.sel.close()
        proc.stdout.close()
        proc.stderr.close()

    def _pump(self, fd):
        if fd in self.sinks:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return
            if data:
                self.sinks[fd].add(data)
            else:
                self.sel.unregister(fd)
        elif self.proc.stdin is not None and fd == self.proc.stdin.fileno():
            try:
                n = os.write(fd, self.pending[:65536])
                self.pending = self.pending[n:]
            except BlockingIOError:
                return
            except BrokenPipeError:
                self.pending = None
            if not self.pending:
                self.sel.unregister(fd)
                self.proc.stdin.close()


def reset(req):
    if not _CONTAINED:
        return {"ok": False, "why": "reset kills every process of this uid: only inside a sandbox (--contained)"}
    killed = _kill_every_other_agent_process()
    _Zygote.renew()  # the spare was killed with the rest
    if not killed:
        return {"ok": False, "why": "agent processes survived SIGKILL"}
    _remove_sysv_ipc()
    paths = [path for path, _ in req["paths"]]
    for path, mode in req["paths"]:
        _wipe(path)
        with contextlib.suppress(PermissionError):  # ours under bubblewrap, root's in Docker
            os.chmod(path, mode)
    left = [f"{root}/{name}" for root in paths if os.path.isdir(root) for name in os.listdir(root)]
    return {"ok": not left, "why": f"left behind: {left[:5]}" if left else ""}


def _kill_every_other_agent_process():
    uid, spared = os.getuid(), (os.getpid(), 1, _Zygote.pid)
    deadline = time.monotonic() + _RESET_KILL_S
    try:
        while True:
            # kill(-1) reaches every process this uid may signal, except the caller and its namespace's
            # init. It stops them all (the zygote too), so none can fork while each but the zygote is killed.
            with contextlib.suppress(OSError):
                os.kill(-1, signal.SIGSTOP)
            left = [p for p in _live_pids_of(uid) if p not in spared]
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            _reap()
            if not left:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
    finally:
        if _Zygote.pid is not None:
            with contextlib.suppress(OSError):
                os.kill(_Zygote.pid, signal.SIGCONT)


def _live_pids_of(uid):
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if int(fields.get("Uid", "-1 ").split()[0]) == uid and fields.get("State", "").split()[:1] not in (["Z"], ["X"]):
            pids.append(int(name))
    return pids


def _remove_sysv_ipc():
    # IPC_RMID is allowed to an object's creator even after IPC_SET gave it away, and the agent is the
    # only creator in this IPC namespace.
    ctl = {"shm": lambda i: _LIBC.shmctl(i, _IPC_RMID, None), "msg": lambda i: _LIBC.msgctl(i, _IPC_RMID, None),
           "sem": lambda i: _LIBC.semctl(i, 0, _IPC_RMID)}
    for kind, remove in ctl.items():
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                ids = [int(line.split()[1]) for line in f.readlines()[1:] if line.strip()]
        except OSError:
            continue
        for ident in ids:
            remove(ident)


def _wipe(root):
    """Empty ``root``, first giving back owner access to every directory a command chmodded shut."""
    with contextlib.suppress(OSError):
        os.chmod(root, 0o700)  # the work dir is the agent's; /tmp and /dev/shm are root's and refuse
    for parent, dirs, _ in os.walk(root):  # top-down: each directory is opened after its chmod
        for d in dirs:
            path = os.path.join(parent, d)
            if not os.path.islink(path):
                with contextlib.suppress(OSError):
                    os.chmod(path, 0o700)
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def write(req):
    for path, data, mode in req["files"]:
        parent = os.path.dirname(path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        # No following a link or opening a FIFO the agent left under this name.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK, mode)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            os.set_blocking(fd, True)
            view = memoryview(base64.b64decode(data))
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
    return {"ok": True}


def read(req):
    path, max_bytes = req["path"], int(req["max_bytes"])
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        return {"missing": True}
    except PermissionError:
        return {"denied": True}
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # a symlink, or a socket
            return {"special": True}
        raise
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            return {"isdir": True}
        if not stat.S_ISREG(mode):
            return {"special": True}
        os.set_blocking(fd, True)
        parts, got = [], 0
        while got <= max_bytes:
            chunk = os.read(fd, min(max_bytes + 1 - got, 1 << 20))
            if not chunk:
                break
            parts.append(chunk)
            got += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(parts)
    return {"data": base64.b64encode(data[:max_bytes]).decode(), "truncated": len(data) > max_bytes}


def _read_exact(fd, n):
    buf = bytearray()  # not bytes +=: that is quadratic for multi-MB write_files requests
    while len(buf) < n:
        chunk = os.read(fd, min(n - len(buf), 1 << 20))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def main(argv):
    global _CONTAINED
    _CONTAINED = "--contained" in argv
    # Non-dumpable: a process of the same uid without CAP_SYS_PTRACE can no longer open this one's
    # /proc/<pid>/fd, read or write its memory or trace it, so no command can reach the protocol stream.
    _set_dumpable(False)
    # Keep the protocol streams on private fds so no command can inherit or scribble on them.
    rfd, wfd = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    _Zygote.start(protocol_fds=(rfd, wfd))  # before the first request: it must never hold one
    ops = {"run": run, "reset": reset, "write": write, "read": read, "ping": lambda req: {"pid": os.getpid()}}
    while True:
        head = _read_exact(rfd, 4)
        if head is None:
            return
        body = _read_exact(rfd, struct.unpack(">I", head)[0])
        if body is None:
            return
        req = json.loads(body)
        try:
            resp = ops[req["op"]](req)
        except Exception as exc:  # a bad request must not kill the executor
            resp = {"error": f"{type(exc).__name__}: {exc}"}
        data = json.dumps(resp).encode()
        data = struct.pack(">I", len(data)) + data
        while data:
            data = data[os.write(wfd, data):]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
