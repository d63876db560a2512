"""`LoRAManager`: the runner's adapters. Loaded adapters are kept in CPU memory (at most
`max_cpu_loras`, least recently used dropped first: a dropped one is read from its folder again
when a request needs it); those a step runs occupy one of `max_loras` resident slots (least
recently used evicted back to CPU memory when a new one needs a slot). The slots are per layer
and projection stacked tensors (kvflow.kernels.cpu.lora.LoRAProjection) sized for
`max_lora_rank`, written once when an adapter takes a slot. `batch_for` turns a step's row ->
adapter assignment into the rows per slot that the projections and the decode pass read.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvflow.kernels.cpu.lora import LoRAProjection, LoRARows
from kvflow.lora.adapter import AdapterRows, BaseShapes, LoRAAdapter, load_adapter
from kvflow.lora.layers import LoRABatch
from kvflow.lora.request import LoRARequest


@dataclass
class LoRACounters:
    loads: int = 0  # adapters read from their folder
    evictions: int = 0  # resident adapters moved out of their slot for another one
    cpu_evictions: int = 0  # loaded adapters dropped from CPU memory (--max-cpu-loras)


class LoRAManager:
    def __init__(
        self,
        shapes: BaseShapes,
        max_loras: int,
        max_cpu_loras: int,
        max_lora_rank: int,
        batch: LoRABatch,
        rows: AdapterRows | None = None,
    ) -> None:
        """`batch`: the one the projections read; its slots are created here. `rows`: the model's
        `adapter_rows` (what its load did to a module's weight rows, done to an adapter's B)."""
        self.shapes, self.batch, self.rows = shapes, batch, rows
        self.max_loras, self.max_cpu_loras, self.max_lora_rank = max_loras, max_cpu_loras, max_lora_rank
        self.cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # int id -> adapter, LRU first
        self.resident: OrderedDict[int, tuple[int, LoRAAdapter]] = OrderedDict()  # int id -> (slot, adapter)
        self.free_slots = list(range(max_loras))
        self.counters = LoRACounters()
        batch.slots = [
            {
                proj: LoRAProjection(max_loras, shape.in_features, tuple(n for _, n in shape.parts), max_lora_rank)
                for proj, shape in layer.items()
            }
            for layer in shapes
        ]

    def add(self, lora: LoRARequest) -> LoRAAdapter:
        """Load (and check) `lora` into CPU memory if it is not there; ValueError for a bad adapter."""
        held = self.cpu.get(lora.lora_int_id)
        if held is not None and (held.name, held.path) == (lora.lora_name, lora.lora_path):
            self.cpu.move_to_end(lora.lora_int_id)
            return held
        if held is not None:
            self.remove(lora.lora_int_id)  # the id now names another adapter
        adapter = load_adapter(
            lora.lora_name, lora.lora_int_id, lora.lora_path, self.shapes, self.max_lora_rank, self.rows
        )
        self.counters.loads += 1
        self.cpu[lora.lora_int_id] = adapter
        while len(self.cpu) > self.max_cpu_loras:
            old = next(i for i in self.cpu)
            self.cpu.pop(old)
            self.counters.cpu_evictions += 1
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (its slot freed); False if it was not loaded."""
        held = self.cpu.pop(lora_int_id, None)
        slot = self.resident.pop(lora_int_id, None)
        if slot is not None:
            self.free_slots.append(slot[0])
        return held is not None or slot is not None

    def _make_resident(self, lora: LoRARequest, keep: set[int]) -> tuple[int, LoRAAdapter]:
        got = self.resident.get(lora.lora_int_id)
        if got is not None and (got[1].name, got[1].path) == (lora.lora_name, lora.lora_path):
            self.resident.move_to_end(lora.lora_int_id)
            return got
        if got is not None:
            self.remove(lora.lora_int_id)
        adapter = self.add(lora)
        if not self.free_slots:
            victim = next((i for i in self.resident if i not in keep), None)
            if victim is None:
                raise RuntimeError(f"more than --max-loras {self.max_loras} adapters in one step")
            self.free_slots.append(self.resident.pop(victim)[0])
            self.counters.evictions += 1
        slot = self.free_slots.pop()
        for stacked, weights in zip(self.batch.slots, adapter.weights):
            for proj, projection in stacked.items():
                projection.set_slot(slot, weights.get(proj))
        entry = (slot, adapter)
        self.resident[lora.lora_int_id] = entry
        return entry

    def batch_for(self, rows: list[tuple[LoRARequest | None, int]]) -> bool:
        """Set the batch's rows for a step whose sequences are, in row order, (adapter or None,
        number of rows); True if any row has an adapter. The rows of one adapter form one segment."""
        self.batch.rows = None
        if all(lora is None for lora, _ in rows):
            return False
        ids = {lora.lora_int_id for lora, _ in rows if lora is not None}
        if len(ids) > self.max_loras:
            raise RuntimeError(f"{len(ids)} adapters in one step, above --max-loras {self.max_loras}")
        by_id: dict[int, list[int]] = {}
        loras: dict[int, LoRARequest] = {}
        start = 0
        for lora, n in rows:
            if lora is not None:
                by_id.setdefault(lora.lora_int_id, []).extend(range(start, start + n))
                loras[lora.lora_int_id] = lora
            start += n
        groups = [(self._make_resident(loras[i], ids)[0], r) for i, r in by_id.items()]
        self.batch.rows = LoRARows.of(groups)
        return True

    def end_step(self) -> None:
        """The step is over: no rows under adapters until the next `batch_for`."""
        self.batch.rows = None

    @property
    def resident_names(self) -> list[str]:
        return [a.name for _, a in self.resident.values()]
