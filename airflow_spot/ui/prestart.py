"""The offline ranking of instance types for a job that has not started yet (issue 10, "before a job starts").

Before a job's first attempt there is no XCom and nothing in its store, so the UI reads the job's request
from the serialized DAG: every segment task carries a ``spot_job`` template field (its GPU request, total
steps, backend, market options, and the ``step_profile`` the job declares, if any). The ranking is the one
``airflow-spot estimate`` prints (:func:`airflow_spot.policy.estimate.rank_offers_for_job`): the declared
step time scaled to each offer's GPU by the catalog's relative throughput, with its stated uncertainty.
A job that declares no profile gets the order only: cost per unit of work relative to the best offer (the
absolute time needs one measured step time), with the catalog's throughput error as the uncertainty.
"""
from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

#: offers shown in the ranking before a job starts
RANKED_SHOWN = 10


def job_spec(session, dag_id: str) -> dict[str, Any] | None:
    """The ``spot_job`` field of the DAG's first spot segment task (serialized DAG), or None."""
    from airflow.models.serialized_dag import SerializedDagModel

    model = SerializedDagModel.get(dag_id, session=session)
    if model is None:
        return None
    data = model.data or {}
    specs = []
    for task in (data.get("dag") or {}).get("tasks") or []:
        fields = task.get("__var", task) if isinstance(task, dict) else {}
        spec = fields.get("spot_job")
        if isinstance(spec, dict) and spec.get("gpus") and spec.get("total_steps"):
            specs.append(spec)
    # every segment of a job carries the same spec; a DAG with two jobs shows the first by name
    return min(specs, key=lambda s: str(s.get("job_name") or "")) if specs else None


def ranking(spec: dict[str, Any], market=None, steps: int | None = None, limit: int = RANKED_SHOWN) -> dict[str, Any]:
    """The offline ranking for ``spec`` (a ``spot_job`` dict), cheapest expected cost first.

    :param market: the market to ask (default: the job's backend's, through :class:`SpotHook`).
    :param steps: steps to price (default: the job's total).
    :returns: ``{"steps", "basis", "offers": [...], "note", "top_uncertain"}``; each offer has
        ``expected_cost`` and ``hours`` when the job declares a profile, ``relative_cost`` (1.0 = best)
        always, and ``uncertainty``; ``top_uncertain``: the first two are closer than their uncertainty.
    """
    from airflow_spot.market.throughput import instance_throughput
    from airflow_spot.policy.estimate import PRIOR_RELATIVE_ERROR, StepTimeModel, fit_step_time, rank_offers_for_job
    from airflow_spot.policy.offers import GpuRequest

    steps = int(steps or spec.get("total_steps") or 0)
    out: dict[str, Any] = {"steps": steps, "offers": [], "note": None, "basis": None,
                           "step_profile": spec.get("step_profile") or {}}
    if steps <= 0:
        out["note"] = "The job declares no number of steps."
        return out
    try:
        if market is None:
            from airflow_spot.hooks.spot import SpotHook

            market = SpotHook(backend=spec.get("backend") or "local", market_options=spec.get("market_options") or {},
                              aws_conn_id=spec.get("aws_conn_id")).get_market()
        offers = market.offers(GpuRequest.from_dict(spec["gpus"]))
    except Exception as exc:  # noqa: BLE001 - the page shows the job even when the market is unreachable
        out["note"] = f"Offers are not available now: {exc}"
        return out
    if not offers:
        out["note"] = "No offer matches the job's GPU request now."
        return out
    profile = {g: float(t) for g, t in (spec.get("step_profile") or {}).items() if float(t) > 0}
    if profile:
        measured = {instance_throughput(g, 1): t for g, t in profile.items()}
        model = fit_step_time(measured)
        ranked = rank_offers_for_job(offers, steps, model, list(measured))
        out["basis"] = (f"declared step time {', '.join(f'{g} {t:g} s' for g, t in profile.items())} scaled by the "
                        f"catalog's relative throughput (fit: t ∝ throughput^-{model.b:.2f}); ± = the profile's "
                        f"noise on a measured GPU model, with the catalog's ~{100 * PRIOR_RELATIVE_ERROR:.0f} % on others")
    else:
        # 1 s per step on a V100: the costs are relative (only the order and the ratios mean something)
        ranked = rank_offers_for_job(offers, steps, StepTimeModel(a=0.0, b=1.0), [], profile_error=0.0)
        out["basis"] = ("no step time declared: offers ordered by price per unit of catalog throughput (preemption "
                        f"overhead included), ± = the catalog's ~{100 * PRIOR_RELATIVE_ERROR:.0f} % throughput error; "
                        "declare segment_options={'step_profile': {'T4': seconds_per_step}} for times and costs")
    best = ranked[0].expected_cost
    for e in ranked[:limit]:
        row = {**e.to_dict(), "steps": steps, "relative_cost": round(e.expected_cost / best, 4) if best > 0 else None}
        if not profile:
            row["hours"] = row["expected_cost"] = None
        out["offers"].append(row)
    out["top_uncertain"] = top_uncertain(out["offers"])
    return out


def top_uncertain(rows: list[dict[str, Any]]) -> bool:
    """Whether the first two offers' costs are closer than their stated uncertainty (the order may swap)."""
    if len(rows) < 2 or rows[0].get("relative_cost") is None:
        return False
    band = max(rows[0].get("uncertainty") or 0.0, rows[1].get("uncertainty") or 0.0)
    return rows[1]["relative_cost"] - 1.0 < band
