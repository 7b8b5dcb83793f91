"""avpipe's worker processes: every process avpipe starts for work comes from here.

One kind, :class:`Worker`, for every user: the audio loader's decode pool and the GPU FLAC
loader's readers, the video feeds' scan-ahead, and extraction's workers. A worker answers
``(fn, args)`` requests on a pipe (``fn`` importable by name): ``("ok", fn(*args))`` or
``("error", exception)``. While a call runs, ``fn`` (any thread of the worker) may send the
parent messages, :func:`tell`, which arrive as ``("msg", payload)`` before the call's answer
(extraction's progress, its watchdog's "stuck"); :func:`wait` waits on several workers at
once. :class:`WorkerPool` drives a few workers from threads of its own, each waiting for its
worker's answers with the GIL released; a worker that dies or does not answer is
:class:`WorkerLost` and replaced.

A worker is a fresh interpreter (``python -c``, through ``subprocess``) that imports avpipe and
what each request's function needs (``env``: variables of its own, such as a GPU worker's
``CUDA_VISIBLE_DEVICES``). It never imports the caller's ``__main__``: a user's script without
an ``if __name__ == "__main__":`` guard is not run again in it (a ``multiprocessing`` spawn or
fork-server child runs it once per worker), whether it trains through a feed or calls
``run_extract``. It is not a fork of the calling process either, which may hold threads (a
feed's producer, BLAS threads) whose locks a fork would copy held.

One case is forked instead (``fork=True``, honoured only where :func:`fork_is_safe`: Linux, no
thread but the caller's main one): a CPU extraction worker started ahead of its work. A fresh
interpreter spends most of a second starting and importing before a CPU job's first shard;
the fork has every module already imported. It runs the same request loop and ends the same
way.

Every worker dies with its parent (:func:`die_with_parent`, Linux), so a killed run leaves no
process writing behind the next one's back, starts with SIGINT ignored (:class:`sigint_ignored`:
a Ctrl-C reaches the parent alone, which ends them), and reports how it ended through
:class:`Process`: ``exitcode`` (None while running), ``signal`` (the signal that ended it,
else None).

The shared memory the feeds' workers write into is :mod:`._shared_memory`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as _wait_connections

__all__ = ["Process", "Worker", "WorkerPool", "WorkerLost", "tell", "wait", "exit_now",
           "can_start_processes", "fork_is_safe", "die_with_parent", "sigint_ignored", "ping"]


def can_start_processes() -> bool:
    """False inside a daemonic process (a torch DataLoader worker): avpipe keeps to threads
    there, as a ``multiprocessing`` child would have to."""
    return not mp.current_process().daemon


def fork_is_safe() -> bool:
    """Whether a CPU worker may be forked from this process: Linux (fork is the platform's
    own), and no Python thread but the calling main one (a thread holding a lock at the fork
    would leave it held forever in the child)."""
    return (sys.platform.startswith("linux") and "fork" in mp.get_all_start_methods()
            and threading.current_thread() is threading.main_thread()
            and threading.active_count() == 1)


def die_with_parent(parent: int) -> bool:
    """In a worker: ask Linux for SIGKILL when the parent dies (``PR_SET_PDEATHSIG``); False
    when the parent ``parent`` is already gone (the caller then ends)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))
    except (OSError, AttributeError):  # not Linux: the pipe's end or the queue still ends it
        pass
    return os.getppid() == parent


class sigint_ignored:
    """Start processes inside this block: they begin with SIGINT ignored (Python keeps an
    inherited "ignore" at start-up), so a Ctrl-C reaches the parent alone, which ends them,
    instead of printing a KeyboardInterrupt traceback from every worker. Only the main thread
    may change signal handlers; elsewhere this does nothing."""

    def __enter__(self):
        import signal

        self.old = None
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGINT, signal.SIG_IGN)

    def __exit__(self, *exc):
        import signal

        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)


class Process:
    """What every avpipe worker process answers: its ``pid``, whether it is ``alive``, its
    ``exitcode`` (None while it runs; negative: the signal that ended it), that ``signal``,
    :meth:`kill` and :meth:`join`."""

    @property
    def pid(self) -> int:
        raise NotImplementedError

    @property
    def exitcode(self) -> int | None:
        raise NotImplementedError

    @property
    def alive(self) -> bool:
        return self.exitcode is None

    @property
    def signal(self) -> int | None:
        code = self.exitcode
        return -code if code is not None and code < 0 else None

    def kill(self) -> None:
        raise NotImplementedError

    def join(self, timeout: float | None = None) -> None:
        raise NotImplementedError


# --- Worker: a request/answer process that never imports the caller's __main__ ---------------

# (SIGINT ignored first thing too: a worker started from a thread other than the main one
# does not inherit it, see sigint_ignored; and the working directory, which ``-c`` puts first
# on the path, taken off it: the worker imports what the parent's path gives, PYTHONPATH, not
# an ``avpipe`` folder that happens to be in the directory the parent was started from)
_BOOT = """
import signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
if sys.path[:1] == [""]:
    del sys.path[0]
from avpipe.pipeline.workers import _serve
_serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
"""
_ABANDONED: list = []  # workers that did not die when killed (a read stuck in the kernel)
# the parent's ends of every worker's pipes, which a forked worker closes (it must not hold
# another worker's request pipe open, nor its answer pipe)
_LIVE: weakref.WeakSet = weakref.WeakSet()
# in a worker: its answer pipe and the lock every send to it takes (tell() from any thread)
_CHANNEL: list = []


def ping():
    """A request that only proves the worker is up (a reader's first request)."""
    return True


def tell(payload) -> None:
    """In a worker, during a call: send ``payload`` to the parent now, as ``("msg",
    payload)`` ahead of the call's answer. Any thread may; once it returns the message is in
    the pipe (a worker may ``os._exit`` right after). RuntimeError outside a worker."""
    if not _CHANNEL:
        raise RuntimeError("workers.tell() is for a function running in a worker process")
    out, lock = _CHANNEL
    with lock:
        out.send(("msg", payload))


def exit_now(code: int = 0) -> None:
    """A request that ends the worker at once, ``os._exit(code)`` after its standard streams
    are flushed: no interpreter tear-down (module and pool clean-up, CuPy's memory pools) for
    the parent's join to wait for. It sends no answer."""
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


def _serve(rfd: int, wfd: int, parent: int) -> None:
    """A worker's loop: ``(fn, args)`` requests in, ``("ok", fn(*args))`` or ``("error",
    exception)`` out (after any :func:`tell` messages), until the parent closes the pipe (or
    dies: SIGKILL, Linux)."""
    if not die_with_parent(parent):
        return
    inp, out = Connection(rfd, writable=False), Connection(wfd, readable=False)
    lock = threading.Lock()
    _CHANNEL[:] = [out, lock]
    while True:
        try:
            fn, args = inp.recv()
        except (EOFError, OSError):
            return
        try:
            ans = ("ok", fn(*args))
        except BaseException as e:  # noqa: BLE001 - answered; the worker goes on
            ans = ("error", e)
        try:
            with lock:
                out.send(ans)
        except (OSError, ValueError):
            return
        except Exception as e:  # noqa: BLE001 - an answer or error that does not pickle
            try:
                with lock:
                    out.send(("error", RuntimeError(f"{type(e).__name__}: {e}")))
            except (OSError, ValueError):
                return


class _Spawner:
    """Starts processes from one daemon thread that lives as long as this process. A worker
    asks for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), and Linux sends it when the
    *thread* that started the worker ends: a worker started from a short-lived thread (a
    window's reader thread replacing a dead reader, a loader made in a thread) was killed with
    that thread."""

    _current = None
    _lock = threading.Lock()

    def __init__(self):
        self.pid = os.getpid()
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="avpipe-spawner", daemon=True).start()

    def _run(self):
        while True:
            fut, args, kwargs = self.q.get()
            try:
                fut.set_result(subprocess.Popen(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - the caller's exception
                fut.set_exception(e)

    @classmethod
    def popen(cls, *args, **kwargs) -> subprocess.Popen:
        with cls._lock:
            sp = cls._current
            if sp is None or sp.pid != os.getpid():  # (a fork's child has no such thread)
                sp = cls._current = cls()
        fut: Future = Future()
        sp.q.put((fut, args, kwargs))
        return fut.result()


class _Forked:
    """A forked worker, as ``subprocess.Popen`` shows a started one: ``pid``, ``poll()``
    (the exit code, negative for a signal; None while it runs), ``wait(timeout)``
    (``subprocess.TimeoutExpired``), ``kill()``; reaped with ``waitpid``."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped elsewhere (os.wait in the caller's code)
                    self.returncode = 255
                else:
                    if pid:
                        self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while self.poll() is None:
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:
            import signal

            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _forked_child(r_req: int, w_req: int, r_ans: int, w_ans: int, parent: int,
                  env: dict | None) -> None:
    """The forked worker's whole life: it closes the parent's ends (its own and every other
    worker's), takes ``env``, serves requests, and leaves with ``os._exit`` (the parent's
    ``atexit`` handlers and buffers are the parent's, not to run twice)."""
    code = 0
    try:
        _Spawner._current = None  # the parent's spawner thread is not in this process
        for w in list(_LIVE):
            for c in (w._out, w._in):
                try:
                    c.close()
                except OSError:
                    pass
        os.close(w_req)
        os.close(r_ans)
        if env:
            os.environ.update(env)
        _serve(r_req, w_ans, parent)
    except BaseException:  # noqa: BLE001 - reported by the exit code
        code = 1
    exit_now(code)


class Worker(Process):
    """One worker process (the module docstring): :meth:`send` a ``(fn, args)`` request
    (``fn`` importable by name), :meth:`poll` / :meth:`recv` what comes back: ``("msg",
    payload)`` for each :func:`tell` of the call, then its answer, ``("ok", value)`` or
    ``("error", exception)``; ``EOFError`` / ``OSError`` once it is gone. ``env``: variables
    the worker's environment adds to this process's. ``fork``: a fork of this process instead
    of a fresh interpreter, where :func:`fork_is_safe` (else a fresh one; ``forked`` says which)."""

    def __init__(self, *, env: dict | None = None, fork: bool = False):
        self.answered = False  # set by its users once it has answered a request
        self.forked = bool(fork) and fork_is_safe()
        r_req, w_req = os.pipe()
        r_ans, w_ans = os.pipe()
        parent = os.getpid()
        try:
            if self.forked:
                self.proc = self._fork(r_req, w_req, r_ans, w_ans, parent, env)
            else:
                full = dict(os.environ)
                path = [p for p in sys.path if isinstance(p, str) and p]
                if path:  # what this process can import, the worker can (avpipe included)
                    full["PYTHONPATH"] = os.pathsep.join(path)
                full.update(env or {})
                with sigint_ignored():
                    self.proc = _Spawner.popen(
                        [sys.executable, "-c", _BOOT, str(r_req), str(w_ans), str(parent)],
                        pass_fds=(r_req, w_ans), stdin=subprocess.DEVNULL, env=full)
        except BaseException:
            for fd in (r_req, w_req, r_ans, w_ans):
                os.close(fd)
            raise
        os.close(r_req)
        os.close(w_ans)
        self._out = Connection(w_req, readable=False)
        self._in = Connection(r_ans, writable=False)
        _LIVE.add(self)

    @staticmethod
    def _fork(r_req, w_req, r_ans, w_ans, parent, env) -> _Forked:
        for s in (sys.stdout, sys.stderr):  # nothing buffered is written twice
            try:
                s.flush()
            except (OSError, ValueError, AttributeError):
                pass
        with sigint_ignored():
            pid = os.fork()
            if pid == 0:
                _forked_child(r_req, w_req, r_ans, w_ans, parent, env)  # never returns
        return _Forked(pid)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    @property
    def connection(self) -> Connection:
        """The end its answers and messages arrive on (for :func:`wait`)."""
        return self._in

    def kill(self) -> None:
        self.proc.kill()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def send(self, request) -> None:
        self._out.send(request)

    def poll(self, timeout: float) -> bool:
        return self._in.poll(timeout)

    def recv(self):
        got = self._in.recv()
        self.answered = True
        return got

    def end(self, timeout: float = 60.0) -> None:
        """Ask it to leave at once (:func:`exit_now`, exit code 0), wait up to ``timeout``
        seconds, then :meth:`stop` it."""
        try:
            self._out.send((exit_now, (0,)))
        except (OSError, ValueError):
            pass
        self.join(timeout)
        self.stop()

    def stop(self, timeout: float = 2.0) -> None:
        """Close its pipes and kill it; one that does not die within ``timeout`` (a read stuck
        in the kernel) is left behind, not waited for."""
        _LIVE.discard(self)
        for c in (self._out, self._in):
            try:
                c.close()
            except OSError:
                pass
        if self.proc.poll() is None:
            try:
                self.proc.kill()
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _ABANDONED.append(self.proc)
            except OSError:
                pass


def wait(workers, timeout: float | None = None) -> list:
    """The workers among ``workers`` with something to :meth:`~Worker.recv` (a message, an
    answer, or the end of a worker that died), waiting up to ``timeout`` seconds for one."""
    by_conn = {w.connection: w for w in workers}
    return [by_conn[c] for c in _wait_connections(list(by_conn), timeout)]


class WorkerLost(RuntimeError):
    """A worker died, or did not answer within the pool's ``answer_s`` (it was replaced)."""


class WorkerPool:
    """``workers`` :class:`Worker` processes, each driven by a thread of its own:
    :meth:`submit` ``(fn, *args)`` returns a ``concurrent.futures.Future`` of ``fn(*args)`` run
    in a worker (its exception, if it raised; :class:`WorkerLost` if the worker died or gave no
    answer within ``answer_s`` seconds: that worker is replaced). Workers start with the first
    request their thread takes. :meth:`close` (also when collected) cancels what has not
    started and stops the workers."""

    def __init__(self, workers: int, *, answer_s: float = 120.0, name: str = "avpipe-worker"):
        self.answer_s = float(answer_s)
        self._threads = ThreadPoolExecutor(max(1, int(workers)), thread_name_prefix=name)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._state = {"workers": [], "closed": False, "failed_starts": 0}
        self._finalizer = weakref.finalize(self, WorkerPool._shutdown, self._threads,
                                           self._state, self._lock)

    @staticmethod
    def _shutdown(threads, state, lock):
        with lock:
            state["closed"] = True
            workers, state["workers"] = state["workers"], []
        threads.shutdown(wait=False, cancel_futures=True)
        for w in workers:
            w.stop()

    # workers that end before their first answer, in a row, after which the pool gives up
    # (this interpreter cannot start them: submit raises RuntimeError)
    MAX_FAILED_STARTS = 3

    def _worker(self) -> Worker:
        w = getattr(self._local, "worker", None)
        if w is None:
            with self._lock:
                if self._state["closed"]:
                    raise WorkerLost("the worker pool is closed")
                w = self._local.worker = Worker()
                self._state["workers"].append(w)
        return w

    def _drop(self, w: Worker) -> None:
        self._local.worker = None
        with self._lock:
            if w in self._state["workers"]:
                self._state["workers"].remove(w)
            if w.answered:
                self._state["failed_starts"] = 0
            else:
                self._state["failed_starts"] += 1
        w.stop()

    @property
    def broken(self) -> bool:
        return self._state["failed_starts"] >= self.MAX_FAILED_STARTS

    def _call(self, fn, args):
        w = self._worker()
        try:
            w.send((fn, args))
        except (OSError, ValueError) as e:
            self._drop(w)
            raise WorkerLost(f"a worker process is gone ({type(e).__name__})") from None
        # (a request that does not pickle raises before a byte is sent: the worker owes nothing)
        try:
            if w.poll(self.answer_s):
                kind, value = w.recv()
                with self._lock:
                    self._state["failed_starts"] = 0
                if kind == "ok":
                    return value
                raise value
            why = f"no answer from a worker process within {self.answer_s:g} s"
        except (EOFError, OSError):
            why = "a worker process died"
        self._drop(w)
        raise WorkerLost(why)

    def submit(self, fn, *args) -> Future:
        if self.broken:
            raise RuntimeError(f"avpipe's worker processes do not start here ({sys.executable} "
                               f"-c ...: {self.MAX_FAILED_STARTS} ended before answering)")
        return self._threads.submit(self._call, fn, args)

    def close(self) -> None:
        self._finalizer()
