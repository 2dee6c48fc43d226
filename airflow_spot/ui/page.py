"""HTML of the Spot Training pages: server-rendered, no JavaScript build, an inline SVG chart.

Pages are plain HTML so they work inside the Airflow UI's iframe (``external_views``) and in a headless
browser alike; a running job's page reloads itself every few seconds (``<meta http-equiv="refresh">``).
Everything shown comes from a :meth:`~airflow_spot.storage.job_view.JobView.snapshot` dict.

Every value put into the HTML is escaped (:func:`_e`), numbers included: ids, instance types, error
messages and whatever else a job's store or a request holds may contain ``<``.
"""
from __future__ import annotations

import datetime as dt
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

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
tr.preempted td,tr.lost td{background:#fff4e5}tr.failed td{background:#fde8e8}tr.running td{background:#e8f4fd}tr.abandoned td{background:#f0f0f0}
.tag{border-radius:3px;padding:0 5px;font-size:12px}.spot{background:#e3f9e5}.on-demand{background:#fcefc7}
.warn{background:#fff4e5;border-left:4px solid #f2994a;padding:6px 10px}tr.broken td{background:#fde8e8}
"""


def _e(v: Any) -> str:
    """``v`` as HTML text (an attribute value too): ``str`` then escaped."""
    return escape(str(v))


def _money(v: Any) -> str:
    if v is None:
        return "–"
    try:
        return f"${float(v):,.4f}"
    except (TypeError, ValueError):  # a store's object holding a non-number: shown as it is
        return _e(v)


def _time(ts: Any) -> str:
    if ts is None:
        return "–"
    try:
        return dt.datetime.fromtimestamp(float(ts), tz=dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")  # noqa: UP017 - python 3.10
    except (TypeError, ValueError, OverflowError, OSError):
        return _e(ts)


def _duration(seconds: Any) -> str:
    if seconds is None:
        return "–"
    s = int(round(float(seconds)))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h {m:02d}m {s:02d}s" if h else (f"{m}m {s:02d}s" if m else f"{s}s")


def _size(n: Any) -> str:
    try:
        n = float(n or 0)
    except (TypeError, ValueError):
        return _e(n)
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


def _pct(fraction: Any) -> str:
    if fraction is None:
        return "–"
    try:
        return f"{100 * float(fraction):.1f} %"
    except (TypeError, ValueError):
        return _e(fraction)


def _list_href(base: str, limit: int, offset: int, dag_id: str | None) -> str:
    query = urlencode({k: v for k, v in (("dag_id", dag_id), ("limit", limit), ("offset", offset)) if v is not None})
    return f"{base}/?{query}"


def _shown_note(shown: dict[str, Any] | None, count: int, base: str) -> str:
    """What the list left out: older jobs beyond its limit, and how to see them."""
    if not shown:
        return ""
    limit, offset, dag_id = shown["limit"], shown.get("offset") or 0, shown.get("dag_id")
    scope = f" of DAG {_e(dag_id)}" if dag_id else ""
    parts = []
    if offset:
        prev = _list_href(base, limit, max(0, offset - limit), dag_id)
        what = (f"Showing jobs{scope} {offset + 1} to {offset + count}, newest first" if count
                else f"No jobs{scope} beyond the {offset} newest")
        parts.append(f"{what} (<a href=\"{_e(prev)}\">newer jobs</a>).")
    if shown.get("more"):
        nxt = _list_href(base, limit, offset + limit, dag_id)
        parts.append(
            (f"Older jobs{scope} than these are not shown. " if offset else
             f"Only the {_e(limit)} newest jobs{scope} are shown: older jobs are not. ") +
            f"<a href=\"{_e(nxt)}\">Show the next {_e(limit)}</a>; <code>?limit=N</code> shows up to "
            f"{_e(shown.get('max', limit))} at once, <code>?dag_id=</code> one DAG's jobs.")
    if not parts:
        return ""
    return f"<p class=warn id=jobs-more>{' '.join(parts)}</p>"


def jobs_page(jobs: list[dict[str, Any]], base: str = "/spot", shown: dict[str, Any] | None = None) -> str:
    """The list of jobs (the "Spot Training" navigation entry).

    :param shown: what the list holds, ``{"limit", "offset", "more", "dag_id", "max"}``: the page says
        when older jobs are left out, and links to them."""
    rows = []
    for j in jobs:
        href = f"{base}/jobs/{quote(str(j['dag_id']), safe='')}/{quote(str(j['run_id']), safe='')}"
        rows.append(
            f"<tr><td>{_e(j['dag_id'])}</td><td><a href=\"{_e(href)}\">{_e(j['run_id'])}</a></td>"
            f"<td>{_e(j.get('state') or '–')}</td>"
            f"<td class=n>{_pct(j.get('progress'))}</td>"
            f"<td class=n>{_money(j.get('cost'))}</td><td class=n>{_money(j.get('savings'))}</td>"
            f"<td class=n>{_e(j.get('preemptions', '–'))}</td><td class=muted>{_e(j.get('error') or '')}</td></tr>"
        )
    table = (
        "<table id=jobs><tr><th>DAG</th><th>run</th><th>state</th><th>progress</th><th>cost</th><th>savings</th>"
        "<th>preemptions</th><th></th></tr>" + "".join(rows) + "</table>"
        if rows else "<p id=jobs class=muted>No spot training job has started yet.</p>"
    )
    running = any(j.get("state") == "running" for j in jobs)
    return _doc("Spot Training", f"<h1>Spot Training</h1>{_shown_note(shown, len(rows), base)}{table}",
                refresh=running)


def message_page(message: str, base: str = "/spot") -> str:
    """A page that only says ``message`` (escaped: it may quote the request), with a link to the list."""
    return _doc("Spot Training", f"<p><a href='{_e(base)}/'>&larr; all jobs</a></p><h1>Spot Training</h1>"
                                 f"<p id=message class=warn>{_e(message)}</p>", refresh=False)


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
        f'<text x="{pad + w}" y="14" font-size="11" fill="#2f80ed" text-anchor="end">steps (of {_e(smax)})</text>'
        f'<text x="{pad}" y="{height - 4}" font-size="11" fill="#7b8794">{_time(t0)}</text>'
        f'<text x="{pad + w}" y="{height - 4}" font-size="11" fill="#7b8794" text-anchor="end">'
        f"{_duration(span)} later</text></svg>"
    )


def _attempt_rows(attempts: list[dict[str, Any]]) -> str:
    out = []
    for a in attempts:
        outcome = str(a.get("outcome") or "running")
        mark = " &#9889; preemption" if a.get("preemption") else ""
        market = str(a.get("market") or "")
        steps = (
            f"{_e(a.get('resume_step'))}→{_e(a.get('end_step'))}" if a.get("resume_step") is not None else "–"
        )
        out.append(
            f'<tr class="attempt {_e(outcome)}"><td>{_e(a.get("segment_index", "–"))}</td>'
            f"<td>{_e(a.get('attempt_id') or '')}</td><td>{_e(a.get('instance_type') or '–')}</td>"
            f"<td>{_e(a.get('zone') or '–')}</td>"
            f"<td><span class='tag {_e(market)}'>{_e(market)}</span></td>"
            f"<td class=n>{'–' if a.get('price_per_hour') is None else _money(a['price_per_hour']) + '/h'}</td>"
            f"<td>{_time(a.get('started_at'))}</td><td>{_time(a.get('ended_at'))}</td>"
            f"<td>{_e(outcome)}{mark}</td><td class=n>{steps}</td>"
            f"<td class=n>{'–' if a.get('steps_done') is None else _e(a['steps_done'])}</td>"
            f"<td class=n>{'–' if a.get('steps_lost') is None else _e(a['steps_lost'])}</td>"
            f"<td class=n>{_money(a.get('cost'))}</td></tr>"
        )
    return "".join(out)


def _offer_rows(offers: list[dict[str, Any]]) -> str:
    out = []
    for o in offers:
        band = "" if o.get("uncertainty") is None else f" ±{100 * o['uncertainty']:.0f} %"
        hours = "–" if o.get("hours") is None else _duration(o["hours"] * 3600)
        out.append(
            f"<tr><td>{_e(o['instance_type'])}</td><td>{_e(o['zone'])}</td><td>{_e(o['market'])}</td>"
            f"<td>{_e(o['gpu_name'])} x{_e(o['gpu_count'])}</td><td class=n>{_money(o['price_per_hour'])}/h</td>"
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
    basis = f"<p class=muted id=ranking-basis>{_e(ranking.get('basis') or '')}</p>"
    if not rows:
        return f"{head}<p class=muted id=ranking>{_e(ranking.get('note') or 'No offer known.')}</p>"
    out = []
    for i, o in enumerate(rows, 1):
        band = "" if o.get("uncertainty") is None else f" ±{100 * o['uncertainty']:.0f} %"
        hours = "–" if o.get("hours") is None else _duration(o["hours"] * 3600)
        rel = "–" if o.get("relative_cost") is None else f"{o['relative_cost']:.2f}×"
        out.append(
            f"<tr class=ranked><td class=n>{i}</td><td>{_e(o['instance_type'])}</td><td>{_e(o['zone'])}</td>"
            f"<td>{_e(o['market'])}</td><td>{_e(o['gpu_name'])} x{_e(o['gpu_count'])}</td>"
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
        f"<th>price</th><th>time for {_e(ranking.get('steps', '?'))} steps</th><th>expected cost</th>"
        f"<th>cost vs best</th></tr>" + "".join(out) + f"</table>{close}"
    )


#: the states in which a job is on its way (its remaining time and cost are an estimate, not a stop)
ON_ITS_WAY = ("running", "waiting", "not started")


def _remaining_cards(state: Any, est: dict[str, Any]) -> list[tuple[str, str]]:
    """The remaining time and cost: done / $0 once finished, the estimate while the job is on its way, and
    "stopped" / – otherwise (a failed run trains no more until someone clears it: an ETA would mislead)."""
    if state == "finished":
        return [("remaining time", "done"), ("remaining cost", "$0")]
    if state not in ON_ITS_WAY:
        return [("remaining time", "stopped"), ("remaining cost", "–")]
    spread = f" ± {_duration(est['spread_seconds'])}" if est.get("spread_seconds") else ""
    return [("remaining time", _duration(est.get("remaining_seconds")) + spread),
            ("remaining cost", _money(est.get("remaining_cost")))]


def job_page(dag_id: str, run_id: str, snap: dict[str, Any], offers: list[dict[str, Any]] | None,
             offers_error: str | None = None, ranking: dict[str, Any] | None = None) -> str:
    """One job: cards, progress, estimate, chart, attempts timeline, checkpoints, offers (and, before the
    job's first attempt, the offline ranking of instance types)."""
    est = snap.get("estimate") or {}
    total = snap.get("total_steps")
    progress = snap.get("progress")
    pct = _pct(progress)
    cards = [
        ("state", _e(snap.get("state"))),
        ("progress", f"{'–' if snap.get('current_step') is None else _e(snap['current_step'])} / {_e(total) if total else '?'} steps ({pct})"),
        ("cost so far", _money(snap.get("cost")) + (
            f" <span class=muted id=transfers>of which checkpoint transfers {_money(snap['transfer_dollars'])}</span>"
            if snap.get("transfer_dollars") else "") + (
            f" <span class=muted id=probes>of which {_e(snap.get('probes'))} spot probes "
            f"{_money(snap['probe_dollars'])}</span>" if snap.get("probe_dollars") else "") + (
            f" <span class=muted id=idle>of which warm instances idle after their last attempt "
            f"{_money(snap['idle_dollars'])}</span>" if snap.get("idle_dollars") else "")),
        ("on-demand cost of the same work", _money(snap.get("on_demand_cost"))),
        # no fraction (None) without on-demand cost to compare with: a dash, not 0 %
        ("savings", f"{_money(snap.get('savings'))} ({_pct(snap.get('savings_fraction'))})"),
        ("preemptions", _e(snap.get("preemptions", 0))),
        ("steps lost", _e(snap.get("steps_lost", 0))),
        *_remaining_cards(snap.get("state"), est),
    ]
    card_html = "".join(
        f'<div class=card id="card-{escape(label.split()[0])}">'
        f"<span class=muted>{escape(label)}</span><b>{value}</b></div>"
        for label, value in cards
    )
    try:
        width = min(100.0, max(0.0, 100 * float(progress or 0)))
    except (TypeError, ValueError):
        width = 0.0
    bar = f"<div class=bar><div style='width:{width:.1f}%'></div></div>"
    basis = f"<p class=muted id=estimate>Estimate: {_e(est['basis'])}</p>" if est.get("basis") else ""
    attempts = snap.get("attempts") or []
    timeline = (
        "<table id=attempts><tr><th>segment</th><th>attempt</th><th>instance</th><th>zone</th><th>market</th>"
        "<th title='a finished spot attempt: the price in effect over its run'>price</th><th>start (UTC)</th><th>end (UTC)</th><th>outcome</th><th>steps</th><th>kept</th><th>lost</th>"
        "<th>cost</th></tr>"
        + _attempt_rows(attempts) + "</table>"
        if attempts else "<p class=muted id=attempts>No attempt yet.</p>"
    )
    cps = snap.get("checkpoints") or []
    broken = snap.get("broken_checkpoints") or []
    # committed and broken ones together, by step: a broken one (a truncated manifest...) is shown, not hidden
    cp_rows = sorted(
        [(c.get("step"), 0, "<tr class=checkpoint><td class=n>{}</td><td>{}</td><td class=n>{}</td><td>{}</td>"
                            "<td>ok</td></tr>".format(_e(c.get("step")), _time(c.get("time")), _size(c.get("size")),
                                                      _e(c.get("writer", ""))))
         for c in cps]
        + [(b.get("step"), 1, "<tr class=broken><td class=n>{}</td><td>–</td><td class=n>–</td><td>–</td>"
                              "<td>BROKEN: {} <span class=muted>({})</span></td></tr>".format(
                                  _e(b.get("step")), _e(b.get("problem") or "does not verify"),
                                  _e(b.get("directory") or "")))
           for b in broken],
        key=lambda r: (r[0] if isinstance(r[0], int) else -1, r[1]))
    cp_table = (
        "<table id=checkpoints><tr><th>step</th><th>time (UTC)</th><th>size</th><th>writer</th><th>status</th></tr>"
        + "".join(r[2] for r in cp_rows) + "</table>"
        if cp_rows else "<p class=muted id=checkpoints>No committed checkpoint yet.</p>"
    )
    if broken:
        cp_table += (f"<p class=warn id=broken-checkpoints>{len(broken)} checkpoint"
                     f"{'s do' if len(broken) > 1 else ' does'} not verify: a resume skips "
                     f"{'them' if len(broken) > 1 else 'it'} (<code>airflow-spot checkpoints list</code> says more).</p>")
    if offers:
        offer_html = (
            "<table id=offers><tr><th>instance</th><th>zone</th><th>market</th><th>GPU</th><th>price</th>"
            f"<th>preemptions</th><th>time for {_e(offers[0].get('steps', '?'))} steps</th><th>expected cost</th></tr>"
            + _offer_rows(offers) + "</table>"
        )
    else:
        offer_html = f"<p class=muted id=offers>{_e(offers_error or 'No offers known for this job.')}</p>"
    # while the job runs too: the headline's savings count the same way
    summary_note = (
        "<p class=muted id=savings-note>Savings compare the cost with what an on-demand instance of the same type "
        "pays for the same work: a completed attempt's whole time (an on-demand run boots, restores and saves "
        "too), only the kept steps of any other attempt and of one that restarted its segment after a "
        "preemption. Time a preemption threw away, and the restart it "
        "cost, earn no savings; a running attempt counts its time so far, as it will once completed (only its "
        "steps so far when it restarted its segment after a preemption).</p>"
    )
    warnings = ""
    if snap.get("store_note"):
        warnings += f"<p class=warn id=store-note>{_e(snap['store_note'])}</p>"
    unreadable = snap.get("unreadable") or []
    if unreadable:
        warnings += (
            f"<div class=warn id=unreadable>{len(unreadable)} object{'s' if len(unreadable) > 1 else ''} in the "
            "job's store could not be read and {} left out of what this page shows:<ul>".format(
                "are" if len(unreadable) > 1 else "is")
            + "".join(f"<li><code>{_e(u.get('key'))}</code>: {_e(u.get('error'))}</li>" for u in unreadable)
            + "</ul></div>"
        )
    body = (
        f"<p><a href='/spot/'>&larr; all jobs</a></p><h1>{_e(dag_id)} / {_e(run_id)}</h1>"
        f"<p class=muted>store: {_e(snap.get('job_uri'))}</p>{warnings}<div class=cards>{card_html}</div>"
        f"{ranking_html(ranking)}"
        f"<h2>Progress</h2>{bar}{basis}<h2>Cost and progress over time</h2>{chart_svg(snap.get('series') or [], total)}"
        f"<h2>Attempts</h2>{timeline}{summary_note}<h2>Checkpoints</h2>{cp_table}"
        f"<h2>Cheapest offers now for this job's GPU request</h2>{offer_html}"
    )
    return _doc(f"Spot Training: {dag_id} / {run_id}", body, refresh=snap.get("state") in ("running", "waiting") or (
        snap.get("state") == "not started" and snap.get("run_state") in ("queued", "running")))
