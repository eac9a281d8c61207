"""Pass ``encode``: SM queues -> int32 ``[num_sms, max_tasks, 32]`` + ``task_counts [num_sms]``.

SM s runs ``tasks[s, :task_counts[s]]`` in order; the rest is zero (NOP)
padding. ``max_tasks`` = the longest queue.

Ensures: the array decodes back to the global list (``tasks[sm[k], slot[k]]``
is global task k's words), padding is all zero, every live task has a
non-NOP opcode.
"""

from __future__ import annotations

import numpy as np

from megac import abi
from megac.passes import Lowering, PassError

NAME = "encode"


def requires(lw: Lowering) -> None:
    if lw.sm is None or lw.slot is None:
        raise PassError(NAME, "needs SM queues (run assign first)")


def encode_words(words: np.ndarray, sm: np.ndarray, slot: np.ndarray, num_sms: int):
    counts = np.bincount(sm, minlength=num_sms).astype(np.int32)
    max_tasks = int(counts.max()) if len(counts) else 0
    tasks = np.zeros((num_sms, max_tasks, abi.TASK_WORDS), dtype=np.int32)
    tasks[sm, slot] = words
    return tasks, counts


def decode(tasks: np.ndarray, task_counts: np.ndarray) -> list[np.ndarray]:
    """Per SM, the live task words (int32 [task_counts[s], 32])."""
    return [tasks[s, : int(task_counts[s])] for s in range(tasks.shape[0])]


def run(lw: Lowering) -> str:
    words = lw.global_words()
    lw.tasks, lw.task_counts = encode_words(words, lw.sm, lw.slot, lw.geo.num_sms)
    if lw.plan is not None and "tasks" in lw.plan.buffers:
        b = lw.plan.buffers["tasks"]
        b.shape = tuple(lw.tasks.shape)
        b.nbytes = int(lw.tasks.nbytes)
    return f"int32 {list(lw.tasks.shape)} ({lw.tasks.nbytes / 2**20:.2f} MiB)"


def ensures(lw: Lowering) -> None:
    S, T, W = lw.tasks.shape
    if W != abi.TASK_WORDS or S != lw.geo.num_sms or lw.task_counts.shape != (S,):
        raise PassError(NAME, f"bad shapes {lw.tasks.shape} / {lw.task_counts.shape}")
    words = lw.global_words()
    if not np.array_equal(lw.tasks[lw.sm, lw.slot], words):
        raise PassError(NAME, "encoded array does not decode back to the global list")
    live = np.arange(T)[None, :] < lw.task_counts[:, None]
    if (lw.tasks[~live] != 0).any():
        raise PassError(NAME, "padding after task_counts is not all zero")
    if (lw.tasks[live][:, abi.H.OPCODE] == abi.Op.NOP).any():
        raise PassError(NAME, "a live task is a NOP")


__all__ = ["NAME", "decode", "encode_words", "ensures", "requires", "run"]
