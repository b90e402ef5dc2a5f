"""One process that has imported vLLM once, forking a fresh child per job (`run_child`).

Every vLLM child numbisect starts (a `bisect conditions` trial, a localisation capture, the
user's engine configuration, the live check's cold engine) used to be a new Python: about
6 s importing torch and vLLM, 4 s starting the engine (most of it importing more of vLLM)
and 2 s tearing the interpreter down at exit, around the job itself. The fork server pays
the first import once per numbisect process: it imports vLLM the way a child would
(`runner.import_vllm`), then waits for jobs; each job runs in a child forked from it. So
each configuration still has a process of its own, as the conditions search needs: no
engine, no OpenMP thread pool, no compilation config and no vLLM parallel group outlives its
job, because the server runs no torch op and starts no engine. Its threads besides its own
are native pools that stop before a fork and start again after it (numpy's OpenBLAS); a
server whose learned imports started a thread ends ("stale") and a new one, which learns
nothing, takes its place. Between jobs the server imports the modules its last child
imported (`serve`), so the next child finds vLLM's engine, worker and model code imported.
A child ends as the interpreter would, less the teardown: its threads joined, its atexit
handlers run (vLLM's shutdowns among them), stdio flushed, then `os._exit`.

Protocol, one JSON line each way on the server's stdin and stdout:
  server -> parent: {"ready": true}                        once vLLM is imported
  parent -> server: {"module", "argv", "err", "cwd", "env"} a job: `python -m MODULE ARGV...`
  server -> parent: {"pid": N}, then {"rc": code}          the child started, its exit status
                    or {"stale": true}                     (then the server ends)
The child runs with the job's environment and directory, stdin and stdout on /dev/null and
stderr on "err".

The server is started on the first job, with the environment the child would get, and is
replaced when that environment changes (variables read at import time, like
OMP_NUM_THREADS, are then right again). It dies with the process that started it, and a
child with the server (PR_SET_PDEATHSIG), so neither outlives numbisect, even under
SIGKILL. NUMBISECT_FORKSERVER=0 starts a new Python per job, as before.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
import time
import traceback

from numbisect.backends.vllm.runner import import_vllm  # the package imported it already (and torch)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """SIGKILL this process when the thread that started it ends (Linux; elsewhere nothing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def enabled() -> bool:
    return os.environ.get("NUMBISECT_FORKSERVER", "1") != "0"


class Stale(OSError):
    """The server's learned imports started a thread: it ends rather than fork with it."""


class Server:
    """The parent's handle on one fork server (`run_child` holds one per process)."""

    def __init__(self, env: dict, learn: bool = True):
        self.env = dict(env)
        self.owner = os.getpid()
        self.proc = subprocess.Popen([sys.executable, "-P", "-m", __name__, *([] if learn else ["--no-learn"])], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=self.env)
        self._buf = b""
        try:
            line = self._line(None)  # "ready", once vLLM is imported; None if the server died
        except BaseException:
            self.kill()
            raise
        self.ok = line is not None and line.get("ready") is True

    def alive(self) -> bool:
        return self.ok and self.owner == os.getpid() and self.proc.poll() is None

    def _line(self, deadline: float | None) -> dict | None:
        """The server's next line as a dict; None at its end, "timeout" past the deadline."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                return {"timeout": True}
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return None

    def run(self, module: str, argv: list[str], err_path: str, env: dict, timeout: float | None) -> int | None:
        """Run `python -m module argv...` with `env` in a forked child; its exit status, or None
        when it ran past `timeout` s (it is killed). Raises OSError when the server is gone;
        on any other exception (Ctrl-C, SIGTERM) the child and the server are killed."""
        req = {"module": module, "argv": list(argv), "err": err_path, "cwd": os.getcwd(), "env": env}
        pid = None
        try:
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
            started = self._line(None)
            if started and started.get("stale"):
                raise Stale("the fork server's learned imports started a thread")
            if not started or "pid" not in started:
                raise OSError("the fork server ended")
            pid = started["pid"]
            done = self._line(None if timeout is None else time.monotonic() + timeout)
            if done is not None and done.get("timeout"):
                os.kill(pid, signal.SIGKILL)
                done = self._line(None)  # its status, once the server has reaped it
                if not done or "rc" not in done:
                    raise OSError("the fork server ended")
                return None
            if not done or "rc" not in done:
                raise OSError("the fork server ended")
            return done["rc"]
        except BaseException:
            self.kill(pid)
            raise

    def kill(self, pid: int | None = None) -> None:
        """Kill the child `pid` (if given) and the server; wait for the server."""
        if pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.ok = False
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        """End the server (killed: between jobs it holds nothing of anyone's, and its own
        teardown would cost numbisect's exit a second or two)."""
        if self.owner != os.getpid():  # a fork of the process that started it: not ours to end
            self.ok = False
            return
        self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


_lock = threading.Lock()
_server: Server | None = None
_failed: dict | None = None  # the environment a server could not start in: not tried again
_learn = True  # servers import what their children imported, until one ends Stale
# changes between calls, read by no import: no new server for it (MASTER_PORT: a free port a sharded
# trainer's cold load picks each time, numbisect.live.sharded's `_single_process_env`)
_PER_CALL = ("PYTEST_CURRENT_TEST", "MASTER_PORT")


def _key(env: dict) -> dict:
    return {k: v for k, v in env.items() if k not in _PER_CALL}


def run(module: str, argv: list[str], err_path: str, env: dict, timeout: float | None) -> int | None:
    """Run `python -P -m module argv...` with `env`, stderr to `err_path`: in a child forked from
    the fork server (started here, or started again for another environment), else in a new
    Python (NUMBISECT_FORKSERVER=0, no server, or another thread's job running). Its exit
    status, or None when it ran past `timeout` s (then it is killed)."""
    global _server, _failed, _learn
    if enabled() and _lock.acquire(blocking=False):
        try:
            key = _key(env)
            for _ in range(2):
                if _server is not None and (not _server.alive() or _server.env != key):
                    _server.close()
                    _server = None
                if _server is None and _failed != key:
                    s = Server(key, learn=_learn)
                    if s.alive():
                        _server = s
                    else:
                        s.kill()
                        _failed = key
                if _server is None:
                    break
                try:
                    return _server.run(module, argv, err_path, env, timeout)
                except Stale:  # a new server that learns nothing runs the job
                    _server, _learn = None, False
                except OSError:  # the server died under the job: a new Python for it, as below
                    _server = None
                    break
        finally:
            _lock.release()
    with open(err_path, "wb") as err:
        try:
            return subprocess.run([sys.executable, "-P", "-m", module, *argv], stdout=subprocess.DEVNULL,
                                  stderr=err, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return None


def shutdown() -> None:
    """End this process's fork server, if it runs (at exit; tests between groups)."""
    global _server
    with _lock:
        if _server is not None:
            _server.close()
            _server = None


atexit.register(shutdown)


# The server's side.

def _child(req: dict) -> int:
    """In the forked child: the parent's environment and directory, stdio as a new Python's
    would be (stdin and stdout /dev/null, stderr the job's file), then the module as __main__."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _die_with_parent()
    os.environ.clear()
    os.environ.update(req["env"])
    null = os.open(os.devnull, os.O_RDWR)
    err = os.open(req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.dup2(err, 2)
    os.close(null)
    os.close(err)
    sys.stdin = open(os.devnull)
    if req.get("learn"):  # at exit, the modules this child imported, for the server to import in turn
        def _tell(path=req["learn"]):
            with open(path, "w") as f:
                f.write("\n".join(sys.modules))

        atexit.register(_tell)
    os.chdir(req["cwd"])
    sys.argv = [req["module"], *req["argv"]]
    try:
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _end(code: int) -> None:
    """End the child as the interpreter ends a program (its threads joined, then its atexit
    handlers: vLLM's engine and worker shutdowns among them; stdio flushed), less the
    teardown of every module and object after that: about 1.9 s of a DeepSeek-V3 fixture
    job's 6 s here, which no job's answer depends on."""
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _learn_from(path: str) -> list[str]:
    """The modules a child imported (its file, removed), less those this process has."""
    try:
        with open(path) as f:
            names = f.read().split("\n")
        os.unlink(path)
    except OSError:
        return []
    return [n for n in names if n and n not in sys.modules and n not in ("__main__", "__mp_main__")]


def _import_quietly(names: list[str]) -> None:
    """Import each module; one that fails (made at run time, like inductor's kernels) is left."""
    for n in names:
        if n not in sys.modules:
            try:
                importlib.import_module(n)
            except BaseException:  # a module made at run time, or one that only imports in an engine
                pass


def serve(learn: bool = True) -> int:
    """Import vLLM, say "ready", then fork a child per job line until stdin ends. With
    `learn`, after each job import what its child imported (a child's engine start imports
    vLLM's engine, worker and model modules, about 2.7 s of a 4.3 s start on DeepSeek-V3
    here), so the next child finds them imported. A server whose learned imports started a
    thread says "stale" at the next job and ends instead of forking with it. (Its thread count
    is compared around those imports, not with its start: OpenBLAS stops its own pool before
    each fork and starts it again when next used.)"""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it kills the child
    _die_with_parent()
    if os.getppid() == 1:  # the parent is gone already
        return 0
    out = os.fdopen(os.dup(1), "w")  # the protocol; vLLM logs to stdout, which goes to /dev/null
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
    try:
        import_vllm()
    except BaseException:  # no server: the parent starts a new Python per job, which says why
        return 1
    stale = False
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            req = json.loads(line)
        except ValueError:
            return 1
        if stale:
            out.write(json.dumps({"stale": True}) + "\n")
            out.flush()
            return 0
        if learn:
            req["learn"] = req["err"] + ".modules"
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            out.close()
            _end(_child(req))
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
        _, status = os.waitpid(pid, 0)
        names = _learn_from(req["learn"]) if learn else []
        out.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        out.flush()
        if names:  # while the parent reads the answer
            before = _threads()
            _import_quietly(names)
            stale = _threads() > before  # a module that started a thread: no more forks from here
    return 0


if __name__ == "__main__":
    sys.exit(serve(learn="--no-learn" not in sys.argv[1:]))
