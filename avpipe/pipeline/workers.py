"""avpipe's worker processes: every process avpipe starts for work comes from here.

Two kinds, one face (:class:`Process`: ``pid``, ``alive``, ``exitcode``, ``signal``,
``kill()``, ``join()``):

- :class:`Worker`, for the feeds (the audio loader's decode pool and the GPU FLAC loader's
  readers, the video feeds' scan-ahead): a fresh interpreter (``python -c``, through
  ``subprocess``) that imports avpipe and answers ``(fn, args)`` requests on a pipe. Unlike a
  ``multiprocessing`` child (spawn or fork server), it never imports the caller's
  ``__main__``: a user's training script without an ``if __name__ == "__main__":`` guard is not
  run again in it (with a fork server it was, once per worker: the script's whole loop, in every
  reader). It is never a fork of the calling process either, which may hold threads (a feed's
  producer, BLAS threads) whose locks a fork would copy held. :class:`WorkerPool` drives a few
  of them from threads of its own, each waiting for its worker's answers with the GIL
  released; a worker that dies or does not answer is :class:`WorkerLost` and replaced.
- :class:`Job`, for extraction: one long call, ``target(*args)``, in a ``multiprocessing``
  child, spawned, or forked (:func:`fork_is_safe`) for a CPU job started ahead of its work,
  its modules already imported. Extraction needs what a request/answer worker does not give:
  a fork (a spawned interpreter spends most of a second starting and importing before a CPU
  job's first shard), and a ``multiprocessing`` queue the child reports progress through, a
  message at a time while it runs. Being a ``multiprocessing`` child, a spawned one imports
  the caller's ``__main__``: a script calling ``run_extract`` needs the ``if __name__ ==
  "__main__":`` guard (``avpipe extract``'s ``__main__`` is avpipe's own).

Both die with their parent (:func:`die_with_parent`, Linux), so a killed run leaves no process
writing behind the next one's back, and both report how they ended the same way: ``exitcode``
(None while running), ``signal`` (the signal that ended it, else None).

The shared memory the feeds' workers write into is :mod:`._shared_memory`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import subprocess
import sys
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection

__all__ = ["Process", "Worker", "WorkerPool", "WorkerLost", "Job", "job_queue", "job_pipe",
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


# --- Job: one long call in a multiprocessing child (extraction) --------------------------------

def job_queue():
    """A queue a :class:`Job` reports through: spawn's, which reaches forked and spawned
    children alike (a fork context's queue cannot reach a spawned process)."""
    return mp.get_context("spawn").Queue()


def job_pipe():
    """A one-way pipe ``(receiving end, sending end)`` to a :class:`Job` (its work, sent
    once it is known)."""
    return mp.Pipe(duplex=False)


class Job(Process):
    """``target(*args)`` in a child process, started at once with SIGINT ignored
    (:class:`sigint_ignored`): spawned, or forked with ``fork=True`` (only where
    :func:`fork_is_safe`: CPU work, no other thread). ``target`` calls :func:`die_with_parent`
    first thing."""

    def __init__(self, target, args: tuple = (), *, fork: bool = False):
        ctx = mp.get_context("fork" if fork else "spawn")
        self.forked = bool(fork)
        self._p = ctx.Process(target=target, args=args, daemon=False)
        with sigint_ignored():
            self._p.start()

    @property
    def pid(self) -> int:
        return self._p.pid

    @property
    def exitcode(self) -> int | None:
        return self._p.exitcode

    def kill(self) -> None:
        self._p.kill()

    def join(self, timeout: float | None = None) -> None:
        self._p.join(timeout)


# --- Worker: a request/answer process that never imports the caller's __main__ ---------------

_BOOT = ("import sys; from avpipe.pipeline.workers import _serve; "
         "_serve(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))")
_ABANDONED: list = []  # workers that did not die when killed (a read stuck in the kernel)


def ping():
    """A request that only proves the worker is up (a reader's first request)."""
    return True


def _serve(rfd: int, wfd: int, parent: int) -> None:
    """A worker's loop: ``(fn, args)`` requests in, ``("ok", fn(*args))`` or ``("error",
    exception)`` out, until the parent closes the pipe (or dies: SIGKILL, Linux)."""
    if not die_with_parent(parent):
        return
    inp, out = Connection(rfd, writable=False), Connection(wfd, readable=False)
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
            out.send(ans)
        except (OSError, ValueError):
            return
        except Exception as e:  # noqa: BLE001 - an answer or error that does not pickle
            try:
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


class Worker(Process):
    """One worker process (the module docstring): :meth:`send` a ``(fn, args)`` request
    (``fn`` importable by name), :meth:`poll` / :meth:`recv` its answer, ``("ok", value)`` or
    ``("error", exception)``; ``EOFError`` / ``OSError`` once it is gone."""

    def __init__(self):
        self.answered = False  # set by its users once it has answered a request
        r_req, w_req = os.pipe()
        r_ans, w_ans = os.pipe()
        env = dict(os.environ)
        path = [p for p in sys.path if isinstance(p, str) and p]
        if path:  # what this process can import, the worker can (avpipe included)
            env["PYTHONPATH"] = os.pathsep.join(path)
        try:
            self.proc = _Spawner.popen(
                [sys.executable, "-c", _BOOT, str(r_req), str(w_ans), str(os.getpid())],
                pass_fds=(r_req, w_ans), stdin=subprocess.DEVNULL, env=env)
        except BaseException:
            for fd in (r_req, w_req, r_ans, w_ans):
                os.close(fd)
            raise
        os.close(r_req)
        os.close(w_ans)
        self._out = Connection(w_req, readable=False)
        self._in = Connection(r_ans, writable=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

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

    def stop(self, timeout: float = 2.0) -> None:
        """Close its pipes and kill it; one that does not die within ``timeout`` (a read stuck
        in the kernel) is left behind, not waited for."""
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
