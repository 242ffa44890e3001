"""Rule rewards under a time limit (algorithm.reward_timeout_s), as verl's prime reward manager scores them: the rows
of a batch are scored side by side in worker processes, and a row still running after the limit is given up while
its worker is killed and replaced. A rule that loops forever on one odd response (a regular expression's
backtracking, a symbolic comparison of huge numbers, a user's own function) then costs one row's score, not the run.

The workers come from a fork server: a clean process started once, never a fork of the trainer, whose memory (an
offloaded optimizer state, CUDA and NCCL threads) a forked worker would hold on to or inherit locks of. Each worker
builds every rule from its recipe (a picklable call that loads it, as the trainer did) when it starts, so loading
counts against no row's limit. A worker told to stop runs its cleanup (a code reward's program is killed, its folder
removed). A ScoreError raised in a worker is the row's: the caller raises it naming the row.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import context as mp_context
from multiprocessing import popen_forkserver, spawn
from typing import Any

from pebble import ProcessExpired, ProcessPool

from alignrl.rewards.errors import ScoreError
from alignrl.rewards.registry import reads_prompt_text, score_row
from alignrl.rewards.values import TimedOut
from alignrl.runtime.cores import usable_cores
from alignrl.utils.tracking import console
from alignrl.utils.user_files import VERL_PROVIDERS

_RECIPES: list[Callable[[], Callable[..., Any]]] = []  # every rule's recipe, by number (this process)
_RULES: list[Any] = []  # in a worker: the rules its recipes built, or the one-line error of one that did not load
_LAUNCH = threading.Lock()  # one worker's start at a time (_Popen)


class _Stopped(BaseException):
    """A worker told to stop while a rule runs: raised where the rule is, so its `finally` blocks run."""


_SCORING = [False]  # in a worker: whether a rule is running


def _run(number: int, args: tuple) -> Any:
    """In a worker: rule `number` on one row."""
    rule = _RULES[number]
    if isinstance(rule, ScoreError):
        return rule
    _SCORING[0] = True
    try:
        return score_row(rule, *args)
    except _Stopped:  # unwound (a code reward has killed its program, removed its folder): now go
        os._exit(1)
    finally:
        _SCORING[0] = False


def _stop(signum, frame):
    if _SCORING[0]:
        raise _Stopped
    os._exit(0)  # idle: nothing to clean up


def _start_worker(recipes: list) -> None:
    """A worker's start: one torch thread (workers side by side must not oversubscribe the cores), a stop that
    unwinds, and every rule built."""
    signal.signal(signal.SIGTERM, _stop)
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:  # torch is not needed to score text
        pass
    _RULES[:] = [_built(recipe) for recipe in recipes]


def _built(recipe):
    """The rule, or the one line saying why it cannot be loaded (a recipe of an earlier run in this process whose
    file has gone is then a problem only if that rule is asked for)."""
    try:
        return recipe()
    except Exception as e:  # noqa: BLE001 (any failure of a user's file to load: said as one line, by row)
        text = f"{type(e).__name__}: {e}".splitlines()[0]
        return ScoreError("the rule reward", f"could not be loaded in a reward worker ({text})", "any",
                          "check the reward file and its imports")


class _Popen(popen_forkserver.Popen):
    """Starts a worker without the main module's preparation: spawn's children import the main script again (a
    script without a `__main__` guard would run in every worker), and a rule comes from its recipe, never from
    it."""

    def _launch(self, process_obj):
        with _LAUNCH:
            real = spawn.get_preparation_data
            spawn.get_preparation_data = lambda name: {k: v for k, v in real(name).items()
                                                       if not k.startswith("init_main_from")}
            try:
                super()._launch(process_obj)
            finally:
                spawn.get_preparation_data = real


class _Process(mp_context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)


class _Context(mp_context.ForkServerContext):
    Process = _Process


RESTART_S = 2.0  # a worker forked from the fork server is up well within this


class _Workers:
    """The process's worker pool, started at its first batch and again when rules were added since."""

    def __init__(self):
        self.pool, self.rules, self.size = None, 0, 0
        self.replaced_at = -RESTART_S  # when a worker was last killed (pebble starts another at once)
        self.at_exit = False

    def get(self, size: int):
        if self.pool is None or self.rules != len(_RECIPES) or self.size != size:
            self.close()
            context = _Context()
            # the server imports the recipes' modules and those a user's file is given (verl's APIs) once; each
            # worker forked from it then starts at once (one replaced after a timeout too)
            modules = {__name__, *(getattr(r, "func", r).__module__ for r in _RECIPES),
                       *(provider.partition(":")[0] for provider in VERL_PROVIDERS)}
            context.set_forkserver_preload(sorted(modules))
            self.pool = ProcessPool(max_workers=size, initializer=_start_worker, initargs=(list(_RECIPES),),
                                    context=context)
            self.rules, self.size = len(_RECIPES), size
            if not self.at_exit:  # registered after multiprocessing's own exit handler, so it runs before it
                atexit.register(self.close)
                self.at_exit = True
        return self.pool

    def close(self) -> None:
        """No task is pending here (a batch waits for all its rows), but a worker may still be starting in place of
        one killed at the last timeout: closing waits for its start (closing during it makes it fail loudly), then
        lets the workers end in order; one that hangs is stopped."""
        if self.pool is not None:
            time.sleep(max(0.0, self.replaced_at + RESTART_S - time.monotonic()))  # a replacement's start, done
            self.pool.close()
            try:
                self.pool.join(timeout=30)
            except TimeoutError:
                self.pool.stop()
                self.pool.join(timeout=10)
            self.pool = None


_WORKERS = _Workers()


def _recipe_key(recipe) -> tuple:
    """What makes two recipes the same: the function and its arguments (a partial has no equality of its own)."""
    return getattr(recipe, "func", recipe), getattr(recipe, "args", ()), getattr(recipe, "keywords", {})


def _number(recipe: Callable[[], Callable[..., Any]]) -> int:
    """The recipe's number among this process's, registered once (an equal recipe, e.g. the evaluation's rule and
    the reward stage's, shares its number and its workers)."""
    for i, known in enumerate(_RECIPES):
        if _recipe_key(known) == _recipe_key(recipe):
            return i
    _RECIPES.append(recipe)
    return len(_RECIPES) - 1


class TimedRule:
    """A rule function called as it is (one row, in this process) and, by the reward stage and the evaluation, on a
    batch of rows through `rows`: in workers, each row under `timeout_s` (`workers` of them; 0: this rank's share of
    the usable cores). A row past the limit scores 0 (verl's prime manager), or, with `give_up=False` (a cost, which
    cannot be guessed), is a ScoreError. `timed_out` counts the rows past it since the last `take_timeouts`."""

    def __init__(self, fn: Callable[..., Any], recipe: Callable[[], Callable[..., Any]], timeout_s: float,
                 workers: int = 0, give_up: bool = True):
        self.fn, self.timeout_s, self.workers, self.give_up = fn, timeout_s, workers, give_up
        self.number = _number(recipe)
        self.reads_prompt = reads_prompt_text(fn)
        self.__name__ = getattr(fn, "__name__", repr(fn))
        self.timed_out = 0
        self.last: tuple[list, list] | None = None  # the last batch and its values: a shaped reward asks again

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def rows(self, calls: Sequence[tuple]) -> list[Any]:
        """score_row's value for each (data_source, solution_str, ground_truth, extra_info, prompt). A row whose rule
        raised a ScoreError, ran past the limit of a rule that must not give up, or whose worker died (killed from
        outside, out of memory) holds a ScoreError for the caller to raise naming the row."""
        calls = [tuple(c) for c in calls]
        if self.last is not None and _same_rows(self.last[0], calls):
            return list(self.last[1])
        pool = _WORKERS.get(self.workers or max(1, usable_cores() // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        futures = [pool.schedule(_run, args=(self.number, c), timeout=self.timeout_s) for c in calls]
        out = [self._value(future, call) for future, call in zip(futures, calls)]
        self.last = (calls, out)
        return list(out)

    def _value(self, future, call: tuple) -> Any:
        try:
            return future.result()
        except FutureTimeout:
            self.timed_out += 1
            _WORKERS.replaced_at = time.monotonic()
            if self.give_up:
                return TimedOut(0.0)
            return ScoreError(self.__name__, f"ran past algorithm.reward_timeout_s={self.timeout_s:g} s",
                              str(call[0]), "a cost cannot be guessed: raise the limit or make it return sooner")
        except ScoreError as e:
            return e
        except (ProcessExpired, BrokenProcessPool, RuntimeError) as e:  # the worker, or the pool, ended
            _WORKERS.replaced_at = time.monotonic()
            text = f"{type(e).__name__}: {e}".splitlines()[0]
            return ScoreError(self.__name__, f"lost its worker process ({text})", str(call[0]),
                              "check the machine's memory, or whether something killed the worker")

    def take_timeouts(self) -> int:
        n, self.timed_out = self.timed_out, 0
        return n


def _same_rows(a: list[tuple], b: list[tuple]) -> bool:
    """Whether two batches of calls are the same rows: equal texts, the very same ground truths and extra_info (held
    by the memo, so never another object at a reused address; compared by identity, as an array in them has no
    truth value)."""
    return len(a) == len(b) and all(x[0] == y[0] and x[1] == y[1] and x[2] is y[2] and x[3] is y[3] and x[4] == y[4]
                                    for x, y in zip(a, b))


def timed(fn: Callable[..., Any], recipe: Callable[[], Callable[..., Any]], timeout_s: float, workers: int = 0,
          give_up: bool = True) -> Callable[..., Any]:
    """`fn` under a time limit per row in worker processes, which build it from `recipe` (TimedRule); `fn` itself
    when `timeout_s` is 0."""
    return fn if timeout_s <= 0 else TimedRule(fn, recipe, timeout_s, workers, give_up)


def late_rows(fns: Sequence[Callable[..., Any] | None]) -> int | None:
    """Rows of the distinct timed rules among `fns` that ran past their limit since the last call; None when none of
    them is timed."""
    timed_rules = {id(f): f for f in fns if isinstance(f, TimedRule)}.values()
    return sum(f.take_timeouts() for f in timed_rules) if timed_rules else None


def say_timeouts(where: str, late: int | None, limit_s: float) -> None:
    """One line when rows ran past the limit (`late`, from late_rows)."""
    if late:
        console.print(f"{where}: {late} row(s) ran past algorithm.reward_timeout_s={limit_s:g} s and scored 0 (their "
                      "worker processes were replaced)", markup=False)
