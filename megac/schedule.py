"""``Schedule``: the compiled result for one schedule key (spec, rows, context bucket).

Interface (stable; the verifier, the artifact writer, the cost model, the CPU
VM and the CLI read it)::

    Schedule
      spec_name: str
      rows: int                     batch rows
      context: int                  the bucket's upper bound this was built for
      buckets: list[int]            every context bucket served (identical split signature)
      order: str                    wave order name (schedules/<order>.yaml)
      num_sms: int
      tasks: int32 [num_sms, max_tasks, 32]   SM s runs tasks[s, :task_counts[s]] in order
      task_counts: int32 [num_sms]
      counters: list[Counter]       counters[i].index == i
      num_counters: int
      waves: dict[str, list[tuple[str, int]]]  layer kind -> [(wave name, tasks in one layer of that kind)];
                                    keys "<yaml kind>:<attention>" ("moe:sliding", "dense:full",
                                    "sequential_dense:full", ...) and "final" (the LM head);
                                    interleaved waves are named "interleave(a,b)"
      layer_kinds: list[str]        the waves key of each layer
      tasks_per_opcode: dict[str, int]
      tasks_per_sm: dict[str, float] {"min", "max", "mean"}
      plan: BufferPlan
      geometry: Geometry
      global_order: int32 [n_tasks, 2]  (sm, slot) of global task k (the topological list)
      task_node: int32 [n_tasks]         index into node_names of global task k
      node_names: list[str]              op node names ("L3.qkv", "lm_head", ...)
      pass_times: dict[str, float]       seconds per pass (pipeline)

    Counter(index, name, producer, layer, count, count_word, note)
      count: exact signals per step when static, else None;
      count_word: when count is None, the target word (index) holding it;
      a counter signalled by claimed tasks has producer = the claimer node.

    BufferPlan(buffers: dict[str, BufferSpec], weights: dict[str, WeightLayout],
               reset: list[str])
      BufferSpec(name, dtype, shape, nbytes, kind, lifetime, guards,
                 reset_per_step, doc)
        kind: "schedule" | "weight" | "kv" | "activation" | "scratch" |
              "control" | "scalar"
        lifetime: (first writer wave, last reader wave) as "L{l}.{wave}"
                  strings; None for buffers not written in the step
        guards: names of the counters whose waits order its readers
      WeightLayout(name, shape, dtype, layout: str, segments)
      reset: descriptor names zeroed before every step (counters, queue_heads)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from megac.geometry import Geometry


def schedule_key(rows: int, context: int) -> str:
    """The name of one schedule key (batch size, context bucket) in artifacts
    and generated headers."""
    return f"bs{rows}_ctx{context}"


@dataclass(frozen=True)
class Counter:
    index: int
    name: str
    producer: str
    layer: int
    count: int | None
    count_word: int | None = None
    note: str = ""


@dataclass
class BufferSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    kind: str
    lifetime: tuple[str, str] | None = None
    guards: list[str] = field(default_factory=list)
    reset_per_step: bool = False
    doc: str = ""


@dataclass
class WeightLayout:
    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: str
    segments: list[dict] = field(default_factory=list)


@dataclass
class BufferPlan:
    buffers: dict[str, BufferSpec]
    weights: dict[str, WeightLayout]
    reset: list[str]

    @property
    def scratch_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values() if b.kind in ("activation", "scratch", "control"))


@dataclass
class Schedule:
    spec_name: str
    rows: int
    context: int
    buckets: list[int]
    order: str
    num_sms: int
    tasks: np.ndarray
    task_counts: np.ndarray
    counters: list[Counter]
    num_counters: int
    waves: dict[str, list[tuple[str, int]]]
    layer_kinds: list[str]
    tasks_per_opcode: dict[str, int]
    tasks_per_sm: dict[str, float]
    plan: BufferPlan
    geometry: Geometry
    global_order: np.ndarray
    task_node: np.ndarray
    node_names: list[str]
    pass_times: dict[str, float] = field(default_factory=dict)

    @property
    def num_tasks(self) -> int:
        return int(self.task_counts.sum())

    @property
    def max_tasks(self) -> int:
        return int(self.tasks.shape[1])

    def global_words(self) -> np.ndarray:
        """int32 [n_tasks, 32]: the tasks in global (topological) order."""
        return self.tasks[self.global_order[:, 0], self.global_order[:, 1]]

    def counter_by_name(self, name: str) -> Counter:
        for c in self.counters:
            if c.name == name:
                return c
        raise KeyError(name)

    def summary(self) -> dict:
        return {
            "spec": self.spec_name,
            "rows": self.rows,
            "context": self.context,
            "buckets": list(self.buckets),
            "order": self.order,
            "num_sms": self.num_sms,
            "num_tasks": self.num_tasks,
            "max_tasks": self.max_tasks,
            "num_counters": self.num_counters,
            "tasks_per_opcode": dict(self.tasks_per_opcode),
            "tasks_per_sm": dict(self.tasks_per_sm),
            "waves": {k: [list(w) for w in v] for k, v in self.waves.items()},
            "pass_times": dict(self.pass_times),
        }


__all__ = ["BufferPlan", "BufferSpec", "Counter", "Schedule", "WeightLayout", "schedule_key"]
