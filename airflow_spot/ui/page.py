"""HTML of the Spot Training pages: server-rendered, no JavaScript build, an inline SVG chart.

Pages are plain HTML so they work inside the Airflow UI's iframe (``external_views``) and in a headless
browser alike; a running job's page reloads itself every few seconds (``<meta http-equiv="refresh">``).
Everything shown comes from a :meth:`~airflow_spot.storage.job_view.JobView.snapshot` dict.
"""
from __future__ import annotations

import datetime as dt
from html import escape
from typing import Any
from urllib.parse import quote

#: seconds between reloads of a running job's page
REFRESH_SECONDS = 5

_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:16px;color:#1f2933;background:#fff}
h1{font-size:20px;margin:0 0 8px}h2{font-size:16px;margin:20px 0 6px}
table{border-collapse:collapse;margin:4px 0}td,th{border-bottom:1px solid #e4e7eb;padding:3px 9px;text-align:left}
th{background:#f5f7fa;font-weight:600}td.n{text-align:right;font-variant-numeric:tabular-nums}
.cards{display:flex;flex-wrap:wrap;gap:10px}
.card{border:1px solid #d9e2ec;border-radius:6px;padding:8px 12px;min-width:130px}
.card b{display:block;font-size:18px}.muted{color:#7b8794}
.bar{height:10px;background:#e4e7eb;border-radius:5px;width:320px}
.bar>div{height:10px;background:#2f80ed;border-radius:5px}
tr.preempted td,tr.lost td{background:#fff4e5}tr.failed td{background:#fde8e8}tr.running td{background:#e8f4fd}
.tag{border-radius:3px;padding:0 5px;font-size:12px}.spot{background:#e3f9e5}.on-demand{background:#fcefc7}
"""


def _money(v: Any) -> str:
    return "–" if v is None else f"${float(v):,.4f}"


def _time(ts: Any) -> str:
    if ts is None:
        return "–"
    return dt.datetime.fromtimestamp(float(ts), tz=dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")  # noqa: UP017 - python 3.10


def _duration(seconds: Any) -> str:
    if seconds is None:
        return "–"
    s = int(round(float(seconds)))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else (f"{m}m {s:02d}s" if m else f"{s}s")


def _size(n: Any) -> str:
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _doc(title: str, body: str, refresh: bool) -> str:
    meta = f'<meta http-equiv="refresh" content="{REFRESH_SECONDS}">' if refresh else ""
    return (
        f'<!doctype html><html><head><meta charset="utf-8">{meta}<title>{escape(title)}</title>'
        f"<style>{_STYLE}</style></head><body>{body}</body></html>"
    )


def jobs_page(jobs: list[dict[str, Any]], base: str = "/spot") -> str:
    """The list of jobs (the "Spot Training" navigation entry)."""
    rows = []
    for j in jobs:
        href = f"{base}/jobs/{quote(j['dag_id'], safe='')}/{quote(j['run_id'], safe='')}"
        progress = j.get("progress")
        rows.append(
            f"<tr><td>{escape(j['dag_id'])}</td><td><a href=\"{escape(href)}\">{escape(j['run_id'])}</a></td>"
            f"<td>{escape(str(j.get('state') or '–'))}</td>"
            f"<td class=n>{'–' if progress is None else f'{100 * progress:.1f} %'}</td>"
            f"<td class=n>{_money(j.get('cost'))}</td><td class=n>{_money(j.get('savings'))}</td>"
            f"<td class=n>{j.get('preemptions', '–')}</td><td class=muted>{escape(j.get('error') or '')}</td></tr>"
        )
    table = (
        "<table id=jobs><tr><th>DAG</th><th>run</th><th>state</th><th>progress</th><th>cost</th><th>savings</th>"
        "<th>preemptions</th><th></th></tr>" + "".join(rows) + "</table>"
        if rows else "<p id=jobs class=muted>No spot training job has started yet.</p>"
    )
    running = any(j.get("state") == "running" for j in jobs)
    return _doc("Spot Training", f"<h1>Spot Training</h1>{table}", refresh=running)


def chart_svg(series: list[dict[str, Any]], total_steps: int | None, width: int = 640, height: int = 200) -> str:
    """Cost (orange, left axis) and committed steps (blue, right axis) over time, as one inline SVG."""
    if len(series) < 2:
        return '<p class=muted id=chart>Not enough points for a chart yet.</p>'
    t0, t1 = series[0]["time"], series[-1]["time"]
    span = max(t1 - t0, 1e-9)
    cmax = max(max(p["cost"] for p in series), 1e-9)
    smax = max(total_steps or 0, max(p["step"] for p in series), 1)
    pad, w, h = 40, width - 80, height - 40

    def path(key: str, vmax: float) -> str:
        pts = [f"{pad + (p['time'] - t0) / span * w:.1f},{20 + h - p[key] / vmax * h:.1f}" for p in series]
        return "M" + " L".join(pts)

    return (
        f'<svg id=chart xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
        f'aria-label="cost and progress over time">'
        f'<rect x="{pad}" y="20" width="{w}" height="{h}" fill="none" stroke="#cbd2d9"/>'
        f'<path d="{path("cost", cmax)}" fill="none" stroke="#f2994a" stroke-width="2"/>'
        f'<path d="{path("step", smax)}" fill="none" stroke="#2f80ed" stroke-width="2"/>'
        f'<text x="{pad}" y="14" font-size="11" fill="#f2994a">cost (max {_money(cmax)})</text>'
        f'<text x="{pad + w}" y="14" font-size="11" fill="#2f80ed" text-anchor="end">steps (of {smax})</text>'
        f'<text x="{pad}" y="{height - 4}" font-size="11" fill="#7b8794">{_time(t0)}</text>'
        f'<text x="{pad + w}" y="{height - 4}" font-size="11" fill="#7b8794" text-anchor="end">'
        f"{_duration(span)} later</text></svg>"
    )


def _attempt_rows(attempts: list[dict[str, Any]]) -> str:
    out = []
    for a in attempts:
        outcome = a.get("outcome") or "running"
        mark = " &#9889; preemption" if a.get("preemption") else ""
        market = a.get("market") or ""
        steps = (
            f"{a.get('resume_step')}→{a.get('end_step')}" if a.get("resume_step") is not None else "–"
        )
        out.append(
            f'<tr class="attempt {escape(outcome)}"><td>{a.get("segment_index", "–")}</td>'
            f"<td>{escape(a.get('attempt_id') or '')}</td><td>{escape(a.get('instance_type') or '–')}</td>"
            f"<td>{escape(a.get('zone') or '–')}</td>"
            f"<td><span class='tag {escape(market)}'>{escape(market)}</span></td>"
            f"<td class=n>{'–' if a.get('price_per_hour') is None else _money(a['price_per_hour']) + '/h'}</td>"
            f"<td>{_time(a.get('started_at'))}</td><td>{_time(a.get('ended_at'))}</td>"
            f"<td>{escape(outcome)}{mark}</td><td class=n>{steps}</td>"
            f"<td class=n>{'–' if a.get('steps_done') is None else a['steps_done']}</td>"
            f"<td class=n>{'–' if a.get('steps_lost') is None else a['steps_lost']}</td>"
            f"<td class=n>{_money(a.get('cost'))}</td></tr>"
        )
    return "".join(out)


def _offer_rows(offers: list[dict[str, Any]]) -> str:
    out = []
    for o in offers:
        band = "" if o.get("uncertainty") is None else f" ±{100 * o['uncertainty']:.0f} %"
        hours = "–" if o.get("hours") is None else _duration(o["hours"] * 3600)
        out.append(
            f"<tr><td>{escape(o['instance_type'])}</td><td>{escape(o['zone'])}</td><td>{escape(o['market'])}</td>"
            f"<td>{escape(o['gpu_name'])} x{o['gpu_count']}</td><td class=n>{_money(o['price_per_hour'])}/h</td>"
            f"<td class=n>{o.get('preemption_rate_per_hour', 0):.3f}/h</td><td class=n>{hours}</td>"
            f"<td class=n>{_money(o.get('expected_cost'))}{band}</td></tr>"
        )
    return "".join(out)


def ranking_html(ranking: dict[str, Any] | None) -> str:
    """The offline ranking of instance types before the job starts (:mod:`airflow_spot.ui.prestart`)."""
    if not ranking:
        return ""
    rows = ranking.get("offers") or []
    head = "<h2>Ranking of instance types before the job starts</h2>"
    basis = f"<p class=muted id=ranking-basis>{escape(ranking.get('basis') or '')}</p>"
    if not rows:
        return f"{head}<p class=muted id=ranking>{escape(ranking.get('note') or 'No offer known.')}</p>"
    out = []
    for i, o in enumerate(rows, 1):
        band = "" if o.get("uncertainty") is None else f" ±{100 * o['uncertainty']:.0f} %"
        hours = "–" if o.get("hours") is None else _duration(o["hours"] * 3600)
        rel = "–" if o.get("relative_cost") is None else f"{o['relative_cost']:.2f}×"
        out.append(
            f"<tr class=ranked><td class=n>{i}</td><td>{escape(o['instance_type'])}</td><td>{escape(o['zone'])}</td>"
            f"<td>{escape(o['market'])}</td><td>{escape(o['gpu_name'])} x{o['gpu_count']}</td>"
            f"<td class=n>{_money(o['price_per_hour'])}/h</td><td class=n>{hours}</td>"
            f"<td class=n>{_money(o.get('expected_cost'))}</td><td class=n>{rel}{band}</td></tr>"
        )
    close = ""
    if ranking.get("top_uncertain"):
        band = max(rows[0].get("uncertainty") or 0.0, rows[1].get("uncertainty") or 0.0)
        close = (f"<p class=muted id=ranking-close>The first two are {100 * (rows[1]['relative_cost'] - 1):.0f} % "
                 f"apart, within the stated ±{100 * band:.0f} %: their order is not certain.</p>")
    return (
        f"{head}{basis}<table id=ranking><tr><th>#</th><th>instance</th><th>zone</th><th>market</th><th>GPU</th>"
        f"<th>price</th><th>time for {ranking.get('steps', '?')} steps</th><th>expected cost</th>"
        f"<th>cost vs best</th></tr>" + "".join(out) + f"</table>{close}"
    )


def job_page(dag_id: str, run_id: str, snap: dict[str, Any], offers: list[dict[str, Any]] | None,
             offers_error: str | None = None, ranking: dict[str, Any] | None = None) -> str:
    """One job: cards, progress, estimate, chart, attempts timeline, checkpoints, offers (and, before the
    job's first attempt, the offline ranking of instance types)."""
    est = snap.get("estimate") or {}
    total = snap.get("total_steps")
    progress = snap.get("progress")
    pct = "–" if progress is None else f"{100 * progress:.1f} %"
    cards = [
        ("state", escape(str(snap.get("state")))),
        ("progress", f"{snap.get('current_step')} / {total if total else '?'} steps ({pct})"),
        ("cost so far", _money(snap.get("cost")) + (
            f" <span class=muted id=transfers>of which checkpoint transfers {_money(snap['transfer_dollars'])}</span>"
            if snap.get("transfer_dollars") else "")),
        ("on-demand cost of the same work", _money(snap.get("on_demand_cost"))),
        ("savings", f"{_money(snap.get('savings'))} ({100 * (snap.get('savings_fraction') or 0):.1f} %)"),
        ("preemptions", str(snap.get("preemptions", 0))),
        ("steps lost", str(snap.get("steps_lost", 0))),
        ("remaining time", (_duration(est.get("remaining_seconds")) + (
            f" ± {_duration(est['spread_seconds'])}" if est.get("spread_seconds") else ""))
         if snap.get("state") != "finished" else "done"),
        ("remaining cost", _money(est.get("remaining_cost")) if snap.get("state") != "finished" else "$0"),
    ]
    card_html = "".join(
        f'<div class=card id="card-{escape(label.split()[0])}">'
        f"<span class=muted>{escape(label)}</span><b>{value}</b></div>"
        for label, value in cards
    )
    bar = f"<div class=bar><div style='width:{100 * (progress or 0):.1f}%'></div></div>"
    basis = f"<p class=muted id=estimate>Estimate: {escape(est['basis'])}</p>" if est.get("basis") else ""
    attempts = snap.get("attempts") or []
    timeline = (
        "<table id=attempts><tr><th>segment</th><th>attempt</th><th>instance</th><th>zone</th><th>market</th>"
        "<th title='a finished spot attempt: the price in effect over its run'>price</th><th>start (UTC)</th><th>end (UTC)</th><th>outcome</th><th>steps</th><th>kept</th><th>lost</th>"
        "<th>cost</th></tr>"
        + _attempt_rows(attempts) + "</table>"
        if attempts else "<p class=muted id=attempts>No attempt yet.</p>"
    )
    cps = snap.get("checkpoints") or []
    cp_table = (
        "<table id=checkpoints><tr><th>step</th><th>time (UTC)</th><th>size</th><th>writer</th></tr>"
        + "".join(
            f"<tr><td class=n>{c['step']}</td><td>{_time(c['time'])}</td><td class=n>{_size(c['size'])}</td>"
            f"<td>{escape(str(c.get('writer', '')))}</td></tr>" for c in cps
        ) + "</table>"
        if cps else "<p class=muted id=checkpoints>No committed checkpoint yet.</p>"
    )
    if offers:
        offer_html = (
            "<table id=offers><tr><th>instance</th><th>zone</th><th>market</th><th>GPU</th><th>price</th>"
            f"<th>preemptions</th><th>time for {offers[0].get('steps', '?')} steps</th><th>expected cost</th></tr>"
            + _offer_rows(offers) + "</table>"
        )
    else:
        offer_html = f"<p class=muted id=offers>{escape(offers_error or 'No offers known for this job.')}</p>"
    summary_note = ""
    if snap.get("summary"):
        summary_note = (
            "<p class=muted>Savings compare the cost with what the same kept work costs on demand of the same "
            "instance type; time a preemption threw away earns no savings.</p>"
        )
    body = (
        f"<p><a href='/spot/'>&larr; all jobs</a></p><h1>{escape(dag_id)} / {escape(run_id)}</h1>"
        f"<p class=muted>store: {escape(str(snap.get('job_uri')))}</p><div class=cards>{card_html}</div>"
        f"{ranking_html(ranking)}"
        f"<h2>Progress</h2>{bar}{basis}<h2>Cost and progress over time</h2>{chart_svg(snap.get('series') or [], total)}"
        f"<h2>Attempts</h2>{timeline}{summary_note}<h2>Checkpoints</h2>{cp_table}"
        f"<h2>Cheapest offers now for this job's GPU request</h2>{offer_html}"
    )
    return _doc(f"Spot Training: {dag_id} / {run_id}", body, refresh=snap.get("state") in ("running", "waiting") or (
        snap.get("state") == "not started" and snap.get("run_state") in ("queued", "running")))
