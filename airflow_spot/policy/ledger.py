"""The cost ledger: one row per attempt, billed by the provider's rule, summed per job.

Billing (AWS, Linux): per second, with a 60 s minimum each time an instance starts. A row on a warm
instance reused from the previous segment (``new_instance=False``) continues that instance's bill, so
the minimum does not apply again. A spot instance pays the price in effect while it runs, so a row's
``price_per_hour`` is the price's time-weighted mean over the attempt (:func:`mean_price`) where the
market keeps a price history, as the simulator bills a replayed attempt at each tick's price.

Per row, ``lost_seconds`` is paid time that left no kept progress: for an attempt with a known mean
step time, its duration minus ``steps_done * step_seconds`` (boot, restore, saves, the lost steps);
otherwise the share of the attempt's steps that were lost (all of it when no step was kept), and
nothing for a completed attempt.

The job's ``on_demand_cost`` is what an on-demand instance of the same type pays for the same work
(``on_demand_seconds``): a completed attempt's whole bill, since an on-demand run of that segment boots,
restores, saves and meets the billing minimum too; of any other attempt only its kept steps, and of a
completed attempt that restarted a segment after a preemption (:func:`summarize`) only its kept steps too:
an on-demand run would not have restarted. So the time a preemption threw away, and the restart it cost,
are never credited as savings, while the overheads any run pays do not turn a spot discount into a loss. Totals are sums over rows. Pure maths: rows come from the store through
:mod:`airflow_spot.storage.ledger_store`.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields

from airflow_spot.policy.offers import Market

#: AWS per-second billing minimum for Linux instances (EC2 docs, "per-second billing")
AWS_MINIMUM_BILLED_SECONDS = 60.0

LEDGER_SCHEMA_VERSION = 1

PREEMPTION_OUTCOMES = ("preempted", "lost")


def billed_seconds(duration_seconds: float, new_instance: bool = True,
                   minimum_seconds: float = AWS_MINIMUM_BILLED_SECONDS) -> float:
    """Seconds billed for ``duration_seconds`` of running: whole seconds, with the minimum on a new instance."""
    if duration_seconds < 0:
        raise ValueError(f"duration must be >= 0, got {duration_seconds!r}")
    secs = float(math.ceil(duration_seconds - 1e-9))
    return max(secs, minimum_seconds) if new_instance else secs


def mean_price(changes: Iterable[tuple[float, float]], start: float, end: float, quoted: float) -> float:
    """The time-weighted mean $/h over ``[start, end]`` of a price that changed at ``changes``
    (``(epoch seconds, $/h)``, any order).

    Each price holds from its change until the next one. The newest change at or before ``start`` is the
    price in effect at the start; with none, ``quoted`` (the price the attempt was launched at) holds
    until the first change inside the window. Changes at or after ``end`` are not billed.
    """
    if end < start:
        raise ValueError(f"the window ends before it starts: start={start!r}, end={end!r}")
    ordered = sorted((float(t), float(p)) for t, p in changes)
    for t, p in ordered:
        if p < 0 or not math.isfinite(p):
            raise ValueError(f"a price must be a finite $/h >= 0, got {p!r} at {t!r}")
    price = quoted
    for t, p in ordered:
        if t <= start:
            price = p
    if end == start:
        return price
    dollars, since = 0.0, start
    for t, p in ordered:
        if start < t < end:
            dollars += (t - since) * price
            since, price = t, p
    dollars += (end - since) * price
    return dollars / (end - start)


@dataclass(frozen=True)
class LedgerRow:
    """One attempt of one segment on one instance."""

    attempt_id: str
    instance_id: str
    instance_type: str
    zone: str
    market: str
    price_per_hour: float
    on_demand_price_per_hour: float
    started_at: float
    ended_at: float
    steps_done: int
    outcome: str
    region: str = ""
    segment_index: int = 0
    new_instance: bool = True
    steps_lost: int = 0
    gpu_count: int = 1
    step_seconds: float | None = None
    #: when the instance's preemption notice reached the training process (None: no notice seen)
    notice_at: float | None = None
    #: egress of moving the checkpoint to or from another region for this attempt ($, in ``cost``)
    transfer_dollars: float = 0.0
    schema_version: int = LEDGER_SCHEMA_VERSION

    def __post_init__(self) -> None:
        object.__setattr__(self, "market", Market(self.market).value)
        if self.ended_at < self.started_at:
            raise ValueError(f"ledger row {self.attempt_id}: ended_at {self.ended_at} is before started_at {self.started_at}")
        if self.price_per_hour < 0 or self.on_demand_price_per_hour < 0:
            raise ValueError(f"ledger row {self.attempt_id}: prices must be >= 0")
        if not self.transfer_dollars >= 0:
            raise ValueError(f"ledger row {self.attempt_id}: transfer_dollars must be >= 0")
        if self.steps_done < 0 or self.steps_lost < 0:
            raise ValueError(f"ledger row {self.attempt_id}: step counts must be >= 0")

    @property
    def duration_seconds(self) -> float:
        return self.ended_at - self.started_at

    @property
    def billed_seconds(self) -> float:
        return billed_seconds(self.duration_seconds, self.new_instance)

    @property
    def cost(self) -> float:
        return self.billed_seconds / 3600.0 * self.price_per_hour + self.transfer_dollars

    @property
    def lost_seconds(self) -> float:
        if self.step_seconds is not None:
            return max(0.0, self.billed_seconds - self.steps_done * self.step_seconds)
        if self.outcome == "completed":
            return 0.0
        tried = self.steps_done + self.steps_lost
        return self.billed_seconds * (self.steps_lost / tried if tried else 1.0)

    @property
    def useful_seconds(self) -> float:
        return self.billed_seconds - self.lost_seconds

    @property
    def on_demand_seconds(self) -> float:
        """What an on-demand instance of the same type bills for what this attempt left behind: a completed
        attempt's whole bill (the same boot, restore, saves and minimum), another's kept time only."""
        return self.billed_seconds if self.outcome == "completed" else self.useful_seconds

    @property
    def on_demand_cost(self) -> float:
        """The same work at the on-demand price of the same instance type (``on_demand_seconds``)."""
        return self.on_demand_seconds / 3600.0 * self.on_demand_price_per_hour

    @property
    def is_preemption(self) -> bool:
        return self.outcome in PREEMPTION_OUTCOMES

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(billed_seconds=self.billed_seconds, cost=round(self.cost, 6))
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LedgerRow":
        names = {f.name for f in fields(cls)}
        version = d.get("schema_version", LEDGER_SCHEMA_VERSION)
        if version > LEDGER_SCHEMA_VERSION:
            raise ValueError(f"ledger row schema {version} is newer than this code's {LEDGER_SCHEMA_VERSION}; upgrade airflow-spot")
        return cls(**{k: v for k, v in d.items() if k in names})  # derived fields (cost, ...) are recomputed


def notice_evidence(rows: Iterable[LedgerRow]) -> tuple[int, int]:
    """What the job's preemptions showed of its notices: ``(covered, missed)``.

    A preempted (or lost) attempt that had trained is covered when its notice reached the training
    process and it lost no step (the emergency save committed in the window), missed otherwise. One that
    never trained had nothing to lose and tells nothing.
    """
    covered = missed = 0
    for r in rows:
        if r.outcome not in PREEMPTION_OUTCOMES or (r.steps_done == 0 and r.steps_lost == 0):
            continue
        if r.notice_at is not None and r.steps_lost == 0:
            covered += 1
        else:
            missed += 1
    return covered, missed


@dataclass(frozen=True)
class JobSummary:
    attempts: int
    preemptions: int
    cost: float
    on_demand_cost: float
    spot_cost: float
    billed_seconds: float
    gpu_hours: float
    lost_gpu_hours: float
    steps_done: int
    steps_lost: int
    #: of ``cost``: checkpoints restored from and saved to a store in another region
    transfer_dollars: float = 0.0
    #: spot instances launched only to learn whether their pool has capacity, and of ``cost`` their bill
    probes: int = 0
    probe_dollars: float = 0.0
    #: of ``cost``: warm instances between their last attempt and their termination (no attempt ran)
    idle_seconds: float = 0.0
    idle_dollars: float = 0.0

    @property
    def savings(self) -> float:
        return self.on_demand_cost - self.cost

    @property
    def savings_fraction(self) -> float:
        return self.savings / self.on_demand_cost if self.on_demand_cost > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(savings=self.savings, savings_fraction=self.savings_fraction)
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in d.items()}


def summarize(rows: Iterable[LedgerRow], probes: Iterable[LedgerRow] = (),
              idle: Iterable[LedgerRow] = ()) -> JobSummary:
    """Job totals: every figure is the sum of the rows' figures. ``probes`` (rows of spot instances
    launched only to learn whether their pool has capacity, ``LedgerStore.write_probe``) add their bill to
    ``cost`` and ``spot_cost``, as the simulator charges them, and to nothing else: they did no work. So do
    ``idle`` rows (``LedgerStore.write_idle``: a warm instance's time after its last attempt), to ``cost``
    and, for a spot instance, ``spot_cost``."""
    rows, probes, idle = list(rows), list(probes), list(idle)
    probe_dollars = sum(p.cost for p in probes)
    idle_dollars = sum(r.cost for r in idle)
    return JobSummary(
        attempts=len(rows),
        preemptions=sum(r.is_preemption for r in rows),
        cost=sum(r.cost for r in rows) + probe_dollars + idle_dollars,
        on_demand_cost=sum(_on_demand_cost(r, rows) for r in rows),
        spot_cost=(sum(r.cost for r in rows if r.market == Market.SPOT.value) + probe_dollars
                   + sum(r.cost for r in idle if r.market == Market.SPOT.value)),
        billed_seconds=sum(r.billed_seconds for r in rows),
        gpu_hours=sum(r.billed_seconds * r.gpu_count for r in rows) / 3600.0,
        lost_gpu_hours=sum(r.lost_seconds * r.gpu_count for r in rows) / 3600.0,
        steps_done=sum(r.steps_done for r in rows),
        steps_lost=sum(r.steps_lost for r in rows),
        transfer_dollars=sum(r.transfer_dollars for r in rows),
        probes=len(probes),
        probe_dollars=probe_dollars,
        idle_seconds=sum(r.billed_seconds for r in idle),
        idle_dollars=idle_dollars,
    )


def credited_seconds(row: LedgerRow, rows: list[LedgerRow]) -> float:
    """``row.on_demand_seconds``, except that a completed attempt which restarted its segment after a
    preemption is credited only its kept steps: its boot, restore and billing minimum are the preemption's
    cost (an on-demand run would have gone on), not savings. ``rows``: the job's rows."""
    if row.outcome == "completed" and restarted_segment(row.segment_index, row.started_at, rows):
        return row.useful_seconds
    return row.on_demand_seconds


def restarted_segment(segment_index: int, started_at: float | None, attempts) -> bool:
    """Whether an attempt of segment ``segment_index`` that started at ``started_at`` came after a preemption
    of that segment. ``attempts``: ledger rows, or anything with ``is_preemption``, ``segment_index`` and
    ``ended_at`` (the page's attempts without a row yet)."""
    return started_at is not None and any(
        r.is_preemption and r.segment_index == segment_index and r.ended_at is not None and r.ended_at <= started_at
        for r in attempts)


def _on_demand_cost(row: LedgerRow, rows: list[LedgerRow]) -> float:
    return credited_seconds(row, rows) / 3600.0 * row.on_demand_price_per_hour


#: the name the Airflow layer uses
totals = summarize
