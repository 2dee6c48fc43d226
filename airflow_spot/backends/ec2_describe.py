"""The describe/list side of the ``ec2`` backend: ``describe`` (and ``adescribe``), ``list_instances`` and
``stopped_instances``, batched by filter and read back into :class:`~airflow_spot.backends.base.InstanceInfo`,
with the tags a launch stamps and the offer encoded in one of them. A mixin of
:class:`~airflow_spot.backends.ec2.Ec2Backend` (it uses the backend's ``regions``, ``clients`` and
``client(region)``); ``airflow_spot.backends.ec2`` re-exports its names."""
from __future__ import annotations

from datetime import datetime

from airflow_spot.backends.base import InstanceInfo, InstanceState, TAG_JOB_URI, TerminationReason
from airflow_spot.policy.offers import Market, Offer

#: every instance we start carries this tag; ``reap`` and ``list_instances`` filter on it
TAG_MANAGED = "airflow-spot:managed"
TAG_JOB = TAG_JOB_URI
TAG_OFFER = "airflow-spot:offer"
#: EC2 tag values hold at most 256 characters
_TAG_VALUE_MAX = 256
#: EC2 refuses a request with more filter values than this (``FilterLimitExceeded``)
MAX_FILTER_VALUES = 200

_STATES = {
    "pending": InstanceState.PENDING,
    "running": InstanceState.RUNNING,
    # an instance on its way down is gone for our purposes: it serves no request any more
    "shutting-down": InstanceState.TERMINATED,
    "terminated": InstanceState.TERMINATED,
    # a stopped instance serves nothing either (never warm, never reused), but it is not gone: EC2 bills its
    # volumes until it is terminated, so terminate() and reap look at the EC2 state (_GONE), not at this one
    "stopping": InstanceState.TERMINATED,
    "stopped": InstanceState.TERMINATED,
}
#: EC2 states of a stopped instance: it serves nothing, but its volumes are billed until it is terminated
_STOPPED = frozenset({"stopping", "stopped"})

_REASONS = {
    "Server.SpotInstanceTermination": TerminationReason.PREEMPTED,
    "Client.UserInitiatedShutdown": TerminationReason.USER,
    "Client.InstanceInitiatedShutdown": TerminationReason.IDLE,
}


def encode_offer(offer: Offer) -> str:
    """The offer facts ``describe`` cannot get from EC2 itself, in one tag value."""
    return "|".join([
        f"{offer.price_per_hour:.6g}", f"{offer.on_demand_price_per_hour:.6g}", offer.gpu_name,
        str(offer.gpu_count), f"{offer.gpu_memory_gib:g}", f"{offer.relative_throughput:.6g}",
        f"{offer.preemption_rate_per_hour:.6g}", f"{offer.vcpus:g}", f"{offer.memory_gib:g}",
    ])


def decode_offer(text: str, instance_type: str, region: str, zone: str, market: Market) -> Offer:
    try:
        price, od, gpu, count, mem, thr, rate, vcpus, ram = text.split("|")
        return Offer(instance_type=instance_type, region=region, zone=zone, market=market,
                     price_per_hour=float(price), on_demand_price_per_hour=float(od), gpu_name=gpu,
                     gpu_count=int(count), gpu_memory_gib=float(mem), relative_throughput=float(thr),
                     preemption_rate_per_hour=float(rate), vcpus=float(vcpus), memory_gib=float(ram))
    except ValueError:  # not ours or edited by hand: keep what EC2 itself says
        return Offer(instance_type=instance_type, region=region, zone=zone, market=market, price_per_hour=0.0,
                     on_demand_price_per_hour=0.0, gpu_name="", gpu_count=0, gpu_memory_gib=0.0)


class Ec2Describe:
    """Describe, list and read back the backend's instances (see the module doc)."""

    @staticmethod
    def _filters(instance_ids: list[str]) -> list[dict]:
        """One paginated describe for any number of ids. A filter, not ``InstanceIds``: an unknown id is
        simply absent instead of failing the whole batch. EC2 takes at most 200 filter values per call, so
        beyond that the filter is our managed tag (every instance we launch carries it) and the caller keeps
        the ids it asked for: still one paginated call per region, however many segments are deferred."""
        if len(instance_ids) <= MAX_FILTER_VALUES:
            return [{"Name": "instance-id", "Values": list(instance_ids)}]
        return [{"Name": f"tag:{TAG_MANAGED}", "Values": ["true"]}]

    def describe(self, instance_ids: list[str]) -> dict[str, InstanceInfo]:
        return {iid: self._info(inst, region) for iid, (region, inst) in self._describe_raw(instance_ids).items()}

    def _describe_raw(self, instance_ids: list[str],
                      failed: dict[str, BaseException] | None = None) -> dict[str, tuple[str, dict]]:
        """``{id: (region, EC2's instance dict)}`` of the known ids (one paginated call per region). With
        ``failed``, a region whose describe fails is recorded there and the others are still asked."""
        ids = list(dict.fromkeys(instance_ids))
        wanted, out = set(ids), dict[str, tuple[str, dict]]()
        if not ids:
            return out
        for region in self.regions:
            try:
                pages = self.client(region).get_paginator("describe_instances").paginate(Filters=self._filters(ids))
                for page in pages:
                    for reservation in page.get("Reservations", []):
                        for inst in reservation.get("Instances", []):
                            if inst["InstanceId"] in wanted:  # a describe by tag returns every managed one
                                out[inst["InstanceId"]] = (region, inst)
            except Exception as exc:
                if failed is None:
                    raise
                failed[region] = exc
        return out

    async def adescribe(self, instance_ids: list[str]) -> dict[str, InstanceInfo]:
        if self.clients.ec2_async is None:
            return await super().adescribe(instance_ids)
        ids = list(dict.fromkeys(instance_ids))
        wanted, out = set(ids), dict[str, InstanceInfo]()
        if not ids:
            return out
        for region in self.regions:
            async with await self.clients.ec2_async(region) as client:
                async for page in client.get_paginator("describe_instances").paginate(Filters=self._filters(ids)):
                    for reservation in page.get("Reservations", []):
                        for inst in reservation.get("Instances", []):
                            if inst["InstanceId"] in wanted:
                                out[inst["InstanceId"]] = self._info(inst, region)
        return out

    def list_instances(self, tags: dict[str, str] | None = None) -> list[InstanceInfo]:
        return self._list(tags)

    def stopped_instances(self, tags: dict[str, str] | None = None) -> list[InstanceInfo]:
        """Managed instances that are stopped or stopping, carrying all ``tags``. ``describe`` and
        ``list_instances`` report them terminated (they serve nothing, nothing may reuse them), but EC2 bills
        their volumes until they are terminated: ``airflow-spot reap`` terminates them."""
        return self._list(tags, [{"Name": "instance-state-name", "Values": sorted(_STOPPED)}])

    def _list(self, tags: dict[str, str] | None, extra: list[dict] | None = None) -> list[InstanceInfo]:
        filters = [{"Name": f"tag:{TAG_MANAGED}", "Values": ["true"]}]
        filters += [{"Name": f"tag:{k}", "Values": [str(v)[:_TAG_VALUE_MAX]]} for k, v in (tags or {}).items()]
        filters += extra or []
        out = []
        for region in self.regions:
            for page in self.client(region).get_paginator("describe_instances").paginate(Filters=filters):
                for reservation in page.get("Reservations", []):
                    out += [self._info(i, region) for i in reservation.get("Instances", [])]
        return sorted(out, key=lambda i: (i.launched_at or 0.0, i.instance_id))

    @staticmethod
    def _info(inst: dict, region: str) -> InstanceInfo:
        tags = {t["Key"]: t["Value"] for t in inst.get("Tags", [])}
        state_name = inst.get("State", {}).get("Name", "pending")
        state = _STATES.get(state_name, InstanceState.PENDING)
        reason = TerminationReason.NONE
        if state.is_terminal():
            code = (inst.get("StateReason") or {}).get("Code", "")
            reason = _REASONS.get(code, TerminationReason.FAILED)
        market = Market.SPOT if inst.get("InstanceLifecycle") == "spot" else Market.ON_DEMAND
        zone = inst.get("Placement", {}).get("AvailabilityZone") or region
        offer = decode_offer(tags.get(TAG_OFFER, ""), inst.get("InstanceType", ""), region, zone, market)
        launched = inst.get("LaunchTime")
        return InstanceInfo(
            instance_id=inst["InstanceId"],
            state=state,
            offer=offer,
            job_uri=tags.get(TAG_JOB, ""),
            tags={k: v for k, v in tags.items() if k not in (TAG_OFFER,)},
            launched_at=launched.timestamp() if isinstance(launched, datetime) else None,
            reason=reason,
        )
